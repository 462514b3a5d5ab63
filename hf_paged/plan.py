"""One forward's attention metadata: built once on the host before the layers run, read by every layer.

There is one description of a step, :class:`StepPlan`, for generate's padded batches and the engine's
packed forwards alike. It is ragged, as FlashInfer's plans are: every query token of the forward, in
the order the forward lays them out, with its row (a sequence: its block table and stored length) and
its stored index. ``padded_plan`` builds it for generate (``[B, Q]`` with pads, from the 2D mask);
``packed_plan`` for the engine (all scheduled tokens of many sequences as one row ``[1, T]``).
:func:`padded_view` derives the ``[rows, Q]`` layout that the PyTorch reference (and the CUDA
``attention.cu`` kernels) read, and only they.

Pool layout read through a plan: see ``hf_paged.backends.torch_backend``. A query at stored index
``p`` of row ``r`` sees the keys ``j <= p`` of that row (and ``p - j < w`` with a sliding window ``w``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from .blocks import BlockTable


@dataclass(frozen=True)
class StepPlan:
    """What one forward writes and reads. T = query tokens of the forward, R = rows (sequences).

    slot_mapping : int64 [T]     slot each token's K/V is written to; -1 = not written (pads, and rows
                                 that share an identical row's blocks)
    token_row    : int32 [T]     the row each token belongs to; the tokens of a row are consecutive
    token_pos    : int32 [T]     stored index (= position id) of each token; -1 = pad (its output is zeros)
    query_start  : int32 [R+1]   row r's tokens are ``query_start[r]:query_start[r+1]`` (CSR, FlashInfer's
                                 qo_indptr); generate's rows count their pad columns
    block_tables : int32 [R, W]  physical blocks of each row, 0-padded to the widest row
    context_lens : int32 [R]     stored tokens of each row once this step is written
    decode_lens  : int32 [D]     keys seen by each of the first D = ``num_decode`` tokens (token_pos + 1,
                                 0 for a pad)
    num_decode   : int           the first ``num_decode`` rows hold one token each, token i in row i (decode
                                 rows); the rest are extend rows (prefill, chunked prefill, continuation)
    max_context  : int           context_lens.max(), known on the host without a sync
    max_query_len: int           the most tokens of one row
    decode_context: int          decode_lens.max() (0 without decode rows)
    batch_shape  : (B, Q)        how the forward's input lays the T = B*Q tokens out: generate's batch rows
                                 (row r = batch row r) or the engine's packed (1, T)
    writes_all   : bool          no slot_mapping entry is -1 (known on the host), so writers need no mask
                                 and read nothing back (a mask's ``.all()`` would sync with the device)
    """
    slot_mapping: torch.Tensor
    token_row: torch.Tensor
    token_pos: torch.Tensor
    query_start: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    decode_lens: torch.Tensor
    num_decode: int
    max_context: int
    max_query_len: int
    decode_context: int
    batch_shape: tuple[int, int]
    writes_all: bool = False

    @property
    def num_tokens(self) -> int:
        return self.batch_shape[0] * self.batch_shape[1]

    @property
    def num_rows(self) -> int:
        return self.block_tables.shape[0]

    @property
    def is_decode(self) -> bool:
        """Every token is a decode row's only token."""
        return self.num_decode == self.num_tokens

    @property
    def device(self) -> torch.device:
        return self.block_tables.device


@dataclass(frozen=True)
class PaddedView:
    """The extend rows of a plan as a padded batch ``[Re, Qe]`` (the PyTorch reference's layout).

    block_tables : int32 [Re, W]; context_lens : int32 [Re]; query_pos : int32 [Re, Qe] (-1 = pad)
    index        : int64 [Te] | None   position of each extend token in the row-major [Re*Qe] layout;
                                       None when the tokens already are that layout (generate's prefill)
    """
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_pos: torch.Tensor
    index: torch.Tensor | None


def padded_view(plan: StepPlan) -> PaddedView | None:
    """The extend rows of ``plan`` (rows ``num_decode`` on) as a padded batch; None if it has none."""
    nd = plan.num_decode
    if nd == plan.num_rows:
        return None
    tables, lens = plan.block_tables[nd:], plan.context_lens[nd:]
    rows = plan.num_rows - nd
    if nd == 0 and plan.batch_shape[0] == rows:        # generate: the tokens already are [B, Q]
        return PaddedView(tables, lens, plan.token_pos.view(plan.batch_shape), None)
    q_len = plan.max_query_len
    row = plan.token_row[nd:].long()
    column = torch.arange(nd, plan.num_tokens, device=row.device) - plan.query_start.long()[row]
    index = (row - nd) * q_len + column
    query_pos = torch.full((rows * q_len,), -1, dtype=torch.int32, device=row.device)
    query_pos[index] = plan.token_pos[nd:]
    return PaddedView(tables, lens, query_pos.view(rows, q_len), index)


def plan_on(plan: StepPlan, device: torch.device) -> StepPlan:
    """The same plan with its tensors on ``device`` (for layers a device_map puts elsewhere)."""
    moved = {f.name: getattr(plan, f.name).to(device, non_blocking=True) for f in fields(plan)
             if isinstance(getattr(plan, f.name), torch.Tensor)}
    return replace(plan, **moved)


def _block_tables(tables: list[BlockTable], tokens: list[int], block_size: int) -> np.ndarray:
    """int32 [R, W]: the blocks holding each row's first ``tokens[r]`` stored tokens (0-padded)."""
    width = max(1, max((-(-t // block_size) for t in tokens), default=1))
    out = np.zeros((len(tables), width), dtype=np.int32)
    for row, (table, total) in enumerate(zip(tables, tokens)):
        used = -(-total // block_size)
        out[row, :used] = table.blocks[:used]
    return out


def _assemble(tables: list[BlockTable], context: list[int], slots, counts, pos, num_decode: int,
              batch_shape: tuple[int, int], block_size: int, device: torch.device) -> StepPlan:
    """The plan from host arrays (slots int64 [T], pos int32 [T], tokens per row ``counts`` [R]), moved
    to ``device`` once."""
    def to(array, dtype):
        return torch.as_tensor(array, dtype=dtype).to(device, non_blocking=True)

    pos = np.asarray(pos, dtype=np.int32)
    slots = np.asarray(slots, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    starts = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=starts[1:])
    rows = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    return StepPlan(
        slot_mapping=to(slots, torch.int64), token_row=to(rows, torch.int32), token_pos=to(pos, torch.int32),
        query_start=to(starts, torch.int32), block_tables=to(_block_tables(tables, context, block_size), torch.int32),
        context_lens=to(context, torch.int32), decode_lens=to(pos[:num_decode] + 1, torch.int32),
        num_decode=num_decode, max_context=max(context, default=0), max_query_len=int(counts.max(initial=0)),
        decode_context=int(pos[:num_decode].max(initial=-1)) + 1, batch_shape=batch_shape,
        writes_all=bool((slots >= 0).all()))


def padded_plan(tables: list[BlockTable], queries: torch.Tensor, writes: torch.Tensor, kv_before: list[int],
                slots: list[int], block_size: int, device: torch.device) -> StepPlan:
    """The plan of generate's padded forward ``[B, Q]``: row b is batch row b.

    tables: each row's block table after this step's appends; queries: bool [B, Q] (CPU), which new
    columns are real tokens; writes: bool [B, Q], which of them this step writes (a row sharing an
    identical row's blocks writes nothing); kv_before: stored tokens per row before the step;
    slots: the slots of the written tokens in row-major order (``len(slots) == writes.sum()``).
    """
    batch, q_len = queries.shape
    slot_mapping = torch.full((batch, q_len), -1, dtype=torch.int64)
    slot_mapping[writes] = torch.tensor(slots, dtype=torch.int64)
    before = torch.tensor(kv_before, dtype=torch.int32).unsqueeze(1)
    pos = torch.where(queries, before + queries.cumsum(1, dtype=torch.int32) - 1, -1)
    return _assemble(tables, [t.num_tokens for t in tables], slot_mapping.view(-1).numpy(), [q_len] * batch,
                     pos.view(-1).numpy(), batch if q_len == 1 else 0, (batch, q_len), block_size, device)


def packed_plan(entries: list[tuple[BlockTable, int, int]], block_size: int, device: torch.device) -> StepPlan:
    """The plan of the engine's packed forward ``[1, T]``. entries: (table, tokens stored before, new
    tokens) per sequence, one-token (decode) entries first, in packed order; each table already covers
    its new tokens. Every packed token is written."""
    num_decode = sum(1 for _, _, n in entries if n == 1)
    if any(n != 1 for _, _, n in entries[:num_decode]):
        raise ValueError("packed_plan: one-token (decode) entries must come first")
    slots: list[int] = []
    pos: list[int] = []
    for table, start, n in entries:
        slots.extend(table.slots(start, start + n, block_size))
        pos.extend(range(start, start + n))
    context = [start + n for _, start, n in entries]
    return _assemble([t for t, _, _ in entries], context, slots, [n for _, _, n in entries], pos, num_decode,
                     (1, len(pos)), block_size, device)
