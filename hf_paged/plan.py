"""Per-step attention metadata: built once per forward on the host, read by every layer.

The field layout is the one ``torch_attention`` documents (and the CUDA kernels read).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .allocator import BlockTable


@dataclass(frozen=True)
class StepPlan:
    """What one forward writes and reads. B = batch rows, Q = new columns this step.

    slot_mapping : int64 [B*Q]       slot of each new token (row-major), -1 where nothing is written
    block_tables : int32 [B, W]      physical blocks of each row (0-padded to the widest row)
    context_lens : int32 [B]         stored tokens of each row once this step is written
    query_pos    : int32 [B, Q]      stored index of each query, -1 for pad queries
    decode_lens  : int32 [B] | None  for Q == 1: context_lens, 0 where the query is a pad
    max_context  : int               context_lens.max(), known on the host without a sync
    packed_index : int64 [N] | None  packed forwards only (see PackedPlan): index of each packed token
                                     of this plan into the padded [B*Q] layout (row * Q + column)
    """
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_pos: torch.Tensor
    decode_lens: torch.Tensor | None
    max_context: int
    backend: object
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
    decode       : StepPlan | None
    extend       : StepPlan | None (with packed_index int64 [N - num_decode])
    """
    slot_mapping: torch.Tensor
    decode: StepPlan | None
    extend: StepPlan | None
    num_decode: int
    backend: object


def build_plan(tables: list[BlockTable], queries: torch.Tensor, writes: torch.Tensor, kv_before: list[int],
               slots: list[int], device: torch.device, backend) -> StepPlan:
    """Tensors for one step.

    tables: each row's block table after this step's appends; queries: bool [B, Q] (CPU), which new
    columns are real tokens; writes: bool [B, Q], which of them this step writes (a row sharing an
    identical row's blocks writes nothing); kv_before: stored tokens per row before the step;
    slots: the slots of the written tokens in row-major order (``len(slots) == writes.sum()``).
    """
    batch, q_len = queries.shape
    width = max(1, max(len(t.blocks) for t in tables))
    block_tables = np.zeros((batch, width), dtype=np.int32)
    for row, table in enumerate(tables):
        block_tables[row, :len(table.blocks)] = table.blocks
    context = [t.num_tokens for t in tables]

    slot_mapping = torch.full((batch, q_len), -1, dtype=torch.int64)
    slot_mapping[writes] = torch.tensor(slots, dtype=torch.int64)
    before = torch.tensor(kv_before, dtype=torch.int32).unsqueeze(1)
    query_pos = torch.where(queries, before + queries.cumsum(1, dtype=torch.int32) - 1, -1)
    context_lens = torch.tensor(context, dtype=torch.int32)
    decode_lens = torch.where(queries[:, 0], context_lens, 0) if q_len == 1 else None

    def to_device(t):
        return None if t is None else t.to(device, non_blocking=True)

    return StepPlan(
        slot_mapping=to_device(slot_mapping.view(-1)),
        block_tables=to_device(torch.from_numpy(block_tables)),
        context_lens=to_device(context_lens),
        query_pos=to_device(query_pos.to(torch.int32)),
        decode_lens=to_device(decode_lens),
        max_context=max(context, default=0),
        backend=backend,
    )
