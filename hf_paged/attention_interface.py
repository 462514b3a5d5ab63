"""The attention seam into transformers: the function and mask function registered under
``ATTENTION_NAME``, and the switch of a model's attention implementation.

Per forward, the cache (PagedCache or the engine's cache) binds its plan to its backend
(``KVPools.prepare``); each layer's ``cache.update`` writes the new K/V and returns the layer's pools
bound to that step (``backends.step.PagedLayer``), which is how the step reaches every attention call.
The attention function reads K/V through it and never sees a dense mask. The mask function exists
because transformers gives a custom attention name without one no padding information at all; ours
builds nothing, since the plan holds each row's causal limits.
"""
from __future__ import annotations

import contextlib
import inspect
import threading

import torch

from .backends.step import PagedLayer

ATTENTION_NAME = "hf_paged"


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key, value, attention_mask,
                    dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """query: [B, Hq, Q, D]; key/value: what the paged cache's ``update`` returned (a ``PagedLayer``: the
    layer's pools and the forward's step).

    Returns ``(out [B, Q, Hq, D], None)``. Pad queries give zeros.
    """
    if not isinstance(key, PagedLayer):
        raise RuntimeError(
            f"attn_implementation={ATTENTION_NAME!r} needs a hf_paged.PagedCache (and a patched model): "
            "generate with cache_implementation='paged' after hf_paged.patch(model), or pass "
            "past_key_values=hf_paged.PagedCache(model.config).")
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


def no_dense_mask(*args, **kwargs) -> None:
    """Mask function for ``ATTENTION_NAME``: the plan carries the masking, so nothing is built."""
    return None


def register() -> None:
    """Add ``ATTENTION_NAME`` to transformers' attention and mask registries (idempotent).

    This adds a name; it changes no existing entry, so models using other implementations are untouched.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, no_dense_mask)


class _AttentionSwitch:
    """Per model: how many paged calls are running, and the implementation to restore after the last."""

    def __init__(self):
        self.lock = threading.Lock()
        self.users = 0
        self.previous: str | None = None


@contextlib.contextmanager
def use_paged_attention(model):
    """Switch ``model`` to the hf_paged attention for the block (for direct forwards with a PagedCache).

    Nested and concurrent blocks (threads generating on one model) share the switch: the first
    switches, the last restores the model's own implementation."""
    register()
    switch = model.__dict__.setdefault("_hf_paged_attention_switch", _AttentionSwitch())   # atomic
    with switch.lock:
        if switch.users == 0:
            switch.previous = model.config._attn_implementation
            if switch.previous != ATTENTION_NAME:
                model.set_attn_implementation(ATTENTION_NAME)
        switch.users += 1
    try:
        yield model
    finally:
        with switch.lock:
            switch.users -= 1
            if switch.users == 0 and switch.previous != ATTENTION_NAME:
                model.set_attn_implementation(switch.previous)


def cache_keyword(model) -> str:
    """The keyword this transformers release uses for the cache (``cache`` since 5.2x, else past_key_values)."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
