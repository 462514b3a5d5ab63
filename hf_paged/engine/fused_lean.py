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

from ..attention_interface import ATTENTION_NAME, layer_window, paged_attention
from ..kivi import KiviPool
from .fused_base import _DTYPES, _has_hooks, _rows, _silu, norm_fusible, passed_window, rotate_qk
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


def rotary_rows(workspace, position_embeddings, rows: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [*rows, D] as contiguous [N, D] (as ``rotate_qk`` shapes them), made once per forward: every
    layer gets the same two tensors (kept in the step's workspace with them)."""
    cos, sin = position_embeddings
    kept = workspace.rotary
    if kept is None or kept[0] is not cos or kept[1] is not sin:
        kept = workspace.rotary = (cos, sin, *(t.expand(*rows, t.shape[-1]).reshape(-1, t.shape[-1]).contiguous()
                                                for t in (cos, sin)))
    return kept[2], kept[3]


def _dense_mlp(mlp) -> bool:
    """Whether ``mlp`` is a dense gated MLP of nn.Linear projections (GLM's gate_up_proj, or gate/up)."""
    names = ("gate_up_proj", "down_proj") if hasattr(mlp, "gate_up_proj") else ("gate_proj", "up_proj", "down_proj")
    return all(isinstance(getattr(mlp, n, None), torch.nn.Linear) for n in names)


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
    scaling: float | None                     # (None: paged_attention's head_dim ** -0.5)
    window: int
    interleaved: bool
    direct: bool = True                       # the direct form where the step allows it (``_direct``)
    qkv_heads: tuple[int, ...] = ()           # heads of q, k and v in the qkv product (``_direct``)
    layer_call: tuple | None = None           # (lean_layer, _quant, _kivi, their constant arguments): one call

    @classmethod
    def build(cls, layer: torch.nn.Module, ops, attention_spec: dict, sandwich: bool,
              direct: bool = True, one_call: bool = True) -> LeanLayer | None:
        """The lean forward of ``layer`` (a known decoder layer), or None when a check fails."""
        attn, mlp = layer.self_attn, layer.mlp
        if not _dense_mlp(mlp):
            return None                     # a MoE block (Mixtral, Qwen2/3-MoE): the layer runs module by module
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
        window = layer_window(attn, passed_window(attn, attention_spec["window"]))
        qk_norm = attention_spec["qk_norm"]
        layer_call = None
        if direct and one_call:             # lean_layer's order: input, post, (q, k), (GLM-4's sandwich)
            ordered = fused_norms[:2] + (fused_norms[-2:] if qk_norm else []) + (fused_norms[2:4] if sandwich else [])
            packed = [groups[name] for name in ("qkv", "o", "gate_up", "down")]
            layer_call = (ops.lean_layer, ops.lean_layer_quant, ops.lean_layer_kivi, [n.weight for n in ordered],
                          [float(n.eps) for n in ordered], [g.packed for g in packed], [g.bias for g in packed],
                          [g.n for g in packed])
        return cls(ops, dtype, fused_norms[0], fused_norms[1], tuple(fused_norms[2:4]) if sandwich else None,
                   tuple(fused_norms[-2:]) if qk_norm else None, groups["qkv"], groups["o"],
                   groups["gate_up"], split, groups["down"], attn, attn.head_dim, attn.layer_idx, attn.scaling,
                   window, attention_spec["interleaved"], direct,
                   tuple(size // attn.head_dim for size in groups["qkv"].sizes), layer_call)

    def applies(self, hidden_states: torch.Tensor, position_embeddings, cache) -> bool:
        """The per-call checks (the rest were made by ``build``)."""
        return (hidden_states.dtype == self.dtype and hidden_states.device.type == "cpu" and cache is not None
                and not torch.is_grad_enabled() and position_embeddings is not None
                and position_embeddings[0].dtype == self.dtype)

    def __call__(self, hidden_states: torch.Tensor, position_embeddings, cache, kwargs: dict) -> torch.Tensor:
        """The fused forwards' steps (fused_layers.DecoderLayer, Attention, fused_base._Mlp), in their order
        and with their tensor shapes."""
        direct = getattr(cache, "direct", None) if self.direct else None
        if direct is not None and not self.qkv.library_sized(hidden_states):
            pools = direct(self.layer_idx, self.dtype)
            if pools is not None:
                return self._direct(hidden_states, position_embeddings, cache, *pools)
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
        query, key = rotate_qk(ops, query, key, *position_embeddings, self.interleaved)
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        out, _ = paged_attention(self.attention, query, key, value, None, scaling=self.scaling,
                                 sliding_window=self.window)
        out = self.o.output(out.reshape(*input_shape, -1).contiguous())
        if self.sandwich is not None:
            out = self.sandwich[0](ops, out)
        total, normed = ops.add_rms_norm(_rows(out), _rows(residual), self.post_norm.weight, self.post_norm.eps)
        residual, x = total.view(out.shape), normed.view(out.shape)
        out = self._mlp(x)
        if self.sandwich is not None:
            out = self.sandwich[1](ops, out)
        return residual + out

    def _direct(self, hidden_states: torch.Tensor, position_embeddings, cache, k_pool, v_pool, step) -> torch.Tensor:
        """``__call__``'s ops on the same tensors (so the same numbers, bit for bit), as rows [N, features]:
        the packed products whole (``_Packed.product``: the views ``outputs`` would split them into), the write
        and the attention without ``update`` and the attention interface (``KVPools.direct``): model-dtype pools
        straight to the step's C++ calls, quantised ones through ``KVPools.write_rows`` and ``Step.attend``; all of
        the layer's calls made by one C++ op where the step's ops are the extension's own: ``lean_layer``
        (``CpuStep.direct_metadata``), for quantised row formats ``lean_layer_quant`` (``CpuStep.quant_metadata``), for
        KIVI pools ``lean_layer_kivi`` (``CpuStep.kivi_metadata``: the write plan made in Python, once per step, its
        index tensors and the sealed rows it returns passed through).
        The Python between the ops was about a quarter of a decode step's layer (SmolLM2, 2 threads)."""
        ops, d = self.ops, self.head_dim
        h = _rows(hidden_states)
        n = h.shape[0]
        if n != step.plan.num_tokens:
            raise RuntimeError(f"the forward has {n} query tokens but its plan has {step.plan.num_tokens}: the "
                               "inputs changed after the cache planned the step")
        scale = float(self.scaling if self.scaling is not None else d ** -0.5)
        plan, kivi_plan = step.plan, None
        if isinstance(k_pool, KiviPool):    # this layer's share of the step's KIVI write plan, taken once
            kivi_plan = cache.kivi_write_plan(self.layer_idx, plan.slot_mapping, plan.token_pos)
        if self.layer_call is not None:     # the same calls in C++ (cuda/lean_layer_cpu.cpp)
            plain_op, quant_op, kivi_op, norms, eps, weights, biases, widths = self.layer_call
            if type(k_pool) is torch.Tensor:
                op, metadata = plain_op, step.direct_metadata
            elif kivi_plan is not None:
                op, metadata = kivi_op, step.kivi_metadata(k_pool, v_pool, kivi_plan, self.dtype)
            else:
                op, metadata = quant_op, step.quant_metadata(k_pool, v_pool)
            if metadata is not None:
                cos, sin = rotary_rows(step.workspace, position_embeddings, hidden_states.shape[:-1])
                pools = (k_pool, v_pool) if op is plain_op else ()
                out = op(h, norms, eps, weights, biases, widths, self.qkv_heads, d, self.qkv.ops is not None,
                         self.qk_norm is not None, self.sandwich is not None, self.interleaved, cos, sin, *pools,
                         *metadata, scale, self.window)
                if op is kivi_op:            # the rows the write sealed, read by this step's queries in them
                    out, k_pool.fresh.rows, v_pool.fresh.rows = out
                return out.view(hidden_states.shape)
        qkv = self.qkv.product(ops.rms_norm(h, self.input_norm.weight, self.input_norm.eps))
        query, key, value = qkv.view(n, -1, d).split_with_sizes(self.qkv_heads, 1)
        if self.qk_norm is not None:
            query, key = (ops.rms_norm(x.reshape(-1, d), norm.weight, norm.eps).view(n, -1, d)
                          for x, norm in zip((query, key), self.qk_norm))
        ops.rotary_(query, key, *rotary_rows(step.workspace, position_embeddings, hidden_states.shape[:-1]),
                    self.interleaved)
        if type(k_pool) is torch.Tensor:
            step.write_direct(key, value, k_pool, v_pool)
            out = step.attend_direct(query.contiguous(), k_pool, v_pool, scale, self.window)
        else:
            cache.write_rows(self.layer_idx, key, value, plan.slot_mapping, plan.writes_all, plan.token_pos, kivi_plan)
            out = step.attend(query, k_pool, v_pool, scale, self.window)
        out = self.o.product(out.view(n, -1))
        if self.sandwich is not None:
            out = ops.rms_norm(out, self.sandwich[0].weight, self.sandwich[0].eps)
        total, normed = ops.add_rms_norm(out, h, self.post_norm.weight, self.post_norm.eps)
        gate_up = self.gate_up.product(normed)
        half = gate_up.shape[-1] // 2
        out = self.down.product(ops.silu_mul(gate_up[:, :half], gate_up[:, half:]))
        if self.sandwich is not None:
            out = ops.rms_norm(out, self.sandwich[1].weight, self.sandwich[1].eps)
        return total.add_(out).view(hidden_states.shape)          # (total: add_rms_norm's own new tensor)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:    # = fused_base._Mlp
        if self.split:
            gate_up = self.gate_up.output(x)
            half = gate_up.shape[-1] // 2
            rows = _rows(gate_up)
            gate, up = rows[:, :half], rows[:, half:]
        else:
            gate, up = (_rows(y) for y in self.gate_up.outputs(x))
            half = gate.shape[-1]
        return self.down.output(self.ops.silu_mul(gate, up).view(*x.shape[:-1], half))
