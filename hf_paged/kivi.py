"""KIVI-style 4-bit KV blocks: ``kv_cache_dtype="kivi"``.

Keys are quantised per channel over each full block (one bf16 scale and minimum per (head, block,
channel)), values per token (one bf16 scale and minimum per group of ``VALUE_GROUP`` elements along
head_dim, capped at head_dim), both asymmetric 4-bit. The open (not yet full) block of a sequence stays in
the model's dtype in a side store of *open slots* until its last position is written; then the whole
block is quantised at once ("sealed") and its slot is released. No rotation: a Hadamard rotation would mix
the key channels whose outliers per-channel scales exist to isolate.

Layout (per layer; keys and values each a ``KiviPool``, a ``kv_formats.QuantizedPool``):
    data   : uint8 [Hkv, num_blocks, BS, D/2]   codes; element 2i in the low nibble of byte i
    scales : keys   bf16 [Hkv, num_blocks, 2, D]            row 0 the channel scales, row 1 the minima
             values bf16 [Hkv, num_blocks, BS, 2 * D / G]   the group scales, then the group minima
    open.slots : model dtype [Hkv, capacity, BS, D]         full-precision rows of open blocks
    open.block_slot : int64 [num_blocks]                    the block's open slot, -1 = none (sealed/unused)
``data`` and ``scales`` are indexed by block on dimension 1, so copy-on-write, pool growth and prefix
copies move a sealed block's scales with it; ``KVPools`` calls ``copy_open`` / ``release_blocks`` / ``grown``
for the side store.

Invariants:
- a block with an open slot is read from the slot, any other block from its codes;
- a slot is held by at most one block; ``free`` and the held slots partition ``range(capacity)``;
- a block is sealed exactly when the write that stores its position BS-1 runs (writes of a table come in
  position order; a prefill writes whole blocks and seals them in the same call);
- a block that becomes plain free in the block pool releases its slot (``BlockPool.free_listeners``);
  kept prefix-cache blocks are full, hence sealed, so they hold no slot;
- a write into a sealed block (a table truncated and rewritten) first reopens it from its codes.
Bytes: with block_size 32 and head_dim 64, keys take D/2 + 4D/32 and values D/2 + 4D/64 bytes per
(token, head): 0.297x bf16. Open slots are counted separately (``open_bytes``): the engine reserves one
per running sequence (``max_num_seqs``) out of its KV budget; the store grows (doubling) only if more
blocks are open at once, and ``pool_bytes`` reports what it holds.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .kv_formats import KIVI, KiviFormat, QuantizedPool  # noqa: F401  (re-exported)
from .kv_formats import KIVI_BLOCK_SIZE as BLOCK_SIZE, KIVI_CODE_MAX as CODE_MAX  # noqa: F401  (BLOCK_SIZE re-exported)

log = logging.getLogger("hf_paged.kivi")


@dataclass
class OpenStore:
    """The model-dtype rows of open blocks (see the module docstring); mutable, one per pool."""
    slots: torch.Tensor                    # [Hkv, capacity, BS, D]
    block_slot: torch.Tensor               # int64 [num_blocks], -1 = none
    free: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, heads: int, num_blocks: int, block_size: int, head_dim: int, capacity: int, dtype, device):
        slots = torch.zeros((heads, capacity, block_size, head_dim), dtype=dtype, device=device)
        return cls(slots, torch.full((num_blocks,), -1, dtype=torch.int64, device=device), list(range(capacity)))

    @property
    def num_open(self) -> int:
        return self.slots.shape[1] - len(self.free)

    def take(self) -> int:
        if not self.free:                   # more blocks open at once than reserved: double the store
            capacity = self.slots.shape[1]
            self.slots = torch.cat([self.slots, torch.zeros_like(self.slots[:, :max(1, capacity)])], 1)
            self.free = list(range(capacity, self.slots.shape[1]))
        return self.free.pop()

    def release(self, block: int) -> None:
        slot = int(self.block_slot[block])
        if slot >= 0:
            self.block_slot[block] = -1
            self.free.append(slot)


@dataclass(frozen=True)
class KiviPool(QuantizedPool):
    """A layer's KIVI keys (``is_key``) or values; ``open`` its side store."""
    is_key: bool = True
    open: OpenStore | None = None

    @classmethod
    def new(cls, is_key: bool, heads: int, num_blocks: int, block_size: int, head_dim: int, dtype,
            device, open_capacity: int) -> KiviPool:
        KIVI.check_head_dim(head_dim)
        KIVI.check_block_size(block_size)
        data = torch.zeros((heads, num_blocks, block_size, head_dim // 2), dtype=torch.uint8, device=device)
        scale_shape = (2, head_dim) if is_key else (block_size, KIVI.num_scales(head_dim))
        scales = torch.ones((heads, num_blocks, *scale_shape), dtype=torch.bfloat16, device=device)
        store = OpenStore.empty(heads, num_blocks, block_size, head_dim, open_capacity, dtype, device)
        return cls(data, scales, KIVI, head_dim, None, is_key, store)

    def with_tensors(self, data: torch.Tensor, scales: torch.Tensor) -> KiviPool:
        """Grown tensors (``KVPools.grow_pools``): the block -> slot map grows alike (new blocks: none)."""
        extra = data.shape[1] - self.open.block_slot.shape[0]
        self.open.block_slot = torch.cat([self.open.block_slot, self.open.block_slot.new_full((extra,), -1)])
        return KiviPool(data, scales, self.fmt, self.head_dim, None, self.is_key, self.open)

    @property
    def open_bytes(self) -> int:
        return self.open.slots.nbytes

    # ------------------------------------------------------------- codec
    def quantize_blocks(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [Hkv, n, BS, D] -> (codes [Hkv, n, BS, D/2], scales in this pool's layout)."""
        x = rows.float()
        if self.is_key:                                             # per channel over the block's tokens
            low, high = x.amin(2, keepdim=True), x.amax(2, keepdim=True)       # [Hkv, n, 1, D]
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
        """Blocks ``index`` [n] -> fp32 [Hkv, n, BS, D]: open ones from their slot, others decoded."""
        codes, scales = self.data.index_select(1, index), self.scales.index_select(1, index).float()
        x = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2).float()  # [Hkv, n, BS, D]
        if self.is_key:
            x = x * scales[:, :, :1] + scales[:, :, 1:]
        else:
            groups = scales.shape[-1] // 2
            x = x.unflatten(-1, (groups, -1)) * scales[..., :groups, None] + scales[..., groups:, None]
            x = x.flatten(-2)
        slot = self.open.block_slot.index_select(0, index)
        is_open = slot >= 0
        if bool(is_open.any()):
            x[:, is_open] = self.open.slots.index_select(1, slot[is_open]).float()
        return x

    # ------------------------------------------------------------- lifecycle
    def write(self, states: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """states [N, Hkv, D] at ``slot_mapping`` [N] (all >= 0): into open slots, sealing full blocks."""
        bs = self.data.shape[2]
        blocks, offsets = slot_mapping // bs, slot_mapping % bs
        for block in torch.unique(blocks).tolist():
            if int(self.open.block_slot[block]) < 0:
                self._reopen(block)
        slots = self.open.block_slot.index_select(0, blocks)
        self.open.slots[:, slots, offsets] = states.transpose(0, 1).to(self.open.slots.dtype)
        full = torch.unique(blocks[offsets == bs - 1])
        if full.numel():
            rows = self.open.slots.index_select(1, self.open.block_slot.index_select(0, full))
            codes, scales = self.quantize_blocks(rows)
            self.data.index_copy_(1, full, codes)
            self.scales.index_copy_(1, full, scales)
            for block in full.tolist():
                self.open.release(block)

    def _reopen(self, block: int) -> None:
        """Give ``block`` a slot holding its current (decoded) rows, so a partial rewrite keeps the rest."""
        index = torch.tensor([block], device=self.data.device)
        rows = self.dequantize_blocks(index)
        slot = self.open.take()
        self.open.block_slot[block] = slot
        self.open.slots[:, slot] = rows[:, 0].to(self.open.slots.dtype)

    def copy_open(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of the side store (codes and scales are copied by ``KVPools.copy_blocks``)."""
        for src, dst in copies:
            src_slot = int(self.open.block_slot[src])
            if src_slot < 0:
                self.open.release(dst)
                continue
            if int(self.open.block_slot[dst]) < 0:
                self.open.block_slot[dst] = self.open.take()
            self.open.slots[:, int(self.open.block_slot[dst])] = self.open.slots[:, src_slot]

    def release_blocks(self, blocks) -> None:
        """Blocks that became plain free (or were evicted): their slots go back."""
        for block in blocks:
            self.open.release(block)


def split_budget(blocks: int, block_bytes: int, open_block_bytes: int, max_num_seqs: int,
                 open_share: float = 1 / 3) -> tuple[int, int]:
    """The engine's KV budget (``blocks`` sealed blocks of ``block_bytes``) split into sealed blocks and
    open slots (``open_block_bytes`` each, the model's dtype): one slot per running sequence, at most
    ``max_num_seqs`` and at most ``open_share`` of the budget (at least one). Returns (blocks, slots);
    the engine runs at most ``slots`` sequences at once, so the store never outgrows what was paid for."""
    budget = blocks * block_bytes
    slots = max(1, min(max_num_seqs, int(budget * open_share) // open_block_bytes))
    left = blocks - -(-slots * open_block_bytes // block_bytes)
    if left < 1:
        raise ValueError(f"kv_cache_dtype='kivi': the KV budget ({budget} bytes) cannot hold one open block "
                         f"({open_block_bytes} bytes, the model's dtype) and one sealed block; raise "
                         "kv_cache_memory_bytes")
    if slots < max_num_seqs:
        log.info("kv_cache_dtype='kivi': %d open blocks fit in %.0f%% of the KV budget, so at most %d sequences "
                 "run at once (max_num_seqs=%d); raise kv_cache_memory_bytes for more", slots, 100 * open_share,
                 slots, max_num_seqs)
    return left, slots
