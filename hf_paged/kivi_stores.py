"""The model-dtype side stores of KIVI pools (``hf_paged.kivi``): rows kept beside the codes for some blocks.

Which entry each block holds is the same for every KIVI pool of a cache on one device (the keys and values of
every layer see the same writes, copies and releases), so it is kept once, in a ``KiviMaps`` those pools share,
and changed once per event (a step's write: ``kivi_plan.transition``; a release, a copy-on-write, a prefix
copy: ``KVPools``); each pool keeps only its rows, at the entries the maps give.

- ``SlotMap``: entries that live between steps, found per block (open blocks, sinks): an entry per block at
  most; ``free`` and the held entries partition ``range(capacity)``; the map grows (doubling) when it runs
  out, never shrinking, and each pool's rows follow (``SideStore.fit``) before the pool is written or read.
- ``FreshMap``: the blocks the latest write sealed, block -> index into each pool's fresh rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def grown(tensor: torch.Tensor, extra: int, fill: float, dim: int = 1) -> torch.Tensor:
    """``tensor`` with ``extra`` entries of ``fill`` appended along ``dim``: a normal tensor even when made inside
    inference mode (a forward grows it; a copy-on-write between steps, outside that mode, writes it in place,
    which an inference tensor refuses)."""
    with torch.inference_mode(False):
        shape = list(tensor.shape)
        shape[dim] = extra
        return torch.cat([tensor, tensor.new_full(shape, fill)], dim)


@dataclass
class SlotMap:
    """block -> entry: ``block_slot`` (int64 [num_blocks], -1 = none), which the kernels read, mirrored on the
    host by ``held`` (the entries >= 0 exactly), so that no host decision reads the tensor element by element."""
    block_slot: torch.Tensor
    capacity: int
    free: list[int] = field(default_factory=list)
    held: dict[int, int] = field(default_factory=dict)

    @classmethod
    def empty(cls, num_blocks: int, capacity: int, device) -> SlotMap:
        return cls(torch.full((num_blocks,), -1, dtype=torch.int64, device=device), capacity, list(range(capacity)))

    @property
    def num_held(self) -> int:
        return self.capacity - len(self.free)

    def slot(self, block: int) -> int:
        return self.held.get(block, -1)

    def take(self, block: int) -> int:
        """``block``'s entry, a new one if it has none (capacity doubles when none is free)."""
        slot = self.held.get(block, -1)
        if slot >= 0:
            return slot
        if not self.free:
            grown = self.capacity + max(1, self.capacity)
            self.free, self.capacity = list(range(self.capacity, grown)), grown
        slot = self.free.pop()
        self.block_slot[block] = slot
        self.held[block] = slot
        return slot

    def release(self, block: int) -> None:
        slot = self.held.pop(block, -1)
        if slot >= 0:
            self.block_slot[block] = -1
            self.free.append(slot)

    def grow(self, extra_blocks: int) -> None:
        self.block_slot = grown(self.block_slot, extra_blocks, -1, dim=0)


@dataclass
class FreshMap:
    """The blocks the latest write sealed (``blocks``; ``index`` the same as an int64 tensor on block_slot's
    device) and ``block_slot``: block -> its index among them, -1 = none."""
    block_slot: torch.Tensor
    blocks: list[int] = field(default_factory=list)
    index: torch.Tensor | None = None

    def set(self, blocks: list[int], index: torch.Tensor) -> None:
        self.clear()
        if blocks:
            self.blocks, self.index = blocks, index
            self.block_slot[index] = torch.arange(len(blocks), device=index.device)

    def clear(self) -> None:
        if self.blocks:
            self.block_slot[self.index] = -1
            self.blocks, self.index = [], None

    def grow(self, extra_blocks: int) -> None:
        self.block_slot = grown(self.block_slot, extra_blocks, -1, dim=0)


