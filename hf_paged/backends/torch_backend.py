"""PyTorch paged attention: the CPU path and the reference the CUDA kernels are tested against.

Pool layout (one for every backend)
-----------------------------------
Per layer, keys and values each live in a head-major pool tensor

    k_pool, v_pool : [num_kv_heads, num_blocks, block_size, head_dim]   (contiguous, model dtype)

(Head-major, 2026-11-29: each (head, block) is one contiguous [block_size, head_dim] tile, so one
gather per step yields [Hkv, B, L, D] directly — 1.6x faster on CPU than token-major — and a GPU CTA
for one KV head streams contiguous tiles.) Slot ``s`` is token ``s % block_size`` of block
``s // block_size``; ``pool.view(Hkv, -1, D)[:, s]`` is its ``[Hkv, D]`` row. A sequence's tokens are
the slots named by its block table, in order: stored index ``j`` lives in block
``block_tables[b, j // block_size]`` at offset ``j % block_size``. Only real tokens are stored, so
the stored index of a token equals its position id. Quantised pools (``kv_cache_dtype``) are
``hf_paged.kv_formats.QuantizedPool`` objects with the same block geometry; every function here hands them
to ``quantized_torch``.

Step metadata: ``hf_paged.plan.StepPlan`` (built once per forward, read by every layer). The functions
here take its padded view (``plan.padded_view``): ``block_tables`` int32 [B, max_blocks] (entries past
a row's blocks are 0), ``context_lens`` int32 [B] (stored tokens after this step's write) and
``query_pos`` int32 [B, Q] (stored index of each query, -1 for pads).
A query at stored index ``p`` sees keys ``j`` with ``j <= p`` and, with a sliding window ``w > 0``,
``p - j < w``. Pad queries (``query_pos == -1``) and rows with no keys give zeros, never NaN.
:class:`TorchBackend` is this module behind the backend protocol of ``hf_paged.backends.step``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kv_formats import QuantizedPool
from ..plan import StepPlan
from . import quantized_torch
from .step import Step, Workspace


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, writes_all: bool = False) -> None:
    """Store new keys/values into their slots.

    key, value: [N, Hkv, D] (any strides); slot_mapping: int64 [N], -1 = skip. ``writes_all``: the caller
    knows no entry is -1 (``StepPlan.writes_all``), so the mask is not read back (no host sync).
    """
    if isinstance(k_pool, QuantizedPool):
        return quantized_torch.write_kv(k_pool, v_pool, key, value, slot_mapping, writes_all)
    num_kv_heads, _, _, head_dim = k_pool.shape
    slot_mapping, key, value = quantized_torch.kept_writes(slot_mapping, key, value, writes_all)
    k_pool.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, key.transpose(0, 1).to(k_pool.dtype))
    v_pool.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, value.transpose(0, 1).to(v_pool.dtype))


def copy_blocks(pools: list[torch.Tensor], pairs: torch.Tensor) -> None:
    """Copy-on-write: block ``dst`` = block ``src`` (all heads) for every ``(src, dst)`` row of int64
    ``pairs`` [P, 2], in every pool tensor given (all layers, keys and values)."""
    if pairs.numel() == 0:
        return
    src, dst = pairs[:, 0], pairs[:, 1]
    for pool in pools:
        pool.index_copy_(1, dst, pool.index_select(1, src))


def gather_kv(pool: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """Read the first ``length`` stored tokens of every row: returns [Hkv, B, length, D] (one copy).

    The head-major pool gathers straight into the layout the matmuls want, so the KV is copied once
    and never repeated per query head.
    """
    num_kv_heads, _, block_size, head_dim = pool.shape
    table = block_tables[:, :-(-length // block_size)]
    batch, width = table.shape
    out = pool.index_select(1, table.reshape(-1).long())   # [Hkv, B*width, block_size, D]
    return out.view(num_kv_heads, batch, width * block_size, head_dim)[:, :, :length]


def visible_keys(query_pos: torch.Tensor, length: int, sliding_window: int) -> torch.Tensor:
    """Bool [B, Q, length]: which stored keys each query sees (causal, optional window, pads none)."""
    keys = torch.arange(length, device=query_pos.device)
    pos = query_pos.unsqueeze(-1)
    visible = keys <= pos
    if sliding_window > 0:
        visible &= keys > pos - sliding_window
    return visible & (pos >= 0)


def decode_attention(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     sliding_window: int = 0, max_context: int | None = None, workspace: Workspace | None = None
                     ) -> torch.Tensor:
    """One new token per row. query: [B, Hq, D]; block_tables int32 [B, W]; context_lens int32 [B]
    -> out [B, Hq, D].

    Each row's query sits at stored index ``context_lens[b] - 1``; rows with ``context_lens == 0``
    give zeros. ``max_context`` (= context_lens.max()) may be passed to avoid a device sync.
    ``workspace``: the step's per-forward scratch (unused here).
    """
    if isinstance(k_pool, QuantizedPool):
        return quantized_torch.decode_attention(query, k_pool, v_pool, block_tables, context_lens, scale,
                                                sliding_window, max_context)
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads = k_pool.shape[0]
    group = num_q_heads // num_kv_heads
    length = int(context_lens.max()) if max_context is None else max_context
    if length == 0:
        return torch.zeros_like(query)
    keys = gather_kv(k_pool, block_tables, length)                          # [Hkv, B, L, D]
    values = gather_kv(v_pool, block_tables, length)
    # GQA: the query heads of one KV head are a group; [Hkv, B, group, D] meets [Hkv, B, L, D].
    q = query.view(batch, num_kv_heads, group, head_dim).transpose(0, 1)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float()                # [Hkv, B, group, L]
    bias, live = _decode_bias(context_lens, length, sliding_window, workspace)
    probs = torch.softmax(scores.mul_(scale).add_(bias.view(1, batch, 1, length)), dim=-1).to(values.dtype)
    out = torch.matmul(probs, values)                                       # [Hkv, B, group, D]
    out = out.transpose(0, 1).reshape(batch, num_q_heads, head_dim)
    return out * live.to(out.dtype).view(batch, 1, 1)


def _decode_bias(context_lens: torch.Tensor, length: int, sliding_window: int, workspace: Workspace | None):
    """(float32 [B, L] additive mask, bool [B, 1] rows with keys) for decode; the same for every
    layer of a forward with this window, so it is kept in the step's workspace."""
    key = (length, sliding_window)
    if workspace is not None and key in workspace.decode_bias:
        return workspace.decode_bias[key]
    lens = context_lens.long().view(-1, 1)
    key_index = torch.arange(length, device=context_lens.device)
    hidden = key_index >= lens                                              # [B, L]
    if sliding_window > 0:
        hidden |= key_index <= lens - 1 - sliding_window
    # A row with no keys keeps key 0 visible (no NaN); its output is zeroed by the caller.
    hidden[:, 0] &= lens[:, 0] > 0
    bias = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device).masked_fill_(hidden, float("-inf"))
    result = (bias, lens > 0)
    if workspace is not None:
        workspace.decode_bias[key] = result
    return result


