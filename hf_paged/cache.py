"""PagedCache: a ``transformers.Cache`` whose K/V live in a pool of fixed-size blocks.

How a forward flows through it
------------------------------
1. A forward pre-hook on the decoder (installed by ``hf_paged.patch``) calls ``plan_step`` with the
   2D padding mask once per forward: rows get slots for their *real* new tokens only, shared
   partly-filled blocks are copied (copy-on-write), and a ``StepPlan`` is built.
2. The hook passes the plan down the decoder's kwargs to every attention call; each layer's
   ``update`` writes its new K/V into the planned slots and returns the layer's pools as "keys"/"values".
3. The registered attention function (``attention.paged_attention``) reads K/V through the plan.

Lengths: transformers sees the *logical* length (columns, pads included) from ``get_seq_length``;
the pool stores only real tokens, so a row's stored index of a token equals its position id.

Pool size: ``num_blocks`` or ``max_memory_bytes`` fixes it (exhaustion raises PoolExhaustedError and
changes nothing); with neither, the pool grows on demand: it starts at what the first step needs
plus two blocks per row, and each growth adds half the current size or what the step needs, whichever
is more (each growth copies the pools once, like DynamicCache's concatenation).
"""
from __future__ import annotations

import torch

from .allocator import BlockAllocator, PoolExhaustedError
from .plan import StepPlan, build_plan
from .pools import KVPools, kv_bytes_per_token

PLAN_KWARG = "hf_paged_plan"
_MIN_BLOCKS = 16


