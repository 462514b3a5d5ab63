"""KIVI-style 4-bit KV blocks: ``kv_cache_dtype="kivi"``.

Keys are quantised per channel over each full block (one bf16 scale and minimum per (head, block,
channel)), values per token (one bf16 scale and minimum per group of ``VALUE_GROUP`` elements along
head_dim, capped at head_dim), both asymmetric 4-bit. No rotation: a Hadamard rotation would mix the key
channels whose outliers per-channel scales exist to isolate. Beside the codes, in the model's dtype:
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
from dataclasses import dataclass

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
            device, open_capacity: int, sink_capacity: int | None = None) -> KiviPool:
        """``open_capacity``: open slots reserved (the running sequences); ``sink_capacity``: sink rows
        (default the same)."""
        KIVI.check_head_dim(head_dim)
        KIVI.check_block_size(block_size)
        data = torch.zeros((heads, num_blocks, block_size, head_dim // 2), dtype=torch.uint8, device=device)
        scale_shape = (2, head_dim) if is_key else (block_size, KIVI.num_scales(head_dim))
        scales = torch.ones((heads, num_blocks, *scale_shape), dtype=torch.bfloat16, device=device)
        open_ = SideStore.empty(heads, num_blocks, (block_size, head_dim), open_capacity, dtype, device)
        sinks = open_capacity if sink_capacity is None else sink_capacity
        sink = SideStore.empty(heads, num_blocks, (head_dim,), sinks, dtype, device)
        fresh = FreshRows(open_.rows[:, :0], torch.full((num_blocks,), -1, dtype=torch.int64, device=device))
        return cls(data, scales, KIVI, head_dim, None, is_key, open_, sink, fresh)

    def with_tensors(self, data: torch.Tensor, scales: torch.Tensor) -> KiviPool:
        """Grown tensors (``KVPools.grow_pools``): the side stores' block maps grow alike (new blocks: none)."""
        extra = data.shape[1] - self.open.block_slot.shape[0]
        for store in (self.open, self.sink, self.fresh):
            store.grow(extra)
        return KiviPool(data, scales, self.fmt, self.head_dim, None, self.is_key, self.open, self.sink, self.fresh)

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
        (= position ids): into open slots and the sink store, sealing the blocks whose last row is written."""
        self.fresh.clear()
        bs = self.data.shape[2]
        states = states.to(self.open.rows.dtype)
        blocks, offsets = slot_mapping // bs, slot_mapping % bs
        for i in (positions == 0).nonzero()[:, 0].tolist():        # a sequence's position 0: its sink
            entry = self.sink.take(int(blocks[i]))
            self.sink.rows[:, entry] = states[i]
        written, counts = torch.unique(blocks, return_counts=True)
        sealing = set(torch.unique(blocks[offsets == bs - 1]).tolist())
        whole = [b for b, n in zip(written.tolist(), counts.tolist())
                 if n == bs and b in sealing and self.open.slot(b) < 0]      # started and filled by this write
        for block in sorted(sealing - set(whole)):
            if self.open.slot(block) < 0:
                self._reopen(block)
        self._into_slots(states, blocks, offsets)
        if sealing:
            self._seal(sorted(sealing - set(whole)), whole, states, blocks, offsets)
        new = [b for b in written.tolist() if b not in sealing and self.open.slot(b) < 0]
        for block in new:                                      # after sealing, which frees slots
            self._reopen(block)
        if new:
            self._into_slots(states, blocks, offsets)

    def _into_slots(self, states, blocks, offsets) -> None:
        """The written rows whose block has an open slot, into it."""
        slots = self.open.block_slot.index_select(0, blocks)
        held = slots >= 0
        self.open.rows[:, slots[held], offsets[held]] = states[held].transpose(0, 1)

    def _seal(self, from_slots: list[int], whole: list[int], states, blocks, offsets) -> None:
        """Quantise the blocks ``from_slots`` (rows in their open slot) and ``whole`` (rows in ``states``);
        their rows become the fresh rows, their slots go back."""
        device = self.data.device
        parts = []
        if from_slots:
            slots = self.open.block_slot[torch.tensor(from_slots, device=device)]
            parts.append(self.open.rows.index_select(1, slots))
        if whole:
            local = torch.full_like(self.open.block_slot, -1)
            local[torch.tensor(whole, device=device)] = torch.arange(len(whole), device=device)
            where = local.index_select(0, blocks)
            picked = where >= 0
            rows = states.new_empty((len(whole), self.data.shape[2], *states.shape[1:]))
            rows[where[picked], offsets[picked]] = states[picked]
            parts.append(rows.permute(2, 0, 1, 3))                        # [Hkv, n, BS, D]
        sealed = from_slots + whole
        rows = torch.cat(parts, 1) if len(parts) > 1 else parts[0].contiguous()
        index = torch.tensor(sealed, device=device)
        codes, scales = self.quantize_blocks(rows, self.sink.block_slot.index_select(0, index) >= 0)
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


def write_kv(k_pool: KiviPool, v_pool: KiviPool, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
             positions: torch.Tensor, writes_all: bool = False) -> None:
    """New keys/values [N, Hkv, D] at ``slot_mapping`` int64 [N] (-1 = skip; ``writes_all``: none is, known
    on the host), stored indices ``positions`` int [N]."""
    if not writes_all:
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            slot_mapping, key, value, positions = slot_mapping[keep], key[keep], value[keep], positions[keep]
    k_pool.write(key, slot_mapping, positions)
    v_pool.write(value, slot_mapping, positions)


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
