"""KIVI-style 4-bit KV blocks: ``kv_cache_dtype="kivi"``.

Keys are quantised per channel over each full block (one bf16 scale and minimum per (head, block,
channel)), values per token (one bf16 scale and minimum per group of ``VALUE_GROUP`` elements along
head_dim, capped at head_dim), both asymmetric 4-bit. Values are stored rotated by the fixed orthogonal R of
the other formats (``kv_formats.rotation_matrix``, a Hadamard matrix for power-of-two head dims): a token's
elements then spread evenly over its range, so its 16 levels fit them better (measured: 8-10% less KL on every
kind of text tried, ``bench/results/kivi-lab-vrot-20261205.py``); attention unrotates its output
(``Step.attend``; the CPU kernel each output row itself, leaving the query as it is), as for the rotating
formats. Keys are not rotated: R would mix the key channels whose outliers per-channel scales exist to
isolate. Everything a value pool stores (codes, open slots, sinks, fresh rows) is in the rotated space: the rotated states are rounded to the model's dtype before anything is
stored, so every way a block is sealed quantises the same rows. Beside the codes, in the model's dtype:
- the *open* (not yet full) block of each sequence, in a store of open slots, quantised as a whole
  ("sealed") by the write that stores its position BS-1;
- the *sink*: position 0 of each sequence (the attention sink), key and value, kept for the life of the
  block that holds it (prefix-cache blocks included: one row each);
- the *fresh* rows: the full rows of the blocks the latest write sealed, for that step's own reads.

The read rule (every reader: ``hf_paged.backends.quantized_torch`` and the CPU kernel): a query at stored
index t reads key/value s of block j = s // BS
- in full precision when j == t // BS (its own block): from the block's open slot, else from the fresh
  rows (the block was sealed by this step's write), else -- a block whose full rows are gone, which no
  paged cache asks for: a query's own token is written by the same step -- from its codes;
- from its codes otherwise, except s == 0 of a sequence (row 0 of a block with a sink): the sink row.
So what a query reads depends only on its position, never on how the prompt was split into steps:
chunked prefill, preemption + recompute and prefix hits read what one whole prefill and token-by-token
decoding read. (Blocks before the own one are full, hence sealed, when the query runs.)

Layout (per layer; keys and values each a ``KiviPool``, a ``kv_formats.QuantizedPool``):
    data   : uint8 [Hkv, num_blocks, BS, D/2]   codes; element 2i in the low nibble of byte i
    scales : keys   bf16 [Hkv, num_blocks, 2, D]            row 0 the channel scales, row 1 the minima
             values bf16 [Hkv, num_blocks, BS, 2 * D / G]   the group scales, then the group minima
    open.rows  : model dtype [Hkv, capacity, BS, D]   open.block_slot : int64 [num_blocks], -1 = none
    sink.rows  : model dtype [Hkv, capacity, D]       sink.block_slot : int64 [num_blocks], -1 = none
    fresh.rows : model dtype [Hkv, n, BS, D]          fresh.block_slot: int64 [num_blocks], -1 = none
``data`` and ``scales`` are indexed by block on dimension 1, so copy-on-write, pool growth and prefix
copies move a sealed block's scales with it; ``KVPools`` calls ``copy_open`` / ``release_blocks`` /
``with_tensors`` / ``copy_side_from`` for the side stores (``hf_paged.kivi_stores``).

Invariants:
- a block has an open slot exactly while it is open; a slot is held by at most one block, and ``free`` and
  the held entries partition ``range(capacity)`` (likewise for sinks);
- a block is sealed by the write that stores its position BS-1 (writes of a table come in position
  order); a block that write also started (all BS positions in one write, a prefill) never gets a slot:
  it is quantised from the written states. Sealing releases the slot before any new block takes one, so
  a sequence holds at most one slot at any time;
- a block holds a sink entry exactly when position 0 of a sequence is stored in it (written with
  position 0, copied with the block); sealing it takes the keys' channel range over rows 1..BS-1 only,
  and its row-0 codes are never read;
- the fresh rows belong to the latest write of this pool: replaced by the next write, dropped at the end
  of the step (``KVPools.end_step``), so the full-precision copy of a long prefill lives one step only;
- a block that becomes plain free in the block pool releases its slot and sink (``BlockPool.free_listeners``);
- a write into a sealed block (a table truncated and rewritten) first reopens it from its codes and sink.
Bytes: with block_size 32 and head_dim 64, keys take D/2 + 4D/32 and values D/2 + 4D/64 bytes per
(token, head): 0.297x bf16. The side stores are counted apart (``open_bytes``): a running sequence costs
one open slot and one sink row of the model's dtype; the engine reserves them per running sequence
(``max_num_seqs``, ``split_budget``) out of its KV budget. A store grows (doubling) only when more entries
are needed at once (sinks of kept prefix-cache blocks), and ``pool_bytes`` reports what it holds.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import repeat

import torch

from .kivi_stores import FreshRows, SideStore
from .kv_formats import KIVI, KiviFormat, QuantizedPool  # noqa: F401  (re-exported)
from .kv_formats import KIVI_BLOCK_SIZE as BLOCK_SIZE, KIVI_CODE_MAX as CODE_MAX  # noqa: F401  (BLOCK_SIZE re-exported)

log = logging.getLogger("hf_paged.kivi")


@dataclass(frozen=True)
class KiviPool(QuantizedPool):
    """A layer's KIVI keys (``is_key``) or values; ``open``, ``sink``, ``fresh`` its side stores."""
    is_key: bool = True
    open: SideStore | None = None
    sink: SideStore | None = None
    fresh: FreshRows | None = None

    @classmethod
    def new(cls, is_key: bool, heads: int, num_blocks: int, block_size: int, head_dim: int, dtype,
            device, open_capacity: int, sink_capacity: int | None = None,
            rotation: torch.Tensor | None = None) -> KiviPool:
        """``open_capacity``: open slots reserved (the running sequences); ``sink_capacity``: sink rows
        (default the same); ``rotation``: R for a value pool (keys take none)."""
        KIVI.check_head_dim(head_dim)
        KIVI.check_block_size(block_size)
        if is_key and rotation is not None:
            raise ValueError("KIVI keys are not rotated (per-channel scales isolate their outlier channels)")
        data = torch.zeros((heads, num_blocks, block_size, head_dim // 2), dtype=torch.uint8, device=device)
        scale_shape = (2, head_dim) if is_key else (block_size, KIVI.num_scales(head_dim))
        scales = torch.ones((heads, num_blocks, *scale_shape), dtype=torch.bfloat16, device=device)
        open_ = SideStore.empty(heads, num_blocks, (block_size, head_dim), open_capacity, dtype, device)
        sinks = open_capacity if sink_capacity is None else sink_capacity
        sink = SideStore.empty(heads, num_blocks, (head_dim,), sinks, dtype, device)
        fresh = FreshRows(open_.rows[:, :0], torch.full((num_blocks,), -1, dtype=torch.int64, device=device))
        return cls(data, scales, KIVI, head_dim, rotation, is_key, open_, sink, fresh)

    def with_tensors(self, data: torch.Tensor, scales: torch.Tensor) -> KiviPool:
        """Grown tensors (``KVPools.grow_pools``): the side stores' block maps grow alike (new blocks: none)."""
        extra = data.shape[1] - self.open.block_slot.shape[0]
        for store in (self.open, self.sink, self.fresh):
            store.grow(extra)
        return KiviPool(data, scales, self.fmt, self.head_dim, self.rotation, self.is_key, self.open, self.sink,
                        self.fresh)

    @property
    def open_bytes(self) -> int:
        """Bytes of the model-dtype side stores kept between steps (open slots and sinks)."""
        return self.open.rows.nbytes + self.sink.rows.nbytes

    # ------------------------------------------------------------- codec
    def quantize_blocks(self, rows: torch.Tensor, sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [Hkv, n, BS, D] -> (codes [Hkv, n, BS, D/2], scales in this pool's layout). ``sink`` bool [n]:
        blocks whose row 0 is read from the sink store, so that the keys' channel range leaves it out."""
        x = rows.float()
        if self.is_key:                                             # per channel over the block's tokens
            low, high = x[:, :, 1:].amin(2, keepdim=True), x[:, :, 1:].amax(2, keepdim=True)   # [Hkv, n, 1, D]
            head = x[:, :, :1]
            if sink is not None:
                outside = sink.view(1, -1, 1, 1)
                low = torch.minimum(low, head.masked_fill(outside, float("inf")))
                high = torch.maximum(high, head.masked_fill(outside, float("-inf")))
            else:
                low, high = torch.minimum(low, head), torch.maximum(high, head)
        else:
            x = x.unflatten(-1, (-1, KIVI.value_group(self.head_dim)))         # [Hkv, n, BS, G, g]
            low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        scale = ((high - low) / CODE_MAX).to(torch.bfloat16)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        low = low.to(torch.bfloat16)
        codes = ((x - low.float()) / scale.float()).round_().clamp_(0, CODE_MAX).to(torch.uint8)
        if self.is_key:
            scales = torch.cat([scale, low], 2)                                 # [Hkv, n, 2, D]
        else:
            codes = codes.flatten(-2)
            scales = torch.cat([scale.squeeze(-1), low.squeeze(-1)], -1)        # [Hkv, n, BS, 2G]
        return codes[..., 0::2] | (codes[..., 1::2] << 4), scales

    def dequantize_blocks(self, index: torch.Tensor) -> torch.Tensor:
        """Blocks ``index`` [n] as read by a query in a later block -> fp32 [Hkv, n, BS, D]: decoded codes,
        row 0 of a block with a sink from the sink store."""
        codes, scales = self.data.index_select(1, index), self.scales.index_select(1, index).float()
        x = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2).float()  # [Hkv, n, BS, D]
        if self.is_key:
            x = x * scales[:, :, :1] + scales[:, :, 1:]
        else:
            groups = scales.shape[-1] // 2
            x = x.unflatten(-1, (groups, -1)) * scales[..., :groups, None] + scales[..., groups:, None]
            x = x.flatten(-2)
        sink = self.sink.block_slot.index_select(0, index)
        has = sink >= 0
        if bool(has.any()):
            x[:, has, 0] = self.sink.rows.index_select(1, sink[has]).float()
        return x

    def own_blocks(self, index: torch.Tensor) -> torch.Tensor:
        """Blocks ``index`` [n] as read by a query inside them -> fp32 [Hkv, n, BS, D]: the open slot, else
        the fresh rows, else (full rows gone) as :meth:`dequantize_blocks`."""
        x = self.dequantize_blocks(index)
        for store in (self.fresh, self.open):           # the open slot wins (a block is never in both)
            slot = store.block_slot.index_select(0, index)
            has = slot >= 0
            if bool(has.any()):
                x[:, has] = store.rows.index_select(1, slot[has]).float()
        return x

    # ------------------------------------------------------------- lifecycle
    def write(self, states: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor) -> None:
        """states [N, Hkv, D] at ``slot_mapping`` [N] (all >= 0, each once), stored indices ``positions`` [N]
        (= position ids): as :meth:`write_planned` with the plan of those slots."""
        self.write_planned(states, KiviWrite.of(slot_mapping, positions, self.data.shape[2]))

    def write_planned(self, states: torch.Tensor, plan: KiviWrite, op=None) -> None:
        """states [N, Hkv, D], the rows ``plan`` describes (each slot once): into open slots and the sink
        store, sealing the blocks whose last row is written. ``op``: the CPU's ``hf_paged_cpu.kivi_write``
        (``CpuKernelBackend.kivi_write``), which moves the rows and seals in one call; None: PyTorch ops."""
        self.fresh.clear()
        if states.dtype != self.open.rows.dtype:
            states = states.to(self.open.rows.dtype)
        if plan.sink_rows:                                      # a sequence's position 0: its sink
            entries = [self.sink.take(block) for block in plan.sink_blocks]   # (may grow: index afterwards)
            self.sink.rows[:, entries] = states[plan.sink_rows].transpose(0, 1)
        # Sealed by this write: from the rows it writes alone (``whole``), else from the block's open slot.
        # (Held maps read directly in the loops below: they run per pool, layer and step.)
        held = self.open.held
        whole = [b for b in plan.sealing if b in plan.whole and b not in held]
        from_slots = [b for b in plan.sealing if b not in whole]
        for block in from_slots:
            if block not in held:
                self._reopen(block)
        if op is not None:
            self._write_op(op, states, plan, from_slots, whole)
        else:
            self._into_slots(states, plan, plan.written)
            if plan.sealing:
                self._seal(from_slots, whole, states, plan)
        new = [b for b in plan.unsealed if b not in held]
        for block in new:                                      # after sealing, which frees slots
            if plan.first_offset[block] > 0:                   # earlier rows to keep (a rewrite)
                self._reopen(block)
            else:                                              # later rows are written before any read
                self.open.take(block)
        if new:
            self._into_slots(states, plan, new)

    def _into_slots(self, states: torch.Tensor, plan: KiviWrite, blocks: list[int]) -> None:
        """The written rows of ``blocks`` that have an open slot, into it."""
        slots = tuple(self.open.slot(b) for b in blocks)
        src, dst = plan.slot_rows(blocks, slots, self.data.shape[2], states.device)
        if src is not None:
            flat = self.open.rows.view(self.open.rows.shape[0], -1, self.open.rows.shape[-1])
            flat.index_copy_(1, dst, states.index_select(0, src).transpose(0, 1))

    def _write_op(self, op, states: torch.Tensor, plan: KiviWrite, from_slots: list[int], whole: list[int]) -> None:
        """``_into_slots`` and ``_seal`` in one call of the C++ op (the same slot rows, codes, scales and
        fresh rows: kivi_write_cpu.cpp equals ``quantize_blocks`` bit for bit)."""
        slot, sink = self.open.held.get, self.sink.held
        args = plan.op_args(tuple(map(slot, plan.written, repeat(-1))), from_slots,
                            tuple(slot(b, -1) for b in from_slots), whole, tuple(b in sink for b in from_slots + whole),
                            self.data.shape[2])
        if args is None:
            return
        sealed = from_slots + whole
        fresh = (self.open.rows.new_empty((self.open.rows.shape[0], len(sealed), *self.open.rows.shape[2:])) if sealed
                 else self.fresh.rows)                       # (cleared: [Hkv, 0, BS, D])
        src, dst, blocks, slots, rows, sinks = args
        op(states, src, dst, self.open.rows, blocks, slots, rows, sinks, self.data, self.scales, self.is_key, fresh)
        if sealed:
            self.fresh.set(sealed, fresh, blocks)
        for block in from_slots:
            self.open.release(block)

    def _seal(self, from_slots: list[int], whole: list[int], states: torch.Tensor, plan: KiviWrite) -> None:
        """Quantise the blocks ``from_slots`` (rows in their open slot) and ``whole`` (rows in ``states``);
        their rows become the fresh rows, their slots go back."""
        device = self.data.device
        parts = []
        if from_slots:
            slots = torch.tensor([self.open.slot(b) for b in from_slots], device=device)
            parts.append(self.open.rows.index_select(1, slots))
        if whole:                                              # rows in offset order, block after block
            rows = states[plan.whole_rows(whole)].unflatten(0, (len(whole), self.data.shape[2]))   # [n, BS, Hkv, D]
            parts.append(rows.permute(2, 0, 1, 3))                                # [Hkv, n, BS, D]
        sealed = from_slots + whole
        rows = torch.cat(parts, 1) if len(parts) > 1 else parts[0].contiguous()
        index = torch.tensor(sealed, device=device)
        codes, scales = self.quantize_blocks(rows, torch.tensor([self.sink.slot(b) >= 0 for b in sealed], device=device))
        self.data.index_copy_(1, index, codes)
        self.scales.index_copy_(1, index, scales)
        self.fresh.set(sealed, rows)
        for block in from_slots:
            self.open.release(block)

    def _reopen(self, block: int) -> None:
        """Give ``block`` a slot holding its current rows (codes and sink), so a partial rewrite keeps the rest."""
        rows = self.dequantize_blocks(torch.tensor([block], device=self.data.device))
        slot = self.open.take(block)
        self.open.rows[:, slot] = rows[:, 0].to(self.open.rows.dtype)

    def copy_open(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of the side stores (codes and scales are copied by ``KVPools.copy_blocks``)."""
        for src, dst in copies:
            self.open.copy(self.open, src, dst)
            self.sink.copy(self.sink, src, dst)

    def copy_side_from(self, src: KiviPool, src_blocks: list[int], dst_blocks: list[int]) -> None:
        """Blocks copied from another pool (the generate prefix store): full, hence sealed, so they take no
        open slot; a sink travels with its block."""
        self.release_blocks(dst_blocks)
        for s, d in zip(src_blocks, dst_blocks):
            self.sink.copy(src.sink, s, d)

    def release_blocks(self, blocks) -> None:
        """Blocks that became plain free (or were evicted): their slots and sinks go back."""
        for block in blocks:
            self.open.release(block)
            self.sink.release(block)
        self.fresh.drop(blocks)


@dataclass(frozen=True)
class KiviWrite:
    """What a write does to blocks, from its slots and positions alone: the same for every KIVI pool a step
    writes (``KVPools.write`` makes it once per step). Host lists; rows are indices into the written states
    (the tokens with a slot, in order)."""
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
    # (blocks, their open slots) -> the rows of those blocks with a slot and where they go in the flattened
    # slot rows: every pool of a step holds the same slots, so the first pool's index tensors serve all.
    _slot_rows: dict = field(default_factory=dict, compare=False, repr=False)

    def slot_rows(self, blocks: list[int], slots: tuple[int, ...], block_size: int, device):
        """(rows, slot * block_size + offset) index tensors of the rows of ``blocks`` whose slot (``slots``,
        -1 = none) holds them, or (None, None) when none does."""
        key = (tuple(blocks), slots)
        if key not in self._slot_rows:
            src, dst = [], []
            for block, slot in zip(blocks, slots):
                if slot >= 0:
                    rows = self.block_rows[block]
                    src.extend(rows)
                    dst.extend(slot * block_size + self.offsets[i] for i in rows)
            self._slot_rows[key] = ((torch.tensor(src, device=device), torch.tensor(dst, device=device)) if src
                                    else (None, None))
        return self._slot_rows[key]

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
        return cls(keep, offsets, block_rows, first, written, sealing, unsealed, whole, sink_rows, sink_blocks)

    def whole_rows(self, blocks: list[int]) -> list[int]:
        """The rows of ``blocks`` (each written whole by this write) in offset order, block after block."""
        return [i for b in blocks for i in sorted(self.block_rows[b], key=self.offsets.__getitem__)]

    def op_args(self, written_slots: tuple[int, ...], from_slots: list[int], their_slots: tuple[int, ...],
                whole: list[int], sinks: tuple[bool, ...], block_size: int):
        """The index tensors of ``kivi_write`` (kivi_write_cpu.cpp) for a pool whose written blocks hold
        ``written_slots``, sealing ``from_slots`` (in ``their_slots``) and ``whole``, ``sinks`` (per sealed
        block: row 0 is a sink): (src, dst, blocks, slots, rows, sinks), or None when it has nothing to do.
        Made once per step for all pools (they hold the same slots)."""
        key = ("op", written_slots, tuple(from_slots), their_slots, tuple(whole), sinks)
        if key not in self._slot_rows:
            src, dst = self.slot_rows(self.written, written_slots, block_size, torch.device("cpu"))
            sealed = from_slots + whole
            if src is None and not sealed:
                self._slot_rows[key] = None
            else:
                none = torch.empty(0, dtype=torch.int64)
                rows = [0] * (block_size * len(from_slots)) + self.whole_rows(whole)
                self._slot_rows[key] = (none if src is None else src, none if dst is None else dst,
                                        torch.tensor(sealed, dtype=torch.int64),
                                        torch.tensor(list(their_slots) + [-1] * len(whole), dtype=torch.int64),
                                        torch.tensor(rows, dtype=torch.int64), torch.tensor(sinks, dtype=torch.bool))
        return self._slot_rows[key]


def write_kv(k_pool: KiviPool, v_pool: KiviPool, key: torch.Tensor, value: torch.Tensor,
             plan: KiviWrite, op=None) -> None:
    """New keys/values [N, Hkv, D] at the slots ``plan`` was made from (``KiviWrite.of``); ``op``: as
    ``KiviPool.write_planned``'s (CPU pools only). Values are rotated here (in fp32, then rounded to their dtype)."""
    if plan.keep is not None:
        key, value = key.index_select(0, plan.keep), value.index_select(0, plan.keep)
    # contiguous first: a strided [N, Hkv, D] view (of the step's q/k/v product) takes a batched matmul 3x slower
    value = v_pool.rotate(value.contiguous()).to(value.dtype)
    k_pool.write_planned(key, plan, op)
    v_pool.write_planned(value, plan, op)


def aligned_hit(columns: int, pads: list[int], block_size: int) -> int:
    """The most columns c <= ``columns`` at which each left-padded row's cached prefix (c - pad tokens) ends on
    a block boundary or holds nothing. A row continuing inside a cached block would reopen it from its codes,
    and its queries there would not read that block in full precision as without the hit (the read rule)."""
    for c in range(columns, -1, -1):
        if all(c <= pad or (c - pad) % block_size == 0 for pad in pads):
            return c
    return 0


def split_budget(blocks: int, block_bytes: int, sequence_bytes: int, max_num_seqs: int,
                 open_share: float = 1 / 3) -> tuple[int, int]:
    """The engine's KV budget (``blocks`` sealed blocks of ``block_bytes``) split into sealed blocks and
    the side rows of running sequences (``sequence_bytes`` each, the model's dtype: an open block and a sink
    row): one set per running sequence, at most ``max_num_seqs`` and at most ``open_share`` of the budget
    (at least one). Returns (blocks, sequences); the engine runs at most that many sequences at once, so
    the open slots never outgrow what was paid for."""
    budget = blocks * block_bytes
    slots = max(1, min(max_num_seqs, int(budget * open_share) // sequence_bytes))
    left = blocks - -(-slots * sequence_bytes // block_bytes)
    if left < 1:
        raise ValueError(f"kv_cache_dtype='kivi': the KV budget ({budget} bytes) cannot hold one open block and "
                         f"sink ({sequence_bytes} bytes, the model's dtype) and one sealed block; raise "
                         "kv_cache_memory_bytes")
    if slots < max_num_seqs:
        log.info("kv_cache_dtype='kivi': %d open blocks fit in %.0f%% of the KV budget, so at most %d sequences "
                 "run at once (max_num_seqs=%d); raise kv_cache_memory_bytes for more", slots, 100 * open_share,
                 slots, max_num_seqs)
    return left, slots