class PagedCache(KVPools):
    """Paged KV cache for llama, qwen2, qwen3, glm and glm4 models.

    Args:
        config: the model's config (its KV geometry and sliding windows are read from it).
        block_size: tokens per block (1..1024; 16 by default, as in vLLM).
        num_blocks: fixed pool size in blocks.
        max_memory_bytes: fixed pool size as a KV byte budget (over all layers, keys and values).
        release_finished_rows: once a row's input is an EOS token (generate sets the EOS ids), free its
            blocks and leave it out of later forwards (its logits are zeros from then on).
        dtype, device: pool dtype/device; by default those of the model on the first forward.
        backend: attention backend object (see ``backends``); by default chosen by device.
    """

    def __init__(self, config, *, block_size: int = 16, num_blocks: int | None = None,
                 max_memory_bytes: int | None = None, release_finished_rows: bool = True,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 backend=None):
        super().__init__(config, backend)
        if not isinstance(block_size, int) or not 1 <= block_size <= 1024:
            raise ValueError(f"block_size must be an int in 1..1024, got {block_size!r}")
        if num_blocks is not None and max_memory_bytes is not None:
            raise ValueError("pass num_blocks or max_memory_bytes, not both")
        if num_blocks is not None and (not isinstance(num_blocks, int) or num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if max_memory_bytes is not None and max_memory_bytes <= 0:
            raise ValueError(f"max_memory_bytes must be positive, got {max_memory_bytes!r}")
        self.block_size = block_size
        self.release_finished_rows = release_finished_rows
        self.eos_token_ids: frozenset[int] = frozenset()
        self._fixed_blocks = num_blocks
        self._budget = max_memory_bytes
        self._dtype = dtype
        self._device = torch.device(device) if device is not None else None
        if max_memory_bytes is not None and dtype is not None:
            self._blocks_for_budget(dtype)          # fail early on a budget below one block
        self.allocator: BlockAllocator | None = None
        self._clear_rows()

    # ------------------------------------------------------------ geometry
    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes over all layers (keys and values)."""
        return kv_bytes_per_token(self.config, self._dtype or torch.float32)

    def _blocks_for_budget(self, dtype: torch.dtype) -> int:
        self._dtype = dtype
        per_block = self.bytes_per_token * self.block_size
        blocks = self._budget // per_block
        if blocks < 1:
            raise ValueError(
                f"max_memory_bytes={self._budget} holds no block: one block of {self.block_size} tokens "
                f"takes {per_block} bytes for this model. Raise max_memory_bytes or lower block_size.")
        return int(blocks)

    # ------------------------------------------------------------ rows
    def _clear_rows(self) -> None:
        self._rows: list[int] = []           # allocator sequence id of each batch row
        self._finished: list[bool] = []      # rows whose blocks were released at EOS
        self._next_seq_id = 0
        self._columns = 0                    # logical length: columns seen, pads included
        self._written: list[torch.Tensor] = []  # bool [B, Q] per step: which columns were stored
        self._plan: StepPlan | None = None
        self.active_rows: torch.Tensor | None = None   # rows this forward computes, None = all

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        self.allocator.add_sequence(self._next_seq_id)
        return self._next_seq_id

    def _ensure_pools(self, dtype: torch.dtype, device: torch.device, first_need: int) -> None:
        if self.allocator is not None:
            return
        self._dtype = self._dtype or dtype
        self._device = self._device or device
        if self._fixed_blocks is not None:
            blocks = self._fixed_blocks
        elif self._budget is not None:
            blocks = self._blocks_for_budget(self._dtype)
        else:
            blocks = max(_MIN_BLOCKS, first_need)
        self.allocator = BlockAllocator(blocks, self.block_size)
        self.allocate_pools(blocks, self.block_size, self._dtype, self._device)

    @property
    def growable(self) -> bool:
        return self._fixed_blocks is None and self._budget is None

    def _make_room(self, needed: int) -> None:
        alloc = self.allocator
        if needed <= alloc.num_free:
            return
        if not self.growable:
            raise PoolExhaustedError(needed, alloc.num_free, alloc.num_blocks, self.block_size)
        extra = max(needed - alloc.num_free, alloc.num_blocks // 2)
        alloc.grow(extra)
        self.grow_pools(extra)

    # ------------------------------------------------------------ planning
    def plan_step(self, attention_mask: torch.Tensor | None, input_ids: torch.Tensor | None,
                  batch_size: int, q_len: int, dtype: torch.dtype, device: torch.device,
                  compact: bool = False) -> StepPlan:
        """Reserve slots for this forward's real tokens and build the plan every layer reads.

        attention_mask: the 2D padding mask [B, columns_before + Q] (or None: all real).
        compact: the caller runs the forward on ``self.active_rows`` only (finished rows left out);
            the plan then covers those rows. Without it every row is planned (finished ones read nothing).
        When this raises (pool exhausted, bad shapes) nothing changes, except that rows found
        finished at this step have already released their blocks (they need none again).
        """
        new_real = self._new_real_columns(attention_mask, batch_size, q_len)
        real_tokens = int(new_real.sum())
        self._ensure_pools(dtype, device, -(-real_tokens // self.block_size) + 2 * batch_size)
        first_step = not self._rows
        if first_step:
            leaders = _duplicate_leaders(input_ids, attention_mask, batch_size)
        elif len(self._rows) != batch_size:
            raise ValueError(f"PagedCache holds {len(self._rows)} rows but the forward has {batch_size}; "
                             "call cache.reset() before reusing it for another batch")
        else:
            leaders = list(range(batch_size))
            self._release_finished(input_ids, new_real, q_len)
        counts = new_real.sum(1).tolist()
        self._reserve(counts, leaders, first_step)

        writes = new_real.clone()
        copies: list[tuple[int, int]] = []
        slots: list[int] = []
        kv_before = []
        alloc = self.allocator
        for row, seq_id in enumerate(self._rows):
            kv_before.append(alloc.tables[seq_id].num_tokens)
            if leaders[row] == row:
                slots.extend(alloc.append(seq_id, counts[row], copies))
            else:   # a duplicate prompt row shares its leader's blocks; nothing of its own is written
                alloc.fork(self._rows[leaders[row]], seq_id)
                writes[row] = False
        self.copy_blocks(copies)
        self._columns += q_len
        self._written.append(new_real)
        # Finished rows (decode only) are left out of the forward: the hooks run it on the others.
        active = [r for r, done in enumerate(self._finished) if not done] if q_len == 1 and compact else []
        self.active_rows = torch.tensor(active) if 0 < len(active) < batch_size else None
        rows = active if self.active_rows is not None else range(batch_size)
        tables = [alloc.tables[self._rows[r]] for r in rows]
        if self.active_rows is not None:
            new_real, writes = new_real[self.active_rows], writes[self.active_rows]
            kv_before = [kv_before[r] for r in rows]
        plan = build_plan(tables, new_real, writes, kv_before, slots, self._device, self.backend)
        self._plan = plan
        return plan

    def _new_real_columns(self, attention_mask, batch_size: int, q_len: int) -> torch.Tensor:
        if attention_mask is None:
            return torch.ones(batch_size, q_len, dtype=torch.bool)
        if attention_mask.dim() != 2:
            raise ValueError(f"PagedCache needs the 2D padding mask [batch, columns]; got shape "
                             f"{tuple(attention_mask.shape)}. Pass the tokenizer's attention_mask, not a 4D mask.")
        expected = self._columns + q_len
        if attention_mask.shape[1] != expected:
            raise ValueError(f"attention_mask has {attention_mask.shape[1]} columns but the cache has seen "
                             f"{self._columns} and this forward adds {q_len} (expected {expected}). Pass the "
                             "mask of the whole sequence, as generate does, or cache.reset() for a new batch.")
        return attention_mask[:, self._columns:].to("cpu", torch.bool).clone()

    def _release_finished(self, input_ids, new_real: torch.Tensor, q_len: int) -> None:
        """A row whose decode input is an EOS token has finished: its blocks go back to the pool."""
        if q_len == 1 and self.release_finished_rows and self.eos_token_ids and input_ids is not None:
            inputs = input_ids[:, 0].tolist()
            for row, token in enumerate(inputs):
                if not self._finished[row] and token in self.eos_token_ids:
                    self._finished[row] = True
                    self.allocator.truncate(self._rows[row], 0)
        for row, done in enumerate(self._finished):
            if done:
                new_real[row] = False

    def _reserve(self, counts: list[int], leaders: list[int], first_step: bool) -> None:
        """Check (and grow) the pool for this step before anything changes."""
        alloc = self.allocator
        if first_step:
            needed = sum(-(-counts[r] // self.block_size) for r in range(len(counts)) if leaders[r] == r)
            longest = max(counts, default=0)
        else:
            needed = sum(alloc.blocks_needed(s, n) for s, n in zip(self._rows, counts))
            longest = max((alloc.tables[s].num_tokens + n for s, n in zip(self._rows, counts)), default=0)
        if not self.growable and -(-longest // self.block_size) > alloc.num_blocks:
            raise PoolExhaustedError(
                -(-longest // self.block_size), alloc.num_free, alloc.num_blocks, self.block_size,
                f"One sequence of {longest} tokens alone needs more than the whole pool. Raise "
                "num_blocks / max_memory_bytes, or leave both unset so the pool grows on demand.")
        self._make_room(needed)
        if first_step:
            self._rows = [self._new_seq_id() for _ in counts]
            self._finished = [False] * len(counts)

    # ------------------------------------------------------------ Cache contract
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's K/V ([B, Hkv, Q, D]) into the planned slots; return the layer's pools."""
        if self._plan is None:
            raise RuntimeError(
                "PagedCache.update was called without a step plan: the model is not patched. Call "
                "hf_paged.patch(model) (or use `with hf_paged.enabled():`) before generating with a PagedCache.")
        return self.write(layer_idx, key_states, value_states, self._plan.slot_mapping)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._columns

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._columns + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._columns

    @property
    def batch_size(self) -> int:
        return len(self._rows) or -1

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        return self.allocator is not None

    def activate_past_recording(self) -> None:
        """Every stored token is kept until crop/reset, so rollback needs nothing extra."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues row ``beam_idx[i]``, by block-table forks (no KV copied)."""
        order = beam_idx.tolist()
        alloc, old = self.allocator, self._rows
        if alloc is None or order == list(range(len(old))):
            return
        new_rows = []
        for row, src in enumerate(order):
            if src == row:
                new_rows.append(old[row])
            else:
                seq_id = self._new_seq_id()
                alloc.fork(old[src], seq_id)
                new_rows.append(seq_id)
        for row, src in enumerate(order):
            if src != row:
                alloc.free(old[row])
        self._rows = new_rows
        self._finished = [self._finished[src] for src in order]
        self._written = [torch.cat(self._written, dim=1).index_select(0, torch.tensor(order))]

    def crop(self, max_length: int) -> None:
        """Drop columns: ``crop(-n)`` removes the last n; ``crop(0)`` keeps all (transformers 5.2x);
        ``crop(n)`` with n > 0 keeps the first n (the older absolute-length form)."""
        keep = self._columns + max_length if max_length <= 0 else min(max_length, self._columns)
        if keep >= self._columns:
            return
        written = torch.cat(self._written, dim=1)[:, :keep]
        kept_tokens = written.sum(1).tolist()
        for seq_id, tokens in zip(self._rows, kept_tokens):
            self.allocator.truncate(seq_id, tokens)
        self._written = [written]
        self._columns = keep
        self._plan = None

    def reset(self) -> None:
        """Forget every row; the pool keeps its memory for the next batch."""
        if self.allocator is not None:
            self.allocator.reset()
        self._clear_rows()

    # ------------------------------------------------------------ stats
    def stats(self) -> dict[str, int]:
        """Pool occupancy. Used bytes count each stored token once (shared blocks once)."""
        bs, per_token = self.block_size, self.bytes_per_token
        alloc = self.allocator
        if alloc is None:
            return dict(blocks_total=0, blocks_used=0, block_size=bs, tokens_stored=0, kv_bytes_reserved=0,
                        kv_bytes_used=0, peak_blocks_used=0, peak_kv_bytes_reserved=0, bytes_per_token=per_token,
                        kv_bytes_allocated=0)
        filled: dict[int, int] = {}
        for table in alloc.tables.values():
            for i, block in enumerate(table.blocks):
                filled[block] = max(filled.get(block, 0), min(bs, table.num_tokens - i * bs))
        tokens = sum(filled.values())
        return dict(
            blocks_total=alloc.num_blocks, blocks_used=alloc.num_used, block_size=bs, tokens_stored=tokens,
            kv_bytes_reserved=alloc.num_used * bs * per_token, kv_bytes_used=tokens * per_token,
            peak_blocks_used=alloc.peak_used, peak_kv_bytes_reserved=alloc.peak_used * bs * per_token,
            bytes_per_token=per_token, kv_bytes_allocated=alloc.num_blocks * bs * per_token,
        )

    def __repr__(self) -> str:
        s = self.stats()
        return (f"PagedCache(rows={len(self._rows)}, columns={self._columns}, block_size={self.block_size}, "
                f"blocks_used={s['blocks_used']}/{s['blocks_total']})")


def _duplicate_leaders(input_ids, attention_mask, batch_size: int) -> list[int]:
    """At the first prefill, rows equal to the row before them (``repeat_interleave``d prompts for
    beams or num_return_sequences) share that row's blocks. Returns each row's leader row."""
    leaders = list(range(batch_size))
    if input_ids is None or batch_size < 2:
        return leaders
    same = (input_ids[1:] == input_ids[:-1]).all(1)
    if attention_mask is not None:
        same &= (attention_mask[1:] == attention_mask[:-1]).all(1)
    for row, dup in enumerate(same.tolist(), start=1):
        if dup:
            leaders[row] = leaders[row - 1]
    return leaders
