"""The rows of one generate batch: each row's block table, which rows finished, which columns each stored.

A row *finishes* when its decode input is an EOS token: that token is still stored, and from the
next column on the row is left out of the forwards. Its blocks go back to the pool but stay *kept*
(the row book is the pool's keeper): they are reused only when the pool runs out of plain free
blocks. A later generate call that continues this cache takes them back (``resume``) if they are
intact; if any was reused in the meantime the row is *lost* and resuming it raises, naming the row.

Invariants: a row is finished xor holds a live table; a finished row's parked table lists the blocks
it held; ``_parked_rows[b]`` is the set of finished rows whose parked table lists block ``b``.
"""
from __future__ import annotations

import torch

from ..blocks import BlockPool, BlockTable


class RowBook:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        pool.keeper = self
        self.tables: list[BlockTable] = []
        self.finished: list[bool] = []
        self.finish_column: list[int] = []                 # first column the row did not store
        self._parked: dict[int, BlockTable | None] = {}    # finished row -> its blocks (None: lost)
        self._parked_rows: dict[int, set[int]] = {}
        self.written: list[torch.Tensor] = []              # bool [B, Q] per step: columns each row stored
        self.columns = 0                                   # logical length: columns seen, pads included

    def __len__(self) -> int:
        return len(self.tables)

    def start(self, num_rows: int) -> None:
        self.tables = [BlockTable() for _ in range(num_rows)]
        self.finished = [False] * num_rows
        self.finish_column = [0] * num_rows

    def live_tables(self) -> list[BlockTable]:
        return [t for t, done in zip(self.tables, self.finished) if not done]

    # ------------------------------------------------------------ finishing and resuming
    def finish(self, row: int, column: int) -> None:
        """Row ``row`` stored its last token before ``column``: park its blocks (kept, reclaimable)."""
        table = self.tables[row]
        parked = BlockTable(list(table.blocks), table.num_tokens)
        for block in parked.blocks:
            self._parked_rows.setdefault(block, set()).add(row)
        self._parked[row] = parked
        table.release(self.pool)
        self.finished[row], self.finish_column[row] = True, column

    def check_resumable(self, row: int, attention_mask: torch.Tensor | None) -> None:
        """Raise, naming the row and the way out, unless finished ``row`` can be resumed.

        attention_mask: the whole sequence's 2D mask; the columns the row skipped while finished
        must be masked (as generate's inferred mask does for pads), since their KV was never computed.
        """
        start, end = self.finish_column[row], self.columns
        advice = ("To continue from a cache, generate the first call with "
                  "PagedCache(..., release_finished_rows=False) (or hf_paged.patch(model, release_finished_rows=False)).")
        if end > start and (attention_mask is None or bool(attention_mask[row, start:end].any())):
            raise ValueError(
                f"row {row} ended with EOS at column {start - 1}, so hf_paged released it and never computed "
                f"columns {start}..{end - 1}, but this call's attention_mask marks some of them as real tokens. "
                f"Mask them (0 in attention_mask, as generate infers for pad tokens) or: {advice}")
        if self._parked.get(row) is None:
            raise ValueError(
                f"row {row} ended with EOS at column {start - 1} and its released KV blocks were reused by "
                f"other rows before this continuation. {advice}")

    def resume(self, row: int) -> None:
        """Take finished ``row``'s parked blocks back (``check_resumable`` first)."""
        parked = self._parked.pop(row)
        for block in parked.blocks:
            self._unlist(row, block)
            self.pool.hold(block)
        self.tables[row] = parked
        self.finished[row] = False

    def truncate_parked(self, row: int, num_tokens: int) -> None:
        """Finished ``row`` keeps only its first ``num_tokens`` stored tokens (a crop before its end): the
        parked blocks past them become plain free; the rest can still be resumed."""
        parked = self._parked.get(row)
        if parked is None or num_tokens >= parked.num_tokens:
            return
        keep = -(-num_tokens // self.pool.block_size)
        for block in parked.blocks[keep:]:
            self._unlist(row, block)
        del parked.blocks[keep:]
        parked.num_tokens = num_tokens

    def forget_parked(self, row: int) -> None:
        """A finished row can no longer be resumed (its stored columns were cropped)."""
        parked = self._parked.get(row)
        if parked is not None:
            for block in parked.blocks:
                self._unlist(row, block)
            self._parked[row] = None

    # ------------------------------------------------------------ pool keeper
    def keeps(self, block: int) -> bool:
        return block in self._parked_rows

    def evicted(self, block: int) -> None:
        """The pool handed out ``block``: every finished row that parked it is lost."""
        for row in self._parked_rows.pop(block, ()):
            self.forget_parked(row)

    def _unlist(self, row: int, block: int) -> None:
        rows = self._parked_rows.get(block)
        if rows is not None:
            rows.discard(row)
            if not rows:
                del self._parked_rows[block]
                self.pool.forget(block)

    # ------------------------------------------------------------ whole batch
    def reorder(self, order: list[int]) -> None:
        """Row i continues row ``order[i]`` by table forks (no KV copied): beam search's reorder (as many rows),
        or a selection / repetition of rows (``batch_select_indices``, ``batch_repeat_interleave``)."""
        if any(self.finished):
            raise RuntimeError("reorder_cache / batch_select_indices / batch_repeat_interleave on a PagedCache with "
                               "released (finished) rows: beam search never releases rows; call cache.reset() "
                               "before reusing the cache, or patch with release_finished_rows=False")
        old = self.tables
        if len(order) == len(old):          # a row that keeps its own table keeps it (no fork, no release)
            self.tables = [old[src] if src == row else old[src].fork(self.pool) for row, src in enumerate(order)]
            dropped = [old[row] for row, src in enumerate(order) if src != row]
        else:
            self.tables, dropped = [old[src].fork(self.pool) for src in order], old
        for table in dropped:
            table.release(self.pool)
        self.finished, self.finish_column = [False] * len(order), [0] * len(order)
        if self.written:
            self.written = [torch.cat(self.written, dim=1).index_select(0, torch.tensor(order, dtype=torch.long))]

    def crop(self, keep: int) -> None:
        """Keep the first ``keep`` columns."""
        written = torch.cat(self.written, dim=1)[:, :keep]
        for row, tokens in enumerate(written.sum(1).tolist()):
            if self.finished[row]:
                if keep < self.finish_column[row]:          # cropped into what it stored: resumable from there
                    self.truncate_parked(row, tokens)
                    self.finish_column[row] = keep
            else:
                self.tables[row].truncate(self.pool, tokens)
        self.written = [written]
        self.columns = keep

    def clear(self) -> None:
        """Forget every row; live blocks go back, parked ones become plain free blocks."""
        for row in list(self._parked):
            self.forget_parked(row)
        for table in self.tables:
            table.release(self.pool)
        self.tables, self.finished, self.finish_column = [], [], []
        self._parked, self.written, self.columns = {}, [], 0

    def check_invariants(self) -> None:
        self.pool.check_invariants(t.blocks for t in self.tables)
        for row, done in enumerate(self.finished):
            assert not done or not self.tables[row].blocks, f"finished row {row} still holds blocks"
        for block, rows in self._parked_rows.items():
            assert rows and all(self._parked.get(r) is not None and block in self._parked[r].blocks for r in rows)
            assert self.pool.refcounts[block] > 0 or self.pool.is_kept(block), f"parked block {block} is plain free"


def duplicate_leaders(input_ids, attention_mask, batch_size: int) -> list[int]:
    """At the first prefill, rows equal to the row before them (``repeat_interleave``d prompts for
    beams or num_return_sequences) share that row's blocks. Returns each row's leader row."""
    leaders = list(range(batch_size))
    if input_ids is None or batch_size < 2:
        return leaders
    same = (input_ids[1:] == input_ids[:-1]).all(1)
    if attention_mask is not None:
        same &= (attention_mask[1:] == attention_mask[:-1]).all(1)
    for row, dup in enumerate(same.tolist(), start=1):
        if dup:
            leaders[row] = leaders[row - 1]
    return leaders
