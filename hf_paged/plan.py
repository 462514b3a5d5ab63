"""Per-forward attention plans: built once on the host before the layers run, read by every layer.

Plans are data only (tensors and ints, no backend objects). Two builders, one layout:
``padded_plan`` for generate's batches ([B, Q] with padding; ``PagedCache``) and ``packed_plan`` for
the engine's packed forwards (all scheduled tokens of many sequences as one row ``[1, N]``).

Pool layout read through a plan: see ``hf_paged.backends.torch_backend``. A query at stored index
``p`` sees the keys ``j <= p`` of its row (and ``p - j < w`` with a sliding window ``w``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from .blocks import BlockTable


@dataclass(frozen=True)
class StepPlan:
    """What one padded forward writes and reads. B = batch rows, Q = new columns this step.

    slot_mapping : int64 [B*Q] | None  slot of each new token (row-major), -1 where nothing is written
                                       (None inside a PackedPlan, whose own slot_mapping is used)
    block_tables : int32 [B, W]        physical blocks of each row (0-padded to the widest row)
    context_lens : int32 [B]           stored tokens of each row once this step is written
    query_pos    : int32 [B, Q]        stored index of each query, -1 for pad queries
    decode_lens  : int32 [B] | None    for Q == 1: context_lens, 0 where the query is a pad
    max_context  : int                 context_lens.max(), known on the host without a sync
    packed_index : int64 [N] | None    packed forwards only: index of each packed token of this plan
                                       into the padded [B*Q] layout (row * Q + column)
    """
    slot_mapping: torch.Tensor | None
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_pos: torch.Tensor
    decode_lens: torch.Tensor | None
    max_context: int
    packed_index: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        return self.decode_lens is not None


@dataclass(frozen=True)
class PackedPlan:
    """One packed forward: the scheduled tokens of many sequences as one row, ``input_ids [1, N]``.

    The first ``num_decode`` packed tokens are the only new token of their sequence (one row each of
    ``decode``, a Q == 1 StepPlan); the rest belong to sequences with several new tokens (chunked
    prefill), laid out row by row in ``extend`` (a StepPlan whose ``packed_index`` places them into its
    padded [B_e*Q_e]). Splitting keeps decode rows from being padded to the longest prefill chunk.

    slot_mapping : int64 [N]   slot of each packed token (every packed token is written)
    """
    slot_mapping: torch.Tensor
    decode: StepPlan | None
    extend: StepPlan | None
    num_decode: int


def plan_on(plan: StepPlan | PackedPlan | None, device: torch.device):
    """The same plan with its tensors on ``device`` (for layers a device_map puts elsewhere)."""
    if plan is None:
        return None
    moved = {}
    for f in fields(plan):
        value = getattr(plan, f.name)
        if isinstance(value, torch.Tensor):
            moved[f.name] = value.to(device, non_blocking=True)
        elif isinstance(value, StepPlan):
            moved[f.name] = plan_on(value, device)
    return replace(plan, **moved)


def _block_tables(tables: list[BlockTable], tokens: list[int], block_size: int) -> np.ndarray:
    """int32 [B, W]: the blocks holding each row's first ``tokens[b]`` stored tokens (0-padded)."""
    width = max(1, max((-(-t // block_size) for t in tokens), default=1))
    out = np.zeros((len(tables), width), dtype=np.int32)
    for row, (table, total) in enumerate(zip(tables, tokens)):
        used = -(-total // block_size)
        out[row, :used] = table.blocks[:used]
    return out


def _to(device: torch.device, array, dtype: torch.dtype) -> torch.Tensor:
    return torch.as_tensor(array, dtype=dtype).to(device, non_blocking=True)


def padded_plan(tables: list[BlockTable], queries: torch.Tensor, writes: torch.Tensor, kv_before: list[int],
                slots: list[int], block_size: int, device: torch.device) -> StepPlan:
    """The plan of a padded forward.

    tables: each row's block table after this step's appends; queries: bool [B, Q] (CPU), which new
    columns are real tokens; writes: bool [B, Q], which of them this step writes (a row sharing an
    identical row's blocks writes nothing); kv_before: stored tokens per row before the step;
    slots: the slots of the written tokens in row-major order (``len(slots) == writes.sum()``).
    """
    batch, q_len = queries.shape
    context = [t.num_tokens for t in tables]
    slot_mapping = torch.full((batch, q_len), -1, dtype=torch.int64)
    slot_mapping[writes] = torch.tensor(slots, dtype=torch.int64)
    before = torch.tensor(kv_before, dtype=torch.int32).unsqueeze(1)
    query_pos = torch.where(queries, before + queries.cumsum(1, dtype=torch.int32) - 1, -1).to(torch.int32)
    context_lens = torch.tensor(context, dtype=torch.int32)
    decode_lens = torch.where(queries[:, 0], context_lens, 0) if q_len == 1 else None
    return StepPlan(
        slot_mapping=slot_mapping.view(-1).to(device, non_blocking=True),
        block_tables=_to(device, _block_tables(tables, context, block_size), torch.int32),
        context_lens=context_lens.to(device, non_blocking=True),
        query_pos=query_pos.to(device, non_blocking=True),
        decode_lens=None if decode_lens is None else decode_lens.to(device, non_blocking=True),
        max_context=max(context, default=0),
    )


def packed_plan(entries: list[tuple[BlockTable, int, int]], block_size: int, device: torch.device) -> PackedPlan:
    """The plan of a packed forward. entries: (table, tokens stored before, new tokens) per sequence,
    one-token entries first, in packed order; each table already covers its new tokens."""
    num_decode = sum(1 for _, _, n in entries if n == 1)
    if any(n != 1 for _, _, n in entries[:num_decode]):
        raise ValueError("packed_plan: one-token (decode) entries must come first")
    slots: list[int] = []
    for table, start, n in entries:
        slots.extend(table.slots(start, start + n, block_size))
    decode = extend = None
    if num_decode:
        tables = [t for t, _, _ in entries[:num_decode]]
        ctx = [start + 1 for _, start, _ in entries[:num_decode]]
        lens = _to(device, ctx, torch.int32)
        decode = StepPlan(slot_mapping=None, block_tables=_to(device, _block_tables(tables, ctx, block_size), torch.int32),
                          context_lens=lens, query_pos=(lens - 1).view(-1, 1), decode_lens=lens, max_context=max(ctx))
    rest = entries[num_decode:]
    if rest:
        q_len = max(n for _, _, n in rest)
        ctx = [start + n for _, start, n in rest]
        query_pos = np.full((len(rest), q_len), -1, dtype=np.int32)
        index: list[int] = []
        for row, (_, start, n) in enumerate(rest):
            query_pos[row, :n] = np.arange(start, start + n)
            index.extend(range(row * q_len, row * q_len + n))
        extend = StepPlan(slot_mapping=None,
                          block_tables=_to(device, _block_tables([t for t, _, _ in rest], ctx, block_size), torch.int32),
                          context_lens=_to(device, ctx, torch.int32), query_pos=_to(device, query_pos, torch.int32),
                          decode_lens=None, max_context=max(ctx), packed_index=_to(device, index, torch.int64))
    return PackedPlan(slot_mapping=_to(device, slots, torch.int64), decode=decode, extend=extend,
                      num_decode=num_decode)