def extend_attention(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, query_pos: torch.Tensor,
                     scale: float, sliding_window: int = 0, max_context: int | None = None) -> torch.Tensor:
    """Several new tokens per row (prefill, chunked prefill, continuation, assisted decoding).

    query: [B, Hq, Q, D]; query_pos: int32 [B, Q] (-1 = pad) -> out [B, Hq, Q, D].
    The new tokens must already be written (``write_kv``); they attend to each other causally.
    """
    if isinstance(k_pool, QuantizedPool):
        return quantized_torch.extend_attention(query, k_pool, v_pool, block_tables, context_lens, query_pos, scale,
                                                sliding_window, max_context)
    batch, num_q_heads, q_len, head_dim = query.shape
    num_kv_heads = k_pool.shape[0]
    length = int(context_lens.max()) if max_context is None else max_context
    if length == 0:
        return torch.zeros_like(query)
    keys = gather_kv(k_pool, block_tables, length).transpose(0, 1)          # [B, Hkv, L, D]
    values = gather_kv(v_pool, block_tables, length).transpose(0, 1)
    visible = visible_keys(query_pos.long(), length, sliding_window)        # [B, Q, L]
    # Pad queries see key 0 so that no softmax row is empty (no NaN); their output is zeroed below.
    has_key = visible.any(-1, keepdim=True)
    first_key = torch.zeros_like(visible)
    first_key[..., 0] = True
    safe_visible = torch.where(has_key, visible, first_key)
    out = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=safe_visible.unsqueeze(1), scale=scale,
        enable_gqa=num_q_heads != num_kv_heads,
    )
    return out * has_key.unsqueeze(1).to(out.dtype)


class TorchBackend:
    """This module's functions behind the backend protocol (``hf_paged.backends.step``): the CPU
    fallback, quantised pools on the CPU, and the reference every kernel is tested against."""

    write_kv = staticmethod(write_kv)
    copy_blocks = staticmethod(copy_blocks)
    decode_attention = staticmethod(decode_attention)
    extend_attention = staticmethod(extend_attention)

    def prepare(self, plan: StepPlan, peers: dict | None = None) -> Step:
        return Step(self, plan, peers)
