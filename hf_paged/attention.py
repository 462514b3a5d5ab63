"""The attention and mask functions registered with transformers under ``ATTENTION_NAME``.

The attention function reads K/V through the step plan that ``PagedCache.update`` put into the
attention kwargs; it never sees a dense mask. The mask function exists because transformers gives a
custom attention name without one no padding information at all; ours returns None cheaply, since
the plan already holds each row's causal limits (no O(B·Q·KV) mask is built).
"""
from __future__ import annotations

import torch

from .cache import PLAN_KWARG
from .plan import PackedPlan

ATTENTION_NAME = "hf_paged"


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask, dropout: float = 0.0, scaling: float | None = None,
                    sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query: [B, Hq, Q, D]; key/value: the layer's pools [num_blocks, block_size, Hkv, D].

    Returns ``(out [B, Q, Hq, D], None)``. Pad queries give zeros.
    """
    plan = kwargs.get(PLAN_KWARG)
    if plan is None:
        raise RuntimeError(
            f"attn_implementation={ATTENTION_NAME!r} needs a hf_paged.PagedCache (and a patched model): "
            "generate with cache_implementation='paged' after hf_paged.patch(model), or pass "
            "past_key_values=hf_paged.PagedCache(model.config).")
    if kwargs.get("output_attentions"):
        raise ValueError("hf_paged does not return attention weights; use output_attentions=False.")
    if dropout:
        raise ValueError("hf_paged attention is for inference: dropout must be 0 (call model.eval()).")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = int(sliding_window or 0)
    if isinstance(plan, PackedPlan):
        return packed_attention(plan, query, key, value, scale, window), None
    if plan.is_decode:
        out = plan.backend.decode_attention(query[:, :, 0], key, value, plan.block_tables, plan.decode_lens,
                                            scale, window, plan.max_context)
        return out.unsqueeze(1), None
    out = plan.backend.extend_attention(query, key, value, plan.block_tables, plan.context_lens, plan.query_pos,
                                        scale, window, plan.max_context)
    return out.transpose(1, 2), None


def packed_attention(plan: PackedPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scale: float, window: int) -> torch.Tensor:
    """query: [1, Hq, N, D] (packed tokens of many sequences) -> out [1, N, Hq, D].

    Decode tokens go to the backend's decode attention as they are; the others are scattered into
    the extend plan's padded [B_e, Hq, Q_e, D] (zeros elsewhere, query_pos -1), attended, and gathered back.
    """
    _, num_heads, total, head_dim = query.shape
    packed = query[0].transpose(0, 1)                                       # [N, Hq, D]
    backend, nd = plan.backend, plan.num_decode
    parts = []
    if plan.decode is not None:
        d = plan.decode
        parts.append(backend.decode_attention(packed[:nd].contiguous(), key, value, d.block_tables,
                                              d.decode_lens, scale, window, d.max_context))
    if plan.extend is not None:
        e = plan.extend
        rows, q_len = e.query_pos.shape
        padded = packed.new_zeros(rows * q_len, num_heads, head_dim)
        padded.index_copy_(0, e.packed_index, packed[nd:])
        out = backend.extend_attention(padded.view(rows, q_len, num_heads, head_dim).transpose(1, 2), key, value,
                                       e.block_tables, e.context_lens, e.query_pos, scale, window, e.max_context)
        parts.append(out.transpose(1, 2).reshape(rows * q_len, num_heads, head_dim).index_select(0, e.packed_index))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.unsqueeze(0)


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
