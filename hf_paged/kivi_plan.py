"""What a KIVI write does, decided on the host once per step (``hf_paged.kivi`` has the format and its rules).

``KiviWrite``: the blocks a write touches, from its slots and positions alone (made once per step and device by
``KVPools``). ``transition``: that write applied to the entries the step's pools share (``KiviMaps``: open
slots, sinks, fresh blocks), once, giving a ``KiviStep``: the entries and index tensors every pool then uses to
move its own rows (``KiviPool.write_planned``). The order is the one the invariants of ``hf_paged.kivi`` need:
sinks taken, sealed blocks without rows reopened, rows into held slots and the sealing (one op call), the
sealed blocks' slots released, then the blocks this write opens take slots (so a sequence holds one at a time).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kivi_stores import KiviMaps


@dataclass(frozen=True)
class KiviWrite:
    """What a write does to blocks, from its slots and positions alone. Host lists; rows are indices into the
    written states (the tokens with a slot, in order)."""
    keep: torch.Tensor | None           # the tokens with a slot (slot_mapping >= 0), None: all
    offsets: list[int]                  # row -> its offset in its block
    block_rows: dict[int, list[int]]    # block -> its rows
    first_offset: dict[int, int]        # block -> the lowest offset written
    written: list[int]                  # the distinct blocks written, ascending
    sealing: list[int]                  # those whose last offset (BS-1) is written, ascending
    unsealed: list[int]                 # the others, ascending
    whole: frozenset[int]               # sealing blocks whose BS rows are all written here
    sink_rows: list[int]                # rows at position 0
    sink_blocks: list[int]              # their blocks
    block_size: int = 0

    @classmethod
    def of(cls, slot_mapping: torch.Tensor, positions: torch.Tensor, block_size: int) -> KiviWrite:
        """``slot_mapping`` int64 [N] (-1 = skip), ``positions`` int [N] (stored indices)."""
        slots, where = slot_mapping.tolist(), positions.tolist()
        kept = [i for i, s in enumerate(slots) if s >= 0]
        keep = None if len(kept) == len(slots) else torch.tensor(kept, device=slot_mapping.device)
        offsets, block_rows, sink_rows, sink_blocks = [], {}, [], []
        for row, i in enumerate(kept):
            block, offset = divmod(slots[i], block_size)
            offsets.append(offset)
            block_rows.setdefault(block, []).append(row)
            if where[i] == 0:
                sink_rows.append(row)
                sink_blocks.append(block)
        first = {b: min(offsets[r] for r in rows) for b, rows in block_rows.items()}
        written = sorted(block_rows)
        sealing = [b for b in written if any(offsets[r] == block_size - 1 for r in block_rows[b])]
        whole = frozenset(b for b in sealing if len(block_rows[b]) == block_size)
        unsealed = [b for b in written if b not in set(sealing)]
        return cls(keep, offsets, block_rows, first, written, sealing, unsealed, whole, sink_rows, sink_blocks,
                   block_size)

    def whole_rows(self, blocks: list[int]) -> list[int]:
        """The rows of ``blocks`` (each written whole by this write) in offset order, block after block."""
        return [i for b in blocks for i in sorted(self.block_rows[b], key=self.offsets.__getitem__)]

    def slot_rows(self, blocks: list[int], slots: list[int]) -> tuple[list[int], list[int]]:
        """(rows, slot * block_size + offset) of the rows of ``blocks`` whose slot (``slots``, -1 = none) holds
        them."""
        src, dst = [], []
        for block, slot in zip(blocks, slots):
            if slot >= 0:
                rows = self.block_rows[block]
                src.extend(rows)
                dst.extend(slot * self.block_size + self.offsets[i] for i in rows)
        return src, dst


def _index(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


@dataclass(frozen=True)
class KiviStep:
    """A write's effect on the shared entries, for every pool to apply to its rows (index tensors on the maps'
    device)."""
    sink_rows: torch.Tensor | None      # rows at position 0 ...
    sink_entries: list[int]             # ... and their sink entries
    reopen_first: list[tuple[int, int]]  # (block, slot): sealed here, rows kept in codes: decoded into the slot
    into_slots: tuple[torch.Tensor, torch.Tensor] | None   # (rows, flattened slot rows) of blocks held before
    sealed: list[int]                   # the blocks this write seals: from their slot, then written whole
    sealed_index: torch.Tensor          # ``sealed`` as a tensor
    sealed_from: torch.Tensor           # the slots of the first ones (sealed from their open slot)
    whole_rows: torch.Tensor            # rows of the others (written whole), in offset order
    sealed_sinks: torch.Tensor          # bool, per sealed block: row 0 is a sink
    reopen_after: list[tuple[int, int]]  # (block, slot): opened here with earlier rows to keep
    new_rows: tuple[torch.Tensor, torch.Tensor] | None     # (rows, flattened slot rows) of blocks opened here
    op_args: tuple | None = None        # kivi_write's index tensors (CPU pools; None: nothing to do)
    kv_args: tuple | None = None        # kivi_write_kv's (CPU pools)


def transition(maps: KiviMaps, plan: KiviWrite) -> KiviStep:
    """``plan`` applied to ``maps`` (once: the pools sharing them get the same ``KiviStep``)."""
    if maps.last is not None and maps.last[0] is plan:
        return maps.last[1]
    device = maps.open.block_slot.device
    maps.fresh.clear()
    sink_entries = [maps.sink.take(block) for block in plan.sink_blocks]
    held = maps.open.held
    # Sealed by this write: from the rows it writes alone (whole), else from the block's open slot.
    whole = [b for b in plan.sealing if b in plan.whole and b not in held]
    from_slots = [b for b in plan.sealing if b not in whole]
    reopen_first = [(b, maps.open.take(b)) for b in from_slots if b not in held]
    src, dst = plan.slot_rows(plan.written, [held.get(b, -1) for b in plan.written])
    sealed = from_slots + whole
    from_slot = [held[b] for b in from_slots]
    sealed_sinks = torch.tensor([b in maps.sink.held for b in sealed], dtype=torch.bool, device=device)
    whole_rows = plan.whole_rows(whole)
    for block in from_slots:
        maps.open.release(block)
    new = [b for b in plan.unsealed if b not in held]           # after sealing, which freed slots
    new_slots = [maps.open.take(b) for b in new]
    reopen_after = [(b, s) for b, s in zip(new, new_slots) if plan.first_offset[b] > 0]
    new_src, new_dst = plan.slot_rows(new, new_slots)
    sealed_index = _index(sealed, device)
    maps.fresh.set(sealed, sealed_index)
    into_slots = (_index(src, device), _index(dst, device)) if src else None
    sink_rows = _index(plan.sink_rows, device) if plan.sink_rows else None
    new_rows = (_index(new_src, device), _index(new_dst, device)) if new_src else None
    op_args = kv_args = None
    if device.type == "cpu":                                # the ops run on CPU pools only
        none = torch.empty(0, dtype=torch.int64)
        rows = [0] * (plan.block_size * len(from_slots)) + whole_rows
        op_args = (*(into_slots or (none, none)), sealed_index, _index(from_slot + [-1] * len(whole), device),
                   _index(rows, device), sealed_sinks)
        kv_args = (*op_args, none if sink_rows is None else sink_rows, _index(sink_entries, device),
                   *(new_rows or (none, none)))
        if not (src or sealed):
            op_args = None
    step = KiviStep(sink_rows, sink_entries, reopen_first, into_slots, sealed, sealed_index, _index(from_slot, device),
                    _index(whole_rows, device), sealed_sinks, reopen_after, new_rows, op_args, kv_args)
    maps.last = (plan, step)
    return step
