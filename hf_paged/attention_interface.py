"""The attention seam into transformers: the function and mask function registered under
``ATTENTION_NAME``, and the switch of a model's attention implementation.

Per forward, the cache (PagedCache or the engine's cache) binds its plan to its backend
(``KVPools.prepare``); each layer's ``cache.update`` writes the new K/V and returns the layer's pools
bound to that step (``backends.step.PagedLayer``), which is how the step reaches every attention call.
The attention function reads K/V through it and never sees a dense mask. The mask function exists
because transformers gives a custom attention name without one no padding information at all; ours
builds nothing, since the plan holds each row's causal limits: it returns a ``DeferredMask``.

While a model is switched, a forward may run without a PagedCache: another thread's plain forward, or
generate's own extra forwards inside a paged call (``guidance_scale``'s unconditional pass, an assistant
that is the model itself, early-exit drafts), each with a cache of its own or none. Their attention runs
the implementation the switch replaced (``FALLBACK``, an attribute of the model's modules while switched:
not of their configs, which a save would write out), with the mask that implementation builds from the
deferred one's arguments: the default path's result. The switch itself: ``attention_switch``.
"""
from __future__ import annotations

import contextlib
import inspect
import sys

import torch

from .attention_switch import ATTENTION_NAME, FALLBACK, switched
from .backends.step import PagedLayer

__all__ = ["ATTENTION_NAME", "paged_attention", "register", "use_paged_attention", "cache_keyword"]


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key, value, attention_mask,
                    dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """query: [B, Hq, Q, D]; key/value: what the paged cache's ``update`` returned (a ``PagedLayer``: the
    layer's pools and the forward's step).

    Returns ``(out [B, Q, Hq, D], None)``. Pad queries give zeros.
    """
    if not isinstance(key, PagedLayer):
        return replaced_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  sliding_window=sliding_window, **kwargs)
    if kwargs.get("output_attentions"):
        raise ValueError("hf_paged does not return attention weights; use output_attentions=False.")
    if dropout:
        raise ValueError("hf_paged attention is for inference: dropout must be 0 (call model.eval()).")
    batch, num_heads, q_len, head_dim = query.shape
    if batch * q_len != key.step.plan.num_tokens:
        raise RuntimeError(f"the forward has {batch} x {q_len} query tokens but its plan has "
                           f"{key.step.plan.num_tokens}: the inputs changed after the cache planned the step")
    scale = scaling if scaling is not None else head_dim ** -0.5
    tokens = query.transpose(1, 2).reshape(batch * q_len, num_heads, head_dim)
    out = key.step.attend(tokens, key.k_pool, key.v_pool, scale, layer_window(module, sliding_window))
    return out.reshape(batch, q_len, num_heads, head_dim), None


def layer_window(module: torch.nn.Module, sliding_window: int | None) -> int:
    """The window a layer's attention applies (0: none): the ``sliding_window`` its forward passes, else
    its own ``sliding_window`` attribute. Qwen2-MoE's attention passes none and sets the attribute on its
    sliding layers only (transformers then applies the window through the layer's mask, which the paged
    path never builds); the other families that set the attribute pass it too."""
    if sliding_window is None:
        sliding_window = getattr(module, "sliding_window", None)
    return int(sliding_window or 0)


class DeferredMask:
    """What the mask function returns: nothing built (the plan carries the masking). A forward without a
    PagedCache builds, once, the mask of the implementation the switch replaced, from these arguments."""

    __slots__ = ("kwargs", "built")

    def __init__(self, kwargs: dict):
        self.kwargs, self.built = kwargs, {}

    def build(self, implementation: str):
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        if implementation not in self.built:
            self.built[implementation] = ALL_MASK_ATTENTION_FUNCTIONS[implementation](**self.kwargs)
        return self.built[implementation]


def no_dense_mask(**kwargs) -> DeferredMask:
    """Mask function for ``ATTENTION_NAME``: nothing is built (see ``DeferredMask``)."""
    return DeferredMask(kwargs)


def replaced_attention(module: torch.nn.Module, query, key, value, attention_mask, **kwargs):
    """The attention of a forward that runs without a PagedCache while the model is switched: the
    implementation the switch replaced, with its own mask (see the module's docstring)."""
    implementation = module.__dict__.get(FALLBACK)
    if implementation is None:         # a forward begun before the switch, its attention after the restore
        config_implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
        implementation = config_implementation if config_implementation != ATTENTION_NAME else None
    if implementation is None:
        raise RuntimeError(
            f"attn_implementation={ATTENTION_NAME!r} needs a hf_paged.PagedCache (and a patched model): "
            "generate with cache_implementation='paged' after hf_paged.patch(model), or pass "
            "past_key_values=hf_paged.PagedCache(model.config).")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    function = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager) if implementation != "eager" else eager
    if function is None:
        raise RuntimeError(f"a forward without a PagedCache ran while the model is switched to {ATTENTION_NAME!r}, "
                           f"and the {implementation!r} attention it replaced cannot be found for "
                           f"{type(module).__name__}")
    if isinstance(attention_mask, DeferredMask):
        attention_mask = attention_mask.build(implementation)
    return function(module, query, key, value, attention_mask, **kwargs)


def register() -> None:
    """Add ``ATTENTION_NAME`` to transformers' attention and mask registries (idempotent).

    This adds a name; it changes no existing entry, so models using other implementations are untouched.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, no_dense_mask)


@contextlib.contextmanager
def use_paged_attention(model):
    """Switch ``model`` to the hf_paged attention for the block (for direct forwards with a PagedCache).

    Nested and concurrent blocks (threads generating on one model) share the switch: the first switches, the
    last restores the model's own implementation once the forwards begun meanwhile ended (``attention_switch``)."""
    register()
    with switched(model):
        yield model


def cache_keyword(model) -> str:
    """The keyword this transformers release uses for the cache (``cache`` since 5.2x, else past_key_values)."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
