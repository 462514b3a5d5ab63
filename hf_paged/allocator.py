"""Block allocator: pure Python bookkeeping of which physical blocks hold which sequence's tokens.

No tensors here. The allocator hands out slot numbers and records copy-on-write as ``(src, dst)``
pairs; the cache applies them to the pools.

Invariants (``check_invariants``):
- every block is either free or used: ``len(free) + used == num_blocks``;
- a block's refcount equals the number of block tables that hold it (a table may not hold a block twice);
- a table of ``n`` tokens holds exactly ``ceil(n / block_size)`` blocks.
Operations check before they act (``blocks_needed`` / ``can_*``), so a refused request changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class PoolExhaustedError(RuntimeError):
    """The pool has fewer free blocks than a step needs. Nothing was changed."""

    def __init__(self, needed: int, free: int, total: int, block_size: int, hint: str = ""):
        self.needed, self.free, self.total = needed, free, total
        super().__init__(
            f"KV pool exhausted: this step needs {needed} more blocks of {block_size} tokens but only "
            f"{free} of {total} are free. {hint or 'Raise num_blocks / max_memory_bytes, or leave both unset so the pool grows on demand.'}"
        )


@dataclass
class BlockTable:
    """One sequence's logical blocks. ``blocks[i]`` holds stored tokens ``i*bs .. (i+1)*bs-1``."""
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


class BlockAllocator:
    """Fixed-size blocks, an O(1) free list (a stack), refcounts, fork, copy-on-write, truncate."""

    def __init__(self, num_blocks: int, block_size: int = 16):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.refcounts = [0] * num_blocks
        # Popped from the end: low block ids are handed out first.
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[int, BlockTable] = {}
        self.peak_used = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        """Fresh blocks that appending ``num_new_tokens`` to ``seq_id`` takes (copy-on-write included)."""
        table = self.tables[seq_id]
        if num_new_tokens <= 0:
            return 0
        bs = self.block_size
        fill = table.num_tokens % bs
        cow = 1 if fill and self.refcounts[table.blocks[-1]] > 1 else 0
        room = bs - fill if fill else 0
        return cow + max(0, -(-(num_new_tokens - room) // bs))

    # ------------------------------------------------------------- mutations
    def grow(self, extra_blocks: int) -> None:
        """Add ``extra_blocks`` new free blocks (ids ``num_blocks ..``); the caller grows the tensors."""
        start = self.num_blocks
        self.num_blocks += extra_blocks
        self.refcounts.extend([0] * extra_blocks)
        self.free_blocks[:0] = range(self.num_blocks - 1, start - 1, -1)

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self.tables:
            raise KeyError(f"sequence {seq_id} already has a block table")
        self.tables[seq_id] = BlockTable()

    def append(self, seq_id: int, num_new_tokens: int, copies: list[tuple[int, int]]) -> list[int]:
        """Reserve slots for ``num_new_tokens`` tokens at the end of ``seq_id``; return their slots.

        A shared, partly filled last block is first copied (copy-on-write): the pair ``(src, dst)``
        is appended to ``copies`` and must be applied to the pools before the new tokens are written.
        Raises PoolExhaustedError (changing nothing) when the free list is too short.
        """
        if num_new_tokens <= 0:
            return []
        needed = self.blocks_needed(seq_id, num_new_tokens)
        if needed > len(self.free_blocks):
            raise PoolExhaustedError(needed, len(self.free_blocks), self.num_blocks, self.block_size)
        table, bs, refcounts = self.tables[seq_id], self.block_size, self.refcounts
        fill = table.num_tokens % bs
        if fill and refcounts[table.blocks[-1]] > 1:
            src = table.blocks[-1]
            dst = self._take()
            refcounts[src] -= 1
            table.blocks[-1] = dst
            copies.append((src, dst))
        slots: list[int] = []
        pos, remaining = table.num_tokens, num_new_tokens
        while remaining:            # one run of consecutive slots per block
            offset = pos % bs
            if offset == 0:
                table.blocks.append(self._take())
            run = min(bs - offset, remaining)
            base = table.blocks[-1] * bs + offset
            slots.extend(range(base, base + run))
            pos += run
            remaining -= run
        table.num_tokens = pos
        self._note_peak()
        return slots

    def fork(self, parent_id: int, child_id: int) -> None:
        """``child_id`` gets a table sharing every block of ``parent_id`` (refcounts +1)."""
        parent = self.tables[parent_id]
        if child_id in self.tables:
            self.free(child_id)
        for block in parent.blocks:
            self.refcounts[block] += 1
        self.tables[child_id] = BlockTable(list(parent.blocks), parent.num_tokens)

    def free(self, seq_id: int) -> None:
        """Drop ``seq_id``'s table; blocks whose refcount reaches 0 return to the free list."""
        table = self.tables.pop(seq_id)
        self._release(table.blocks)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` tokens of ``seq_id`` (for crop / rollback)."""
        table = self.tables[seq_id]
        if num_tokens >= table.num_tokens:
            return
        keep = -(-num_tokens // self.block_size)
        self._release(table.blocks[keep:])
        del table.blocks[keep:]
        table.num_tokens = num_tokens

    def reset(self) -> None:
        for seq_id in list(self.tables):
            self.free(seq_id)
        self.peak_used = 0

    # ---------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent."""
        counts = [0] * self.num_blocks
        for seq_id, table in self.tables.items():
            assert len(set(table.blocks)) == len(table.blocks), f"sequence {seq_id} holds a block twice"
            assert len(table.blocks) == -(-table.num_tokens // self.block_size), (
                f"sequence {seq_id}: {len(table.blocks)} blocks for {table.num_tokens} tokens")
            for block in table.blocks:
                counts[block] += 1
        assert counts == self.refcounts, "refcounts differ from the number of tables holding each block"
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), "a block is on the free list twice"
        used = {b for b, c in enumerate(counts) if c > 0}
        assert not (free & used), "a block is both free and used"
        assert len(free) + len(used) == self.num_blocks, "blocks leaked: neither free nor used"

    # -------------------------------------------------------------- internals
    def _take(self) -> int:
        block = self.free_blocks.pop()
        self.refcounts[block] = 1
        return block

    def _release(self, blocks: list[int]) -> None:
        refcounts, free_blocks = self.refcounts, self.free_blocks
        # Reversed, so that the sequence's first block is handed out again first.
        for block in reversed(blocks):
            refcounts[block] -= 1
            if refcounts[block] == 0:
                free_blocks.append(block)

    def _note_peak(self) -> None:
        used = self.num_blocks - len(self.free_blocks)
        if used > self.peak_used:
            self.peak_used = used
