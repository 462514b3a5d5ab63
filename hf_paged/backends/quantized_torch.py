"""PyTorch paged attention over quantised pools (``hf_paged.kv_formats``): the CPU path and the reference
the quantised CUDA kernels are tested against.

Same semantics as ``torch_backend`` (pool layout, step metadata, masking, zeros for pad queries and rows
without keys); keys and values are the dequantised stored ones (KIVI: as ``hf_paged.kivi``'s read rule says,
the query's own block in full precision, earlier blocks from codes and sink). The context is read in chunks of
``CHUNK_TOKENS`` stored tokens: each chunk's codes are gathered through the block tables, dequantised,
and folded into a running (max, sum, output) softmax, so no full-precision copy of a whole context is
ever made. Scores and accumulation are fp32.
"""
from __future__ import annotations

import torch

from ..kivi import KiviPool
from ..kv_formats import QuantizedPool, dequantize, quantize

CHUNK_TOKENS = 512


def kept_writes(slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor, writes_all: bool):
    """(slot_mapping, key, value) without the -1 (skipped) entries; ``writes_all``: none is, known on the
    host (``StepPlan.writes_all``), so the mask is not built nor read back (no host sync)."""
    if not writes_all:
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            return slot_mapping[keep], key[keep], value[keep]
    return slot_mapping, key, value


def write_kv(k_pool: QuantizedPool, v_pool: QuantizedPool, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, writes_all: bool = False) -> None:
    """Quantise new keys/values [N, Hkv, D] and store codes and scales at ``slot_mapping`` (-1 = skip;
    ``writes_all``: see :func:`kept_writes`)."""
    if isinstance(k_pool, KiviPool):
        raise TypeError("KIVI pools are written by hf_paged.kivi.write_kv (KVPools.write), which needs the tokens' "
                        "positions")
    slot_mapping, key, value = kept_writes(slot_mapping, key, value, writes_all)
    for pool, states in ((k_pool, key), (v_pool, value)):
        codes, scales = quantize(pool.fmt, states)                      # [N, Hkv, *]
        for stored, new in ((pool.data, codes), (pool.scales, scales)):
            heads = stored.shape[0]
            stored.view(heads, -1, stored.shape[-1]).index_copy_(1, slot_mapping, new.transpose(0, 1))


def _gather(pool: QuantizedPool, table: torch.Tensor, own: bool = False) -> torch.Tensor:
    """Blocks ``table`` [B, W] of every head, dequantised: fp32 [Hkv, B, W*BS, D]. ``own``: KIVI blocks as
    read by a query inside them (``KiviPool.own_blocks``)."""
    heads, _, block_size, head_dim = pool.shape
    batch, width = table.shape
    index = table.reshape(-1).long()
    if isinstance(pool, KiviPool):
        blocks = pool.own_blocks(index) if own else pool.dequantize_blocks(index)
        return blocks.view(heads, batch, width * block_size, head_dim)
    values = dequantize(pool.fmt, pool.data.index_select(1, index), pool.scales.index_select(1, index), torch.float32)
    return values.view(heads, batch, width * block_size, head_dim)


def attention(query: torch.Tensor, k_pool: QuantizedPool, v_pool: QuantizedPool, block_tables: torch.Tensor,
              query_pos: torch.Tensor, scale: float, sliding_window: int, length: int) -> torch.Tensor:
    """query [B, Hq, Q, D], query_pos int [B, Q] (-1 = pad), keys [0, length) -> out [B, Hq, Q, D]."""
    batch, num_q_heads, q_len, head_dim = query.shape
    num_kv_heads, _, block_size, _ = k_pool.shape
    group = num_q_heads // num_kv_heads
    if length == 0 or batch == 0 or q_len == 0:
        return torch.zeros_like(query)
    # [Hkv, B, group*Q, D]: the query rows of one KV head's group, each with its stored position.
    q = query.float().view(batch, num_kv_heads, group, q_len, head_dim).transpose(0, 1)
    q = q.reshape(num_kv_heads, batch, group * q_len, head_dim) * scale
    pos = query_pos.long().repeat(1, group).view(1, batch, group * q_len, 1)
    best = q.new_full((num_kv_heads, batch, group * q_len, 1), float("-inf"))
    total = q.new_zeros(best.shape)
    acc = torch.zeros_like(q)
    blocks_per_chunk = max(1, CHUNK_TOKENS // block_size)
    for first in range(0, -(-length // block_size), blocks_per_chunk):
        table = block_tables[:, first:first + blocks_per_chunk]
        keys, values = _gather(k_pool, table), _gather(v_pool, table)        # [Hkv, B, C, D]
        key_index = torch.arange(first * block_size, first * block_size + keys.shape[2], device=q.device)
        visible = (key_index <= pos) & (pos >= 0) & (key_index < length)
        if sliding_window > 0:
            visible &= key_index > pos - sliding_window
        scores = torch.matmul(q, keys.transpose(-1, -2))
        own = None
        if isinstance(k_pool, KiviPool):        # each query's own block: its full-precision rows
            own = (key_index // block_size == pos.div(block_size, rounding_mode="floor")) & visible
            if bool(own.any()):
                own_keys, own_values = _gather(k_pool, table, own=True), _gather(v_pool, table, own=True)
                scores = torch.where(own, torch.matmul(q, own_keys.transpose(-1, -2)), scores)
            else:
                own = None
        scores = scores.masked_fill_(~visible, float("-inf"))
        new_best = torch.maximum(best, scores.amax(-1, keepdim=True))
        shift = torch.where(new_best == float("-inf"), torch.zeros_like(new_best), new_best)
        probs = torch.exp(scores - shift)
        rescale = torch.exp(best - shift)
        total = total * rescale + probs.sum(-1, keepdim=True)
        if own is None:
            acc = acc * rescale + torch.matmul(probs, values)
        else:
            acc = (acc * rescale + torch.matmul(probs.masked_fill(own, 0), values)
                   + torch.matmul(probs.masked_fill(~own, 0), own_values))
        best = new_best
    out = torch.where(total > 0, acc / total.clamp_min(1e-30), torch.zeros_like(acc))
    out = out.view(num_kv_heads, batch, group, q_len, head_dim).transpose(0, 1)
    return out.reshape(batch, num_q_heads, q_len, head_dim).to(query.dtype)


def decode_attention(query: torch.Tensor, k_pool: QuantizedPool, v_pool: QuantizedPool, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, sliding_window: int = 0,
                     max_context: int | None = None) -> torch.Tensor:
    """query [B, Hq, D] at stored index context_lens - 1 (rows with 0 give zeros) -> [B, Hq, D]."""
    length = int(context_lens.max()) if max_context is None else max_context
    pos = (context_lens.long() - 1).view(-1, 1)
    return attention(query.unsqueeze(2), k_pool, v_pool, block_tables, pos, scale, sliding_window, length)[:, :, 0]


def extend_attention(query: torch.Tensor, k_pool: QuantizedPool, v_pool: QuantizedPool, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, query_pos: torch.Tensor, scale: float, sliding_window: int = 0,
                     max_context: int | None = None) -> torch.Tensor:
    """query [B, Hq, Q, D], query_pos [B, Q] -> [B, Hq, Q, D]; the new tokens are already written."""
    length = int(context_lens.max()) if max_context is None else max_context
    return attention(query, k_pool, v_pool, block_tables, query_pos, scale, sliding_window, length)
