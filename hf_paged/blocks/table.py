"""A block table: one sequence's blocks in order, edited through the pool it draws from.

``blocks[i]`` holds the sequence's stored tokens ``i*bs .. (i+1)*bs - 1``; stored token ``j`` lives in
slot ``blocks[j // bs] * bs + j % bs``. Invariant: ``len(blocks) == ceil(num_tokens / bs)``.
Callers ask before they act (``blocks_needed`` against ``pool.num_free``), so ``append`` never fails
halfway. Copy-on-write is data: ``append`` records ``(src, dst)`` pairs for the cache to apply.
"""
from __future__ import annotations

from .pool import BlockPool, PoolExhaustedError


class BlockTable:
    __slots__ = ("blocks", "num_tokens")

    def __init__(self, blocks: list[int] | None = None, num_tokens: int = 0):
        self.blocks: list[int] = blocks if blocks is not None else []
        self.num_tokens = num_tokens

    def __repr__(self) -> str:
        return f"BlockTable(blocks={self.blocks}, num_tokens={self.num_tokens})"

    def blocks_needed(self, pool: BlockPool, num_new_tokens: int) -> int:
        """Free blocks that appending ``num_new_tokens`` takes (a copy-on-write included)."""
        if num_new_tokens <= 0:
            return 0
        bs = pool.block_size
        fill = self.num_tokens % bs
        cow = 1 if fill and pool.refcounts[self.blocks[-1]] > 1 else 0
        room = bs - fill if fill else 0
        return cow + max(0, -(-(num_new_tokens - room) // bs))

    def append(self, pool: BlockPool, num_new_tokens: int, copies: list[tuple[int, int]]) -> list[int]:
        """Reserve slots for ``num_new_tokens`` tokens at the end; return their slots in order.

        A shared, partly filled last block is first replaced by a copy: ``(src, dst)`` goes to
        ``copies`` and must be applied to the pools before the new tokens are written.
        Raises PoolExhaustedError, changing nothing, when the pool has too few free blocks.
        """
        if num_new_tokens <= 0:
            return []
        needed = self.blocks_needed(pool, num_new_tokens)
        if needed > pool.num_free:
            raise PoolExhaustedError(needed, pool.num_free, pool.num_blocks, pool.block_size)
        bs, blocks = pool.block_size, self.blocks
        if self.num_tokens % bs and pool.refcounts[blocks[-1]] > 1:
            src = blocks[-1]
            blocks[-1] = pool.take()
            pool.release([src])
            copies.append((src, blocks[-1]))
        start = self.num_tokens
        for _ in range(-(-(start + num_new_tokens) // bs) - len(blocks)):
            blocks.append(pool.take())
        self.num_tokens = start + num_new_tokens
        return self.slots(start, self.num_tokens, bs)

    def slots(self, start: int, end: int, block_size: int) -> list[int]:
        """Slots of stored tokens ``start .. end - 1`` (one run of consecutive slots per block)."""
        out: list[int] = []
        pos = start
        while pos < end:
            offset = pos % block_size
            run = min(block_size - offset, end - pos)
            base = self.blocks[pos // block_size] * block_size + offset
            out.extend(range(base, base + run))
            pos += run
        return out

    def fork(self, pool: BlockPool) -> "BlockTable":
        """A new table sharing every block of this one (refcounts + 1)."""
        for block in self.blocks:
            pool.hold(block)
        return BlockTable(list(self.blocks), self.num_tokens)

    def truncate(self, pool: BlockPool, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` stored tokens (crop, rollback)."""
        if num_tokens >= self.num_tokens:
            return
        keep = -(-num_tokens // pool.block_size)
        pool.release(self.blocks[keep:])
        del self.blocks[keep:]
        self.num_tokens = num_tokens

    def release(self, pool: BlockPool) -> None:
        """Give every block back (the pool's keeper may keep them); the table is empty afterwards."""
        pool.release(self.blocks)
        self.blocks.clear()
        self.num_tokens = 0
