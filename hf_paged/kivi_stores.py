"""The model-dtype side stores of KIVI pools (``hf_paged.kivi``): rows kept beside the codes for some blocks.

``SideStore``: entries that live between steps, found per block (open blocks, sinks); an entry per block at
most, ``free`` and the held entries partition ``range(capacity)``, and the store grows (doubling) when it runs
out, never shrinking. ``FreshRows``: the full rows of the blocks the latest write sealed, for the same step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SideStore:
    """Model-dtype rows kept for some blocks (open blocks, sinks): ``rows`` [Hkv, capacity, *row], the
    entry of each block in ``block_slot`` (-1 = none), which the kernels read; ``held`` mirrors it on the host
    (block -> entry, the entries >= 0 exactly), so that no host decision reads the tensor element by element.
    Mutable, one per pool and kind."""
    rows: torch.Tensor
    block_slot: torch.Tensor               # int64 [num_blocks]
    free: list[int] = field(default_factory=list)
    held: dict[int, int] = field(default_factory=dict)

    @classmethod
    def empty(cls, heads: int, num_blocks: int, row: tuple[int, ...], capacity: int, dtype, device) -> SideStore:
        rows = torch.zeros((heads, capacity, *row), dtype=dtype, device=device)
        return cls(rows, torch.full((num_blocks,), -1, dtype=torch.int64, device=device), list(range(capacity)))

    @property
    def num_held(self) -> int:
        return self.rows.shape[1] - len(self.free)

    def slot(self, block: int) -> int:
        return self.held.get(block, -1)

    def take(self, block: int) -> int:
        """``block``'s entry, a new one if it has none (the store doubles when none is free)."""
        slot = self.slot(block)
        if slot >= 0:
            return slot
        if not self.free:
            capacity = self.rows.shape[1]
            self.rows = torch.cat([self.rows, torch.zeros_like(self.rows[:, :max(1, capacity)])], 1)
            self.free = list(range(capacity, self.rows.shape[1]))
        slot = self.free.pop()
        self.block_slot[block] = slot
        self.held[block] = slot
        return slot

    def release(self, block: int) -> None:
        slot = self.slot(block)
        if slot >= 0:
            self.block_slot[block] = -1
            del self.held[block]
            self.free.append(slot)

    def copy(self, src: SideStore, src_block: int, dst_block: int) -> None:
        """``dst_block`` holds what ``src_block`` holds in ``src`` (this store or another's), or nothing."""
        slot = src.slot(src_block)
        if slot < 0:
            return self.release(dst_block)
        row = src.rows[:, slot].to(self.rows.device)
        entry = self.take(dst_block)            # (may grow self.rows: index it afterwards)
        self.rows[:, entry] = row

    def grow(self, extra_blocks: int) -> None:
        self.block_slot = torch.cat([self.block_slot, self.block_slot.new_full((extra_blocks,), -1)])


@dataclass
class FreshRows:
    """The full rows ``rows`` [Hkv, n, BS, D] of the blocks the latest write sealed (``block_slot``: block ->
    its index in ``rows``, -1 = none), read by the same step's queries in those blocks."""
    rows: torch.Tensor
    block_slot: torch.Tensor
    blocks: list[int] = field(default_factory=list)
    index: torch.Tensor | None = None      # ``blocks`` as an int64 tensor on block_slot's device (for clear)

    def set(self, blocks: list[int], rows: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """``index``: ``blocks`` as an int64 tensor on block_slot's device, where the caller has one."""
        self.clear()
        self.rows, self.blocks = rows, blocks
        self.index = torch.tensor(blocks, device=self.block_slot.device) if index is None else index
        self.block_slot[self.index] = torch.arange(len(blocks), device=rows.device)

    def clear(self) -> None:
        if self.blocks:
            self.block_slot[self.index] = -1
            self.blocks, self.index = [], None
            self.rows = self.rows[:, :0]

    def grow(self, extra_blocks: int) -> None:
        self.block_slot = torch.cat([self.block_slot, self.block_slot.new_full((extra_blocks,), -1)])

    def drop(self, blocks) -> None:
        """Blocks freed while their fresh rows are kept: forget them (their ids may be reused)."""
        if self.blocks and set(blocks) & set(self.blocks):
            self.clear()
