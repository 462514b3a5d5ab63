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
copies move a sealed block's scales with it. Which entry of the side stores a block holds (the block_slot
maps) is the same for every pool of a cache on a device: kept once (``kivi_stores.KiviMaps``), changed once
per write (``kivi_plan.transition``) and per release / copy-on-write / prefix copy (``KVPools``), while each
pool moves its own rows (``write_planned``, ``copy_rows``, ``SideStore.copy_rows``).

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
- the fresh rows belong to the latest write: replaced by the next write, dropped at the end
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
from dataclasses import dataclass

import torch

from .kivi_plan import KiviStep, KiviWrite, transition  # noqa: F401  (KiviWrite re-exported)
from .kivi_stores import FreshRows, KiviMaps, SideStore
from .kv_formats import KIVI, KiviFormat, QuantizedPool  # noqa: F401  (re-exported)
from .kv_formats import KIVI_BLOCK_SIZE as BLOCK_SIZE, KIVI_CODE_MAX as CODE_MAX  # noqa: F401  (BLOCK_SIZE re-exported)

log = logging.getLogger("hf_paged.kivi")


@dataclass(frozen=True)
class KiviPool(QuantizedPool):
    """A layer's KIVI keys (``is_key``) or values; ``open``, ``sink``, ``fresh`` its side rows, at the entries of
    ``maps`` (shared by the pools of a cache on one device, else its own)."""
    is_key: bool = True
    open: SideStore | None = None
    sink: SideStore | None = None
    fresh: FreshRows | None = None
    maps: KiviMaps | None = None

    @classmethod
    def new(cls, is_key: bool, heads: int, num_blocks: int, block_size: int, head_dim: int, dtype,
            device, open_capacity: int, sink_capacity: int | None = None,
            rotation: torch.Tensor | None = None, maps: KiviMaps | None = None) -> KiviPool:
        """``open_capacity``: open slots reserved (the running sequences); ``sink_capacity``: sink rows
        (default the same); ``rotation``: R for a value pool (keys take none); ``maps``: entries shared with
        other pools (``KVPools``), else the pool's own (sized by the capacities)."""
        KIVI.check_head_dim(head_dim)
        KIVI.check_block_size(block_size)
        if is_key and rotation is not None:
            raise ValueError("KIVI keys are not rotated (per-channel scales isolate their outlier channels)")
        if maps is None:
            maps = KiviMaps.empty(num_blocks, open_capacity, open_capacity if sink_capacity is None else sink_capacity,
                                  device)
        data = torch.zeros((heads, num_blocks, block_size, head_dim // 2), dtype=torch.uint8, device=device)
        scale_shape = (2, head_dim) if is_key else (block_size, KIVI.num_scales(head_dim))
        scales = torch.ones((heads, num_blocks, *scale_shape), dtype=torch.bfloat16, device=device)
        open_ = SideStore(torch.zeros((heads, maps.open.capacity, block_size, head_dim), dtype=dtype, device=device),
                          maps.open)
        sink = SideStore(torch.zeros((heads, maps.sink.capacity, head_dim), dtype=dtype, device=device), maps.sink)
        fresh = FreshRows(open_.rows[:, :0], maps.fresh)
        return cls(data, scales, KIVI, head_dim, rotation, is_key, open_, sink, fresh, maps)

    def with_tensors(self, data: torch.Tensor, scales: torch.Tensor) -> KiviPool:
        """Grown tensors (``KVPools.grow_pools``): the maps grow alike (new blocks: none), once for all sharers."""
        extra = data.shape[1] - self.maps.num_blocks
        if extra > 0:
            self.maps.grow(extra)
        return KiviPool(data, scales, self.fmt, self.head_dim, self.rotation, self.is_key, self.open, self.sink,
                        self.fresh, self.maps)

    @property
    def open_bytes(self) -> int:
        """Bytes of the model-dtype side rows kept between steps (open slots and sinks)."""
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
        rows, sealing the blocks whose last row is written; the shared entries change once per plan
        (``kivi_plan.transition``), this pool's rows follow them. ``op``: the CPU's ``hf_paged_cpu.kivi_write``
        (``CpuKernelBackend.kivi_write``), which moves the rows and seals in one call; None: PyTorch ops."""
        step = transition(self.maps, plan)
        if states.dtype != self.open.rows.dtype:
            states = states.to(self.open.rows.dtype)
        self.open.fit()
        self.sink.fit()
        if step.sink_rows is not None:                          # a sequence's position 0: its sink
            self.sink.rows[:, step.sink_entries] = states.index_select(0, step.sink_rows).transpose(0, 1)
        for block, slot in step.reopen_first:
            self._reopen(block, slot)
        if op is not None:
            self._write_op(op, states, step)
        else:
            self._into_slots(states, step.into_slots)
            if step.sealed:
                self._seal(states, step)
            else:
                self.fresh.drop_rows()
        for block, slot in step.reopen_after:                   # (after sealing, which freed their slots)
            self._reopen(block, slot)
        self._into_slots(states, step.new_rows)

    def _into_slots(self, states: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """``rows`` = (src, dst): states[src] into the flattened open rows at dst."""
        if rows is not None:
            src, dst = rows
            flat = self.open.rows.view(self.open.rows.shape[0], -1, self.open.rows.shape[-1])
            flat.index_copy_(1, dst, states.index_select(0, src).transpose(0, 1))

    def _write_op(self, op, states: torch.Tensor, step: KiviStep) -> None:
        """Rows into held slots and the sealing in one call of the C++ op (the same slot rows, codes, scales
        and fresh rows as ``_into_slots`` + ``_seal``: kivi_write_cpu.cpp equals ``quantize_blocks`` bit for bit)."""
        if step.op_args is None:
            self.fresh.drop_rows()
            return
        rows = self.open.rows
        fresh = rows.new_empty((rows.shape[0], len(step.sealed), *rows.shape[2:])) if step.sealed else rows[:, :0]
        op(states, *step.op_args[:2], rows, *step.op_args[2:], self.data, self.scales, self.is_key, fresh)
        self.fresh.rows = fresh

    def _seal(self, states: torch.Tensor, step: KiviStep) -> None:
        """Quantise the blocks ``step.sealed``: those with a slot from it, the others (``whole``) from
        ``states``; their rows become the fresh rows."""
        parts = []
        if step.sealed_from.numel():                           # (they come first)
            parts.append(self.open.rows.index_select(1, step.sealed_from))
        whole = len(step.sealed) - step.sealed_from.numel()
        if whole:                                              # rows in offset order, block after block
            rows = states.index_select(0, step.whole_rows).unflatten(0, (whole, self.data.shape[2]))   # [n, BS, Hkv, D]
            parts.append(rows.permute(2, 0, 1, 3))                                # [Hkv, n, BS, D]
        rows = torch.cat(parts, 1) if len(parts) > 1 else parts[0].contiguous()
        codes, scales = self.quantize_blocks(rows, step.sealed_sinks)
        self.data.index_copy_(1, step.sealed_index, codes)
        self.scales.index_copy_(1, step.sealed_index, scales)
        self.fresh.rows = rows

    def _reopen(self, block: int, slot: int) -> None:
        """Slot ``slot`` (just given to ``block``) holds the block's current rows (codes and sink), so a partial
        rewrite keeps the rest."""
        rows = self.dequantize_blocks(torch.tensor([block], device=self.data.device))
        self.open.rows[:, slot] = rows[:, 0].to(self.open.rows.dtype)

    def copy_rows(self, open_pairs: list[tuple[int, int]], sink_pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of the side rows, at the entry pairs ``KiviMaps.copy`` gave (codes and scales are
        copied by ``KVPools.copy_blocks``)."""
        self.open.copy_rows(self.open, open_pairs)
        self.sink.copy_rows(self.sink, sink_pairs)

    def copy_open(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write ``(src, dst)`` of a pool that does not share its maps: the entries, then the rows."""
        if self.maps.shared:
            raise RuntimeError("this KIVI pool shares its entries with the other pools of its cache: copy blocks "
                               "through KVPools.copy_blocks, which changes the entries once for all of them")
        self.copy_rows(*self.maps.copy(copies))


def write_kv(k_pool: KiviPool, v_pool: KiviPool, key: torch.Tensor, value: torch.Tensor,
             plan: KiviWrite, ops=None) -> None:
    """New keys/values [N, Hkv, D] at the slots ``plan`` was made from (``KiviWrite.of``). ``ops``: the CPU
    backend (``CpuKernelBackend``: ``kivi_write_kv``, ``kivi_write``, ``rotate_rows``) for CPU pools, else None
    (PyTorch ops). Values are rotated here, in fp32 then rounded to their dtype: by the C++ ``rotate_row``
    where ``ops`` is given (inside ``kivi_write_kv``, or ``rotate_rows``: the same rows), else by
    ``KiviPool.rotate``. A write that reopens no block, of pools sharing their maps, is one ``kivi_write_kv``."""
    if plan.keep is not None:
        key, value = key.index_select(0, plan.keep), value.index_select(0, plan.keep)
    if ops is None:
        k_pool.write_planned(key, plan)
        v_pool.write_planned(rotated_values(v_pool, value), plan)
        return
    args = one_call_args(k_pool, v_pool, plan, key.dtype)
    if args is not None:
        rotation, indices, k_stores, v_stores = args
        k_pool.fresh.rows, v_pool.fresh.rows = ops.kivi_write_kv(key, value, rotation, *indices, *k_stores, *v_stores)
        return
    k_pool.write_planned(key, plan, ops.kivi_write)
    v_pool.write_planned(rotated_values(v_pool, value, ops), plan, ops.kivi_write)


def one_call_args(k_pool: KiviPool, v_pool: KiviPool, plan: KiviWrite, dtype: torch.dtype) -> tuple | None:
    """``kivi_write_kv``'s arguments after the keys and values, for a write of ``plan`` (every token kept) of states
    in ``dtype`` into CPU pools: (the rotation, the plan's index tensors, the key pool's open rows, sink rows, codes
    and scales, the value pool's). The plan is applied to the shared entries first (``transition``, once per plan)
    and the side stores fitted to them. None where the write takes ``kivi_write`` per pool instead: pools that do not
    share their entries, a block reopened from its codes, states in another dtype than the side rows'."""
    step = transition(k_pool.maps, plan)
    if (v_pool.maps is not k_pool.maps or step.reopen_first or step.reopen_after or step.kv_args is None
            or dtype != k_pool.open.rows.dtype):
        return None
    for store in (k_pool.open, k_pool.sink, v_pool.open, v_pool.sink):
        store.fit()
    return (v_pool.rotation, list(step.kv_args), [k_pool.open.rows, k_pool.sink.rows, k_pool.data, k_pool.scales],
            [v_pool.open.rows, v_pool.sink.rows, v_pool.data, v_pool.scales])


def rotated_values(v_pool: KiviPool, value: torch.Tensor, ops=None) -> torch.Tensor:
    """value [..., D] -> the rows a value pool stores (in its dtype): x R in fp32, rounded, by the C++
    ``rotate_row`` where ``ops`` (the CPU backend) is given, as ``kivi_write_kv`` rotates, else by
    ``KiviPool.rotate``. (The two agree within float rounding, not bit for bit: a pool takes one of them.)"""
    dtype = v_pool.open.rows.dtype
    if v_pool.rotation is None:
        return value.to(dtype)
    if ops is None:
        return v_pool.rotate(value.contiguous()).to(dtype)
    flat = value.to(dtype).reshape(-1, value.shape[-1]).float()
    return ops.rotate_rows(flat, v_pool.rotation, False)[0].view(value.shape).to(dtype)


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
