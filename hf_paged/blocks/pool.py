"""The block pool: which physical blocks are free, how many tables hold each, and which free block goes next.

Pure Python, no tensors: the pool hands out block ids; the caches own the KV tensors.

A free block may still hold data that someone can take back (a prefix-cache block, the blocks of a
row that finished): the pool's *keeper* (an object with ``keeps(block) -> bool`` and
``evicted(block)``) decides, for every block whose last holder lets go, whether it is kept. A kept
block waits at the tail of the free queue and is handed out only when no plain free block is left;
the moment it is taken, ``keeper.evicted(block)`` tells the keeper its data is gone. Plain free
blocks go to the head, so they are reused first. One pool has at most one keeper.

Invariants (``check_invariants``):
- every block is free xor held: ``num_free + num_used == num_blocks``;
- a block's refcount equals the number of tables holding it (a table never holds a block twice);
- kept blocks are free blocks.

``free_listeners``: callables given the blocks that just became plain free or were evicted (their data is
gone); caches with per-block side state (KIVI's open slots, ``hf_paged.kivi``) release it there.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable


class PoolExhaustedError(RuntimeError):
    """The pool has fewer free blocks than a step needs. Nothing was changed."""

    def __init__(self, needed: int, free: int, total: int, block_size: int, hint: str = "", whole: bool = False):
        """needed: the blocks this step takes (``whole``: the blocks one sequence holds in all, over the pool's)."""
        self.needed, self.free, self.total = needed, free, total
        what = (f"one sequence needs {needed} blocks of {block_size} tokens but the whole pool holds {total}" if whole
                else f"this step needs {needed} more blocks of {block_size} tokens but only {free} of {total} are free")
        hint = hint or "Raise num_blocks / max_memory_bytes, or leave both unset so the pool grows on demand."
        super().__init__(f"KV pool exhausted: {what}. {hint}")


def blocks_for_budget(budget_bytes: int, bytes_per_token: int, block_size: int, knob: str, source: str = "") -> int:
    """How many blocks of ``block_size`` tokens a KV budget holds; ``knob`` names the setting in errors, ``source``
    where the budget came from when the user did not set it."""
    per_block = bytes_per_token * block_size
    blocks = int(budget_bytes) // per_block
    if blocks < 1:
        came = f" ({source})" if source else ""
        raise ValueError(f"{knob}={budget_bytes} bytes{came} holds no block: one block of {block_size} tokens takes "
                         f"{per_block} bytes for this model. Raise {knob} or lower block_size.")
    return blocks


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens: refcounts and a free queue in reuse order."""

    def __init__(self, num_blocks: int, block_size: int, keeper=None):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refcounts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # head first
        self._kept: set[int] = set()
        self.keeper = keeper
        self.peak_used = 0
        self.free_listeners: list = []
        self.evictions = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_free(self) -> int:
        """Blocks that can be taken now, kept ones included."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_kept(self) -> int:
        """Free blocks whose data is still kept for a possible revival."""
        return len(self._kept)

    def is_kept(self, block: int) -> bool:
        return block in self._kept

    # ------------------------------------------------------------- mutations
    def take(self) -> int:
        """A free block, now held once. Plain free blocks first; taking a kept one evicts its data."""
        block, _ = self._free.popitem(last=False)
        if block in self._kept:
            self._kept.discard(block)
            self.evictions += 1
            self.keeper.evicted(block)
            for listener in self.free_listeners:
                listener([block])
        self.refcounts[block] = 1
        self._note_peak()
        return block

    def hold(self, block: int) -> None:
        """One more holder of ``block``; a free (kept) block is revived with its data."""
        if self.refcounts[block] == 0:
            del self._free[block]
            self._kept.discard(block)
        self.refcounts[block] += 1
        self._note_peak()

    def release(self, blocks: list[int]) -> None:
        """One holder fewer for each of ``blocks``. A block nobody holds any more becomes free: at the
        tail of the queue, kept, where the keeper keeps it; at the head otherwise. Released last to
        first, so that a table's first blocks are at the very head (plain) or evicted last (kept)."""
        refcounts, free = self.refcounts, self._free
        keep = self.keeper.keeps if self.keeper is not None else None
        plain = []
        for block in reversed(blocks):
            refcounts[block] -= 1
            if refcounts[block] == 0:
                free[block] = None
                if keep is not None and keep(block):
                    self._kept.add(block)
                else:
                    free.move_to_end(block, last=False)
                    plain.append(block)
        if plain:
            for listener in self.free_listeners:
                listener(plain)

    def forget(self, block: int) -> None:
        """A kept free block's data is no longer wanted: it becomes a plain free block."""
        if block in self._kept:
            self._kept.discard(block)
            self._free.move_to_end(block, last=False)
            for listener in self.free_listeners:
                listener([block])

    def grow(self, extra_blocks: int) -> None:
        """Add ``extra_blocks`` free blocks (ids ``num_blocks ..``); the caller grows the tensors."""
        start = self.num_blocks
        self.num_blocks += extra_blocks
        self.refcounts.extend([0] * extra_blocks)
        for block in range(self.num_blocks - 1, start - 1, -1):
            self._free[block] = None
            self._free.move_to_end(block, last=False)

    def reset_peak(self) -> None:
        self.peak_used = self.num_used

    # ---------------------------------------------------------------- checks
    def state(self) -> tuple:
        """Everything that decides future allocations: refcounts, the free queue in order, kept blocks.
        Equal states make equal choices (tensor-parallel ranks compare theirs; see hf_paged.parallel)."""
        return tuple(self.refcounts), tuple(self._free), tuple(sorted(self._kept))

    def check_invariants(self, tables: Iterable[list[int]]) -> None:
        """Raise AssertionError unless ``tables`` (every block list holding blocks) match the refcounts."""
        counts = [0] * self.num_blocks
        for i, blocks in enumerate(tables):
            assert len(set(blocks)) == len(blocks), f"table {i} holds a block twice: {blocks}"
            for block in blocks:
                counts[block] += 1
        assert counts == self.refcounts, "refcounts differ from the number of tables holding each block"
        used = {b for b, c in enumerate(counts) if c}
        assert not (used & self._free.keys()), "a block is both free and held"
        assert len(used) + len(self._free) == self.num_blocks, "blocks leaked: neither free nor held"
        assert self._kept <= self._free.keys(), "a kept block is not free"

    # -------------------------------------------------------------- internals
    def _note_peak(self) -> None:
        used = self.num_blocks - len(self._free)
        if used > self.peak_used:
            self.peak_used = used
