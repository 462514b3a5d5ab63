"""The fused attention and decoder-layer forwards of ``hf_paged.engine.fused`` (see its module doc).

Both restate transformers 5.24's forwards of the families (fused_base.FAMILY_CLASSES) step by
step, with rotary embedding as one in-place op on the fresh q/k projections and the layer's residual add
fused with the norm that follows it; every other step is the module's own (sub-modules are called as
modules, so prepacked linears, fused norms and their hooks apply).
"""
from __future__ import annotations

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .fused_base import _Fused, _has_hooks, _rows, _usable, norm_fusible, passed_window, rotate_qk
from .fused_lean import LeanLayer
from .prepack import sibling_outputs


class Attention(_Fused):
    """spec: qk_norm (Qwen3's q_norm/k_norm before rotary), interleaved (GLM's pairwise, partial rotary),
    window (what the class passes as ``sliding_window`` to the attention function: fused_base.passed_window),
    eager (the family's eager attention, transformers' default when no implementation is registered)."""

    def __init__(self, module, ops, **spec):
        super().__init__(module, ops, **spec)
        # rotary_ writes the projections' (or Qwen3's norms') outputs in place: hooks there must not see that
        self.bypassed = ("q_proj", "k_proj") + (("q_norm", "k_norm") if spec["qk_norm"] else ())

    def __call__(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                 past_key_values=None, **kwargs):
        m, spec = self.module, self.spec
        cache = cache if cache is not None else past_key_values
        if position_embeddings is None or not (self.here() and _usable(hidden_states, m)) or \
                position_embeddings[0].dtype != hidden_states.dtype:
            return self.own(hidden_states, position_embeddings, attention_mask, **{self.cache_kw: cache}, **kwargs)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, m.head_dim)
        projections = (m.q_proj, m.k_proj, m.v_proj)
        qkv = None if any(_has_hooks(p) for p in projections) else sibling_outputs(projections, hidden_states)
        query, key, value = qkv if qkv is not None else (p(hidden_states) for p in projections)
        query, key = query.view(hidden_shape), key.view(hidden_shape)
        if spec["qk_norm"]:
            query, key = m.q_norm(query), m.k_norm(key)
        value = value.view(hidden_shape).transpose(1, 2)
        query, key = rotate_qk(self.ops, query, key, *position_embeddings, spec["interleaved"])
        if cache is not None:
            key, value = cache.update(key, value, m.layer_idx, kwargs=kwargs)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(m.config._attn_implementation, spec["eager"])
        if spec["window"] is not None:
            kwargs = {**kwargs, "sliding_window": passed_window(m, spec["window"])}
        out, weights = attend(m, query, key, value, attention_mask,
                              dropout=0.0 if not m.training else m.attention_dropout, scaling=m.scaling, **kwargs)
        return m.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


class DecoderLayer(_Fused):
    """spec: sandwich (GLM-4-0414's post_self_attn_layernorm and post_mlp_layernorm). ``lean``: the layer as
    direct op calls for this installation (``fused_lean``; None: the module-by-module forward below)."""
    lean: LeanLayer | None = None

    def prepare(self, attention_spec: dict | None, direct: bool = True, one_call: bool = True) -> None:
        """At each installation: the lean forward, where its checks hold (``attention_spec``: the fused
        attention's spec of this layer; None: no lean forward; ``direct``: its direct form allowed;
        ``one_call``: that form as one C++ call where it may)."""
        self.lean = None if attention_spec is None else \
            LeanLayer.build(self.module, self.ops, attention_spec, self.spec["sandwich"], direct, one_call)

    def __call__(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                 position_embeddings=None, past_key_values=None, **kwargs):
        m = self.module
        cache = cache if cache is not None else past_key_values
        here = self.here()
        lean = self.lean if here else None
        if lean is not None and not kwargs.get("output_attentions") and \
                lean.applies(hidden_states, position_embeddings, cache):
            return lean(hidden_states, position_embeddings, cache, kwargs)
        if not (here and _usable(hidden_states, m)):
            return self.own(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=use_cache, position_embeddings=position_embeddings, **{self.cache_kw: cache},
                            **kwargs)
        residual = hidden_states
        hidden_states, _ = m.self_attn(hidden_states=m.input_layernorm(hidden_states), attention_mask=attention_mask,
                                       position_ids=position_ids, use_cache=use_cache,
                                       position_embeddings=position_embeddings, **{self.cache_kw: cache}, **kwargs)
        if self.spec["sandwich"]:
            hidden_states = m.post_self_attn_layernorm(hidden_states)
        residual, hidden_states = self._add_norm(m.post_attention_layernorm, hidden_states, residual)
        hidden_states = m.mlp(hidden_states)
        if self.spec["sandwich"]:
            hidden_states = m.post_mlp_layernorm(hidden_states)
        return residual + hidden_states

    def _add_norm(self, norm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, norm(residual + x)), in one op when ``norm`` is a known, hook-free RMSNorm."""
        if not (norm_fusible(norm, x) and residual.shape == x.shape and residual.dtype == x.dtype):
            total = residual + x
            return total, norm(total)
        total, normed = self.ops.add_rms_norm(_rows(x), _rows(residual), norm.weight, norm.variance_epsilon)
        return total.view(x.shape), normed.view(x.shape)

