"""A decoder layer's whole engine step as direct op calls (``fused_layers.DecoderLayer``'s fast path).

The fused forwards (``fused_layers``) keep transformers' module structure: each decoder layer calls its
norms, attention, projections and MLP as modules, and each of those checks, per call, whether it may use
its op (hooks, dtype, grad, the packed weight's version). At the engine's decode steps on a CPU that Python
costs about a tenth of a step (SmolLM2-135M, 14 rows: 58 -> 52 ms per step without it). ``LeanLayer.build``
makes those checks once per installation (``FusedOps.installed``, i.e. once per engine step): no hooks on
the layer or anything it would bypass, eval mode, the norms fusible, the projections prepacked with their
current weights, the paged attention in use. When they hold, the layer's forward runs the same ops on the
same tensors in the same order as the fused module forwards (so the same numbers, bit for bit; tests:
test_fused_lean.py), with only the per-call checks that depend on the input (grad, device, dtype).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention_interface import ATTENTION_NAME
from ..backends.step import PagedLayer
from .fused_base import _DTYPES, _has_hooks, _rows, _silu, norm_fusible
from .prepack import packed_group


@dataclass(frozen=True)
class _Norm:
    weight: torch.Tensor
    eps: float

    def __call__(self, ops, x: torch.Tensor) -> torch.Tensor:          # = fused_base._Norm on x
        return ops.rms_norm(_rows(x), self.weight, self.eps).view(x.shape)


def _norm(module, dtype) -> _Norm | None:
    probe = torch.empty(0, dtype=dtype)
    return _Norm(module.weight, module.variance_epsilon) if norm_fusible(module, probe) else None


@dataclass(frozen=True)
class LeanLayer:
    """The layer's constants and packed groups, valid for one installation (see the module doc)."""
    ops: object
    dtype: torch.dtype
    input_norm: _Norm
    post_norm: _Norm
    sandwich: tuple[_Norm, _Norm] | None      # GLM-4: after attention, after the MLP
    qk_norm: tuple[_Norm, _Norm] | None       # Qwen3: on q and k before rotary
    qkv: object                               # prepack._Packed of (q_proj, k_proj, v_proj)
    o: object
    gate_up: object                           # (gate_proj, up_proj), or GLM's gate_up_proj
    split: bool                               # GLM: gate_up_proj's halves
    down: object
    attention: torch.nn.Module
    head_dim: int
    layer_idx: int
    scaling: float
    window: int
    interleaved: bool

    @classmethod
    def build(cls, layer: torch.nn.Module, ops, attention_spec: dict, sandwich: bool) -> LeanLayer | None:
        """The lean forward of ``layer`` (a known decoder layer), or None when a check fails."""
        attn, mlp = layer.self_attn, layer.mlp
        split = hasattr(mlp, "gate_up_proj")
        if split:
            act = getattr(mlp, "activation_fn", None)
            projections = {"gate_up": (mlp.gate_up_proj,), "down": (mlp.down_proj,)}
        else:
            act = getattr(mlp, "act_fn", None)
            projections = {"gate_up": (mlp.gate_proj, mlp.up_proj), "down": (mlp.down_proj,)}
        projections.update(qkv=(attn.q_proj, attn.k_proj, attn.v_proj), o=(attn.o_proj,))
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if sandwich:
            norms += [layer.post_self_attn_layernorm, layer.post_mlp_layernorm]
        if attention_spec["qk_norm"]:
            norms += [attn.q_norm, attn.k_norm]
        modules = [layer, attn, mlp, *norms, *(m for group in projections.values() for m in group)]
        if act is None or not _silu(act) or any(_has_hooks(m) or m.training for m in modules) \
                or attn.config._attn_implementation != ATTENTION_NAME:
            return None
        groups = {name: packed_group(members) for name, members in projections.items()}
        dtype = attn.q_proj.weight.dtype
        fused_norms = [_norm(n, dtype) for n in norms]
        if dtype not in _DTYPES or None in groups.values() or None in fused_norms \
                or len({g.dtype for g in groups.values()}) != 1:
            return None
        window = getattr(attn, "sliding_window", None) if attention_spec["window"] else None
        return cls(ops, dtype, fused_norms[0], fused_norms[1], tuple(fused_norms[2:4]) if sandwich else None,
                   tuple(fused_norms[-2:]) if attention_spec["qk_norm"] else None, groups["qkv"], groups["o"],
                   groups["gate_up"], split, groups["down"], attn, attn.head_dim, attn.layer_idx,
                   attn.scaling if attn.scaling is not None else attn.head_dim ** -0.5,
                   int(window or 0), attention_spec["interleaved"])

    def applies(self, hidden_states: torch.Tensor, position_embeddings, cache) -> bool:
        """The per-call checks (the rest were made by ``build``)."""
        return (hidden_states.dtype == self.dtype and hidden_states.device.type == "cpu" and cache is not None
                and not torch.is_grad_enabled() and position_embeddings is not None
                and position_embeddings[0].dtype == self.dtype)

    def __call__(self, hidden_states: torch.Tensor, position_embeddings, cache, kwargs: dict) -> torch.Tensor:
        """The fused forwards' steps (fused_layers.DecoderLayer, Attention, fused_base._Mlp), in their order
        and with their tensor shapes."""
        ops = self.ops
        residual = hidden_states
        x = self.input_norm(ops, hidden_states)
        input_shape = x.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query, key, value = self.qkv.outputs(x)
        query, key = query.view(hidden_shape), key.view(hidden_shape)
        if self.qk_norm is not None:
            query, key = self.qk_norm[0](ops, query), self.qk_norm[1](ops, key)
        value = value.view(hidden_shape).transpose(1, 2)
        query, key = self._rotated(query, key, *position_embeddings)
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        out = self._attend(query, key)
        out = self._linear(self.o, out.reshape(*input_shape, -1).contiguous())
        if self.sandwich is not None:
            out = self.sandwich[0](ops, out)
        total, normed = ops.add_rms_norm(_rows(out), _rows(residual), self.post_norm.weight, self.post_norm.eps)
        residual, x = total.view(out.shape), normed.view(out.shape)
        out = self._mlp(x)
        if self.sandwich is not None:
            out = self.sandwich[1](ops, out)
        return residual + out

    def _rotated(self, query, key, cos, sin):           # = fused_layers.Attention._rotated
        query, key = (x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous() for x in (query, key))
        tokens, d = query.shape[0] * query.shape[1], query.shape[-1]
        cos = cos.expand(*query.shape[:2], cos.shape[-1]).reshape(tokens, -1)
        sin = sin.expand(*query.shape[:2], sin.shape[-1]).reshape(tokens, -1)
        self.ops.rotary_(query.view(tokens, -1, d), key.view(tokens, -1, d), cos.contiguous(), sin.contiguous(),
                         self.interleaved)
        return query.transpose(1, 2), key.transpose(1, 2)

    def _attend(self, query: torch.Tensor, layer) -> torch.Tensor:
        """= attention_interface.paged_attention's call, for query [B, Hq, Q, D] -> [B, Q, Hq, D]."""
        if not isinstance(layer, PagedLayer):
            raise RuntimeError(f"attn_implementation={ATTENTION_NAME!r} needs a paged cache (the engine's)")
        batch, num_heads, q_len, head_dim = query.shape
        if batch * q_len != layer.step.plan.num_tokens:
            raise RuntimeError(f"the forward has {batch} x {q_len} query tokens but its plan has "
                               f"{layer.step.plan.num_tokens}: the inputs changed after the cache planned the step")
        tokens = query.transpose(1, 2).reshape(batch * q_len, num_heads, head_dim)
        out = layer.step.attend(tokens, layer.k_pool, layer.v_pool, self.scaling, self.window)
        return out.reshape(batch, q_len, num_heads, head_dim)

    @staticmethod
    def _linear(packed, x: torch.Tensor) -> torch.Tensor:
        """= prepack._PackedLinear on a module of its own group."""
        if packed.library_sized(x):
            module = packed.modules[0]
            return torch.nn.functional.linear(x, module.weight, module.bias)
        out = packed.outputs(x)[0]
        return out if out.is_contiguous() else out.contiguous()

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:    # = fused_base._Mlp
        if self.split:
            gate_up = self._linear(self.gate_up, x)
            half = gate_up.shape[-1] // 2
            rows = _rows(gate_up)
            gate, up = rows[:, :half], rows[:, half:]
        else:
            gate, up = (_rows(y) for y in self.gate_up.outputs(x))
            half = gate.shape[-1]
        return self._linear(self.down, self.ops.silu_mul(gate, up).view(*x.shape[:-1], half))