@dataclass
class KiviMaps:
    """The entries of the KIVI pools of one cache on one device (``shared``: by more than one pool, which is
    then written and copied through ``KVPools`` alone). ``last``: (plan, what it did) of the latest write
    (``kivi_plan.transition``), so the pools of a step apply one transition."""
    open: SlotMap
    sink: SlotMap
    fresh: FreshMap
    shared: bool = False
    last: tuple | None = None

    @classmethod
    def empty(cls, num_blocks: int, open_capacity: int, sink_capacity: int, device, shared: bool = False) -> KiviMaps:
        fresh = FreshMap(torch.full((num_blocks,), -1, dtype=torch.int64, device=device))
        return cls(SlotMap.empty(num_blocks, open_capacity, device), SlotMap.empty(num_blocks, sink_capacity, device),
                   fresh, shared)

    @property
    def num_blocks(self) -> int:
        return self.open.block_slot.shape[0]

    def grow(self, extra_blocks: int) -> None:
        for m in (self.open, self.sink, self.fresh):
            m.grow(extra_blocks)

    def release(self, blocks) -> None:
        """Blocks that became plain free (or were evicted): their slots and sinks go back; fresh rows of one of
        them are forgotten (its id may be reused)."""
        for block in blocks:
            self.open.release(block)
            self.sink.release(block)
        if self.fresh.blocks and not set(self.fresh.blocks).isdisjoint(blocks):
            self.fresh.clear()

    def copy(self, copies: list[tuple[int, int]]) -> tuple[list, list]:
        """Copy-on-write ``(src, dst)`` block pairs: dst holds an entry where src does, else none. Returns the
        (src entry, dst entry) pairs whose rows each pool copies, open and sink."""
        return ([pair for src, dst in copies if (pair := _copy_entry(self.open, self.open, src, dst))],
                [pair for src, dst in copies if (pair := _copy_entry(self.sink, self.sink, src, dst))])

    def copy_sinks_from(self, src: KiviMaps, src_blocks: list[int], dst_blocks: list[int]) -> list:
        """Full blocks copied from another cache's pools (the generate prefix store): they take no open slot; a
        sink travels with its block. Returns the (src entry, dst entry) sink pairs."""
        self.release(dst_blocks)
        return [pair for s, d in zip(src_blocks, dst_blocks) if (pair := _copy_entry(src.sink, self.sink, s, d))]


def _copy_entry(src: SlotMap, dst: SlotMap, src_block: int, dst_block: int) -> tuple[int, int] | None:
    slot = src.slot(src_block)
    if slot < 0:
        dst.release(dst_block)
        return None
    return slot, dst.take(dst_block)


@dataclass
class _MappedRows:
    """One pool's ``rows``, at the entries of a ``map`` other pools share (its ``block_slot`` the kernels read)."""
    rows: torch.Tensor
    map: SlotMap | FreshMap

    @property
    def block_slot(self) -> torch.Tensor:
        return self.map.block_slot


@dataclass
class SideStore(_MappedRows):
    """One pool's rows of one kind (open blocks, sinks): ``rows`` [Hkv, capacity, *row] in the model's dtype, at
    the entries of ``map``. Mutable, one per pool and kind."""
    map: SlotMap

    @property
    def held(self) -> dict[int, int]:
        return self.map.held

    @property
    def num_held(self) -> int:
        return self.map.num_held

    def slot(self, block: int) -> int:
        return self.map.held.get(block, -1)

    def fit(self) -> None:
        """Rows for every entry of the map (zeros for new ones), after the map grew."""
        have = self.rows.shape[1]
        if have < self.map.capacity:
            self.rows = grown(self.rows, self.map.capacity - have, 0)

    def copy_rows(self, src: SideStore, pairs: list[tuple[int, int]]) -> None:
        """Entry ``dst`` of these rows = entry ``src`` of ``src``'s, per (src, dst) pair."""
        self.fit()
        for s, d in pairs:
            self.rows[:, d] = src.rows[:, s].to(self.rows.device)


@dataclass
class FreshRows(_MappedRows):
    """One pool's full rows ``rows`` [Hkv, n, BS, D] of the blocks the latest write sealed, at the indices of
    ``map``, read by the same step's queries in those blocks."""
    map: FreshMap

    @property
    def blocks(self) -> list[int]:
        return self.map.blocks

    def drop_rows(self) -> None:
        """Let the rows go (the map no longer names them): a long prefill's full-precision copy lives one step."""
        self.rows = self.rows[:, :0]

    def clear(self) -> None:
        """Forget the fresh blocks: the map (every pool sharing it) and these rows."""
        self.map.clear()
        self.drop_rows()
