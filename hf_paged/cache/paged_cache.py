"""PagedCache: a ``transformers.Cache`` whose K/V live in a pool of fixed-size blocks.

How a forward flows through it
------------------------------
1. A forward pre-hook on the decoder (installed by ``hf_paged.patch``) calls ``begin_forward`` with the
   decoder's inputs once per forward: rows get slots for their *real* new tokens only (``plan_step``,
   from the 2D padding mask), shared partly-filled blocks are copied (copy-on-write), the plan is bound
   to the backend once, and finished rows are left out of the inputs (``active_rows``).
2. Each layer's ``update`` writes its new K/V into the planned slots and returns the layer's pools bound
   to the step; the registered attention function (``attention_interface.paged_attention``) reads K/V
   through it.
3. A forward hook calls ``end_forward``: the step ends, and the hidden states of a forward that left
   finished rows out are put back into the full batch.

Lengths: transformers sees the *logical* length (columns, pads included) from ``get_seq_length``;
the pool stores only real tokens, so a row's stored index of a token equals its position id.

Pool size: ``num_blocks`` or ``max_memory_bytes`` fixes it (exhaustion raises PoolExhaustedError and
changes nothing); with neither, the pool grows on demand: it starts at what the first step stores
(identical rows once) plus one block per row, and each growth adds half the current size or what
the step needs, whichever is more (each growth copies the pools once, like DynamicCache's concatenation).
"""
from __future__ import annotations

import copy

import torch

from ..backends import Step
from ..blocks import BlockPool, PoolExhaustedError, blocks_for_budget
from ..families import KVGeometry
from ..kv_formats import default_block_size, kv_format
from ..plan import padded_plan
from .active_rows import ActiveRows
from .pools import KVPools
from .rows import RowBook, duplicate_leaders


class PagedCache(KVPools):
    """Paged KV cache for the models of hf_paged.families (llama, qwen2, qwen3, glm, glm4 and their relatives).

    Args:
        config: the model's config (its KV geometry and sliding windows are read from it).
        block_size: tokens per block (1..1024; by default 16, as in vLLM, or 32 for kv_cache_dtype="kivi").
        num_blocks: fixed pool size in blocks.
        max_memory_bytes: fixed pool size as a KV byte budget (over all layers, keys and values).
        release_finished_rows: once a row's decode input is an EOS token generate sampled (the generate
            hook sets the EOS ids and reports each step's sampled tokens: ``note_generated``), store it,
            then leave the row out of later forwards (its logits are zeros from then on) and let the
            pool reclaim its blocks when it needs them; a continuation of this cache takes them back. An
            EOS inside a prompt (a 1-token prefill chunk) finishes nothing. Not on a model whose RoPE follows
            each forward's longest position (dynamic NTK, longrope): its rows stay in the forwards.
        dtype, device: pool dtype/device; by default those of the model on the first forward.
        backend: attention backend object (see ``hf_paged.backends``); by default chosen by device.
        geometry: the KV heads/layers this process holds (``hf_paged.model_geometry(model)``); by default the
            config's. Needed for a tensor-parallel model, whose ranks hold a share of the KV heads; the
            patched generate passes it.
        kv_cache_dtype: how blocks store K/V: "auto" (the model's dtype), "fp8" (= "fp8_e4m3"), "fp8_e5m2",
            "int8" or "int4" (``hf_paged.kv_formats``); quantised blocks carry their scales and are
            dequantised inside attention. Outputs then differ from the default path within the format's
            quality bounds (README, "Quantised KV").
    """

    def __init__(self, config, *, block_size: int | None = None, num_blocks: int | None = None,
                 max_memory_bytes: int | None = None, release_finished_rows: bool = True,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 backend=None, geometry: KVGeometry | None = None, kv_cache_dtype: str = "auto"):
        super().__init__(config, backend, geometry, kv_format(kv_cache_dtype))
        self.kv_cache_dtype = "auto" if self.kv_format is None else self.kv_format.name
        if block_size is None:
            block_size = default_block_size(kv_cache_dtype)
        if not isinstance(block_size, int) or not 1 <= block_size <= 1024:
            raise ValueError(f"block_size must be an int in 1..1024, got {block_size!r}")
        if hasattr(self.kv_format, "check_block_size"):     # kivi: its fixed block, refused now, not at the pools
            self.kv_format.check_block_size(block_size)
        if num_blocks is not None and max_memory_bytes is not None:
            raise ValueError("pass num_blocks or max_memory_bytes, not both")
        if num_blocks is not None and (not isinstance(num_blocks, int) or num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if max_memory_bytes is not None and max_memory_bytes <= 0:
            raise ValueError(f"max_memory_bytes must be positive, got {max_memory_bytes!r}")
        self._device = torch.device(device) if device is not None else None
        if self._device is not None and self._device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"PagedCache(device={str(device)!r}) but torch sees no CUDA device (torch "
                             f"{torch.__version__}, built {'with' if torch.backends.cuda.is_built() else 'without'} "
                             "CUDA). Use device='cpu', or leave device unset to follow the model.")
        self.block_size = block_size
        self.release_finished_rows = release_finished_rows
        self.eos_token_ids: frozenset[int] = frozenset()
        self._sampled = None        # each row's last token generate sampled in this call (a tensor [B] or list)
        self._fixed_blocks = num_blocks
        self._budget = max_memory_bytes
        self._dtype = dtype
        if max_memory_bytes is not None and dtype is not None:
            self._blocks_for_budget()            # fail early on a budget below one block
        self.pool: BlockPool | None = None
        self.rows: RowBook | None = None
        self._step_columns = 0      # columns the planned, still running forward adds (see get_seq_length)
        self._new_call = False
        self.active_rows: ActiveRows | None = None   # rows this forward computes, None = all
        # prefix caching across generate calls (hf_paged.cache.prefix_store): the store this cache's
        # prompts are committed to, with each row's prompt tokens; and what its hits saved
        self.prefix_source: tuple | None = None
        self.prefix_stats = dict(hits=0, hit_tokens=0, query_tokens=0)

    # ------------------------------------------------------------ geometry and pool
    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes over all layers (keys and values, scales included)."""
        return self.geometry.bytes_per_token(self._dtype or torch.float32, self.kv_format)

    def _blocks_for_budget(self) -> int:
        return blocks_for_budget(self._budget, self.bytes_per_token, self.block_size, "max_memory_bytes")

    @property
    def growable(self) -> bool:
        return self._fixed_blocks is None and self._budget is None

    def _ensure_pools(self, dtype: torch.dtype, device: torch.device, first_need: int) -> None:
        if self.pool is not None:
            return
        self._dtype = self._dtype or dtype
        self._device = self._device or device
        if self._fixed_blocks is not None:
            blocks = self._fixed_blocks
        elif self._budget is not None:
            blocks = self._blocks_for_budget()
        else:
            blocks = max(1, first_need)
        self.pool = BlockPool(blocks, self.block_size)
        self.pool.free_listeners.append(self.release_blocks)      # kivi's open slots (hf_paged.kivi)
        self.rows = RowBook(self.pool)
        self.allocate_pools(blocks, self.block_size, self._dtype, self._device)

    def _make_room(self, needed: int) -> None:
        pool = self.pool
        if needed <= pool.num_free:
            return
        if not self.growable:
            raise PoolExhaustedError(needed, pool.num_free, pool.num_blocks, self.block_size)
        extra = max(needed - pool.num_free, pool.num_blocks // 2)
        pool.grow(extra)
        self.grow_pools(extra)

    def begin_generate(self, eos_token_ids: frozenset[int]) -> None:
        """Called by the generate hook before each generate call: rows whose decode input is one of
        ``eos_token_ids``, sampled by generate (``note_generated``), are released; finished rows of an
        earlier call are resumed at the first forward."""
        self.eos_token_ids = eos_token_ids
        self._sampled = None
        self._new_call = True

    def note_generated(self, tokens) -> None:
        """The tokens generate just appended, one per row (a finished row's pad): the next forward's inputs.
        Only such a token ends a row (``release_finished_rows``), never one of the prompt. ``tokens``: a tensor
        [B] on any device (kept as it is: read with the next forward's inputs, one host sync for both) or a list."""
        self._sampled = tokens

    # ------------------------------------------------------------ one forward
    def begin_forward(self, kwargs: dict, dtype: torch.dtype, device: torch.device, compact: bool = True) -> dict:
        """Plan the decoder forward whose keyword inputs are ``kwargs``; returns the inputs it should run
        with. ``compact``: finished rows may be left out of a decode forward (their logits are zeros
        either way; only per-layer outputs such as hidden states would lose those rows)."""
        input_ids = kwargs.get("input_ids")
        reference = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        if reference is None:
            raise ValueError("hf_paged needs input_ids or inputs_embeds to plan a step")
        batch, q_len = reference.shape[:2]
        self.plan_step(kwargs.get("attention_mask"), input_ids, batch, q_len, dtype, device, compact=compact)
        return kwargs if self.active_rows is None else self.active_rows.select(kwargs)

    def end_forward(self, output):
        """The forward is over: its step ends (a prefill's full prompt blocks go to the prefix store, when
        there is one); with rows left out, the output gets back the full batch."""
        if self.prefix_source is not None and self._step_columns > 1:
            store, prompts = self.prefix_source
            store.commit(self, prompts)
        self.end_step()
        active, self.active_rows = self.active_rows, None
        return output if active is None else active.expand(output)

    def plan_step(self, attention_mask: torch.Tensor | None, input_ids: torch.Tensor | None,
                  batch_size: int, q_len: int, dtype: torch.dtype, device: torch.device,
                  compact: bool = False) -> Step:
        """Reserve slots for this forward's real tokens; return the plan bound to the backend.

        attention_mask: the 2D padding mask [B, columns_before + Q] (or None: all real).
        compact: the forward runs on ``self.active_rows`` only (finished rows left out, see
            ``begin_forward``); the plan then covers those rows. Without it every row is planned (finished
            ones read nothing).
        When this raises (pool exhausted, bad shapes, a continuation that cannot be served) nothing changes,
        except that finished rows a new call has already taken back stay live (a retry finds them so).
        """
        new_real = self._new_real_columns(attention_mask, batch_size, q_len)
        first_step = self.rows is None or len(self.rows) == 0
        leaders = duplicate_leaders(input_ids, attention_mask, batch_size) if first_step else list(range(batch_size))
        if first_step:
            counts = new_real.sum(1).tolist()
            self._ensure_pools(dtype, device, sum(-(-counts[r] // self.block_size) for r in range(batch_size)
                                                  if leaders[r] == r) + batch_size)
        else:
            self._check_rows(batch_size, attention_mask, q_len)
        self._new_call = False
        finishing = self._finishing_rows(input_ids, q_len) if not first_step else []
        new_real[torch.tensor(self.rows.finished if not first_step else [False] * batch_size)] = False
        counts = new_real.sum(1).tolist()
        self._reserve(counts, leaders, first_step)
        writes, slots, kv_before = self._append(new_real, counts, leaders)
        rows = self.rows
        rows.columns += q_len
        rows.written.append(new_real)
        # Finished rows (decode only) are left out of the forward: begin_forward runs it on the others.
        active = [r for r, done in enumerate(rows.finished) if not done] if q_len == 1 and compact else []
        self.active_rows = ActiveRows(active, batch_size) if 0 < len(active) < batch_size else None
        if self.active_rows is not None:
            new_real, writes = new_real[self.active_rows.index], writes[self.active_rows.index]
            kv_before = [kv_before[r] for r in active]
        planned = active if self.active_rows is not None else range(batch_size)
        plan = padded_plan([rows.tables[r] for r in planned], new_real, writes, kv_before, slots, self.block_size,
                           self._device)
        for row in finishing:      # their EOS is written by this forward; the blocks stay kept until needed
            rows.finish(row, rows.columns)
        self._step_columns = q_len
        return self.prepare(plan)

    def end_step(self) -> None:
        """The forward is over: its plan may not be used again."""
        super().end_step()
        self._step_columns = 0

    def adopt_prefix(self, row_blocks: list[list], row_tokens: list[int], columns: int, expand: int,
                     written: torch.Tensor) -> dict:
        """Start this fresh cache with its first ``columns`` columns stored: prompt row r's first
        ``row_tokens[r]`` real tokens in the blocks ``row_blocks[r]`` names (by keys of the caller's: equal
        keys are one block, shared), for each of the ``expand`` rows generate makes of it. written: bool
        [B, columns], the real columns of each prompt row. Returns key -> the block of this cache's pool
        that the caller fills with that block's K/V (every layer) before the first forward."""
        if self.rows is not None and len(self.rows):
            raise RuntimeError("adopt_prefix: the cache already holds rows; call cache.reset() first")
        keys = sorted({k for blocks in row_blocks for k in blocks})
        batch = len(row_blocks) * expand
        self._ensure_pools(self._dtype, self._device, len(keys) + batch)
        self._make_room(len(keys))
        placed = {key: self.pool.take() for key in keys}
        self.rows.start(batch)
        for row, table in enumerate(self.rows.tables):
            blocks, tokens = row_blocks[row // expand], row_tokens[row // expand]
            for key in blocks:
                self.pool.hold(placed[key])
            table.blocks, table.num_tokens = [placed[k] for k in blocks], tokens
        self.pool.release(list(placed.values()))          # the rows hold them now
        self.rows.columns = columns
        self.rows.written = [written.repeat_interleave(expand, 0)]
        return placed

    no_step_message = ("PagedCache.update was called without a step plan: the model is not patched (or was "
                       "unpatched while this call ran). Call hf_paged.patch(model) (or use `with "
                       "hf_paged.enabled():`) before generating with a PagedCache, and unpatch only once its "
                       "calls are over.")

    def _check_rows(self, batch_size: int, attention_mask, q_len: int) -> None:
        """A later forward of this cache: the same rows, and finished rows resumed when a new call (or a
        multi-token forward) continues them."""
        rows = self.rows
        if len(rows) != batch_size:
            raise ValueError(f"PagedCache holds {len(rows)} rows but the forward has {batch_size}; "
                             "call cache.reset() before reusing it for another batch")
        if self._new_call and attention_mask is not None:
            self._check_stored_columns(attention_mask)
        if any(rows.finished) and (self._new_call or q_len > 1):
            self._resume_finished(attention_mask)

    def _check_stored_columns(self, attention_mask) -> None:
        """A new call's mask must mark real exactly the earlier columns each row stored: the cache cannot
        unstore a token (a pad stored as real, later masked) nor compute one it skipped (a masked column
        later marked real). The columns a finished row skipped are ``check_resumable``'s."""
        rows = self.rows
        stored = torch.cat(rows.written, dim=1) if rows.written else torch.zeros(len(rows), 0, dtype=torch.bool)
        marked = attention_mask[:, :stored.shape[1]].to("cpu", torch.bool)
        dropped = False
        for row in range(len(rows)):
            end = rows.finish_column[row] if rows.finished[row] else stored.shape[1]
            differ = (stored[row, :end] != marked[row, :end]).nonzero().flatten().tolist()
            if not differ:
                continue
            column = differ[0]
            if stored[row, column] and not bool(marked[row, column:end].any()):
                # the row's stored tail is masked now (a pad == EOS mask, `ids != pad`, hides the EOS it
                # stored): drop it, as the mask hides it from the default path's attention and positions
                self._drop_stored_tail(row, column, stored)
                dropped = True
                continue
            if stored[row, column]:
                raise ValueError(
                    f"row {row}: column {column} was stored as a real token by an earlier call (its mask marked "
                    f"it), but this call's attention_mask masks it; a PagedCache cannot drop a stored token. "
                    f"Pass the earlier call's mask for those columns, or generate the earlier call with "
                    f"release_finished_rows=True (the default), which never stores the pads after a row's EOS.")
            raise ValueError(
                f"row {row}: column {column} was masked in an earlier call, so the cache never computed it, but "
                f"this call's attention_mask marks it as a real token. Pass the earlier call's mask for those "
                f"columns, or generate again without past_key_values.")
        if dropped:
            rows.written = [stored]

    def _drop_stored_tail(self, row: int, column: int, stored: torch.Tensor) -> None:
        """Row ``row`` keeps only the tokens it stored before ``column`` (``stored`` updated in place)."""
        rows = self.rows
        kept = int(stored[row, :column].sum())
        if rows.finished[row]:
            rows.truncate_parked(row, kept)
            rows.finish_column[row] = column
        else:
            rows.tables[row].truncate(self.pool, kept)
        stored[row, column:] = False

    def _append(self, new_real: torch.Tensor, counts: list[int], leaders: list[int]):
        """Give each row slots for its new tokens (copy-on-write applied). Returns (writes bool [B, Q],
        the written slots in row-major order, stored tokens per row before this step)."""
        rows, pool = self.rows, self.pool
        writes = new_real.clone()
        copies: list[tuple[int, int]] = []
        slots: list[int] = []
        kv_before = [t.num_tokens for t in rows.tables]
        for row, table in enumerate(rows.tables):
            if leaders[row] == row:
                slots.extend(table.append(pool, counts[row], copies))
            else:   # a duplicate prompt row shares its leader's blocks; nothing of its own is written
                rows.tables[row] = rows.tables[leaders[row]].fork(pool)
                writes[row] = False
        self.copy_blocks(copies)
        return writes, slots, kv_before

    def _new_real_columns(self, attention_mask, batch_size: int, q_len: int) -> torch.Tensor:
        if attention_mask is None:
            return torch.ones(batch_size, q_len, dtype=torch.bool)
        if attention_mask.dim() != 2:
            raise ValueError(f"PagedCache needs the 2D padding mask [batch, columns]; got shape "
                             f"{tuple(attention_mask.shape)}. Pass the tokenizer's attention_mask, not a 4D mask.")
        columns = self.rows.columns if self.rows is not None else 0
        expected = columns + q_len
        if attention_mask.shape[1] != expected:
            # generate continuing from a returned cache in a mode that feeds the prompt again from column 0
            # (assisted generation, prompt lookup; chunked prefill before transformers 5.24) passes the mask of
            # what this forward feeds, not of the sequence the cache would then hold
            refed = columns and attention_mask.shape[1] == q_len
            hint = (" This forward feeds columns the cache holds again: generate does that when it continues from "
                    "a returned cache with assistant_model / prompt_lookup_num_tokens, or with prefill_chunk_size "
                    "before transformers 5.24 (the default path then attends over those columns twice). Start such a "
                    "call from a fresh cache (no past_key_values).") if refed else ""
            raise ValueError(f"attention_mask has {attention_mask.shape[1]} columns but the cache has seen "
                             f"{columns} and this forward adds {q_len} (expected {expected}). Pass the "
                             f"mask of the whole sequence, as generate does, or cache.reset() for a new batch.{hint}")
        return attention_mask[:, columns:].to("cpu", torch.bool).clone()

    def _finishing_rows(self, input_ids, q_len: int) -> list[int]:
        """Rows whose decode input is an EOS token generate sampled: they store it and finish after this
        forward. (A 1-token forward also carries the last prompt token, or a 1-token prefill chunk: an EOS
        there is the prompt's, and the row goes on.)"""
        if q_len != 1 or not self.release_finished_rows or not self.eos_token_ids or input_ids is None \
                or self._sampled is None:
            return []
        inputs = input_ids[:, 0]
        sampled = torch.as_tensor(self._sampled, device=inputs.device).to(inputs.dtype)
        if sampled.shape != inputs.shape:
            return []
        tokens, generated = torch.stack([inputs, sampled]).tolist()      # the step's one read back to the host
        finished, eos = self.rows.finished, self.eos_token_ids
        return [row for row, (token, own) in enumerate(zip(tokens, generated))
                if not finished[row] and token in eos and token == own]

    def _resume_finished(self, attention_mask) -> None:
        """A new call continues rows that finished in an earlier one: take their blocks back, all or none."""
        rows = self.rows
        finished = [r for r, done in enumerate(rows.finished) if done]
        for row in finished:
            rows.check_resumable(row, attention_mask)
        for row in finished:
            rows.resume(row)

    def _reserve(self, counts: list[int], leaders: list[int], first_step: bool) -> None:
        """Check (and grow) the pool for this step before anything changes."""
        rows, pool, bs = self.rows, self.pool, self.block_size
        if first_step:
            needed = sum(-(-counts[r] // bs) for r in range(len(counts)) if leaders[r] == r)
            longest = max(counts, default=0)
        else:
            needed = sum(t.blocks_needed(pool, n) for t, n in zip(rows.tables, counts))
            longest = max((t.num_tokens + n for t, n in zip(rows.tables, counts)), default=0)
        if not self.growable and -(-longest // bs) > pool.num_blocks:
            raise PoolExhaustedError(
                -(-longest // bs), pool.num_free, pool.num_blocks, bs,
                f"One sequence of {longest} tokens alone needs more than the whole pool. Raise "
                "num_blocks / max_memory_bytes, or leave both unset so the pool grows on demand.", whole=True)
        self._make_room(needed)
        if first_step:
            rows.start(len(counts))

    # ------------------------------------------------------------ Cache contract
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns stored. While a planned forward runs, the columns *before* it, as DynamicCache answers
        before its update: a forward without ``cache_position`` derives its positions from this."""
        return self.rows.columns - self._step_columns if self.rows is not None else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length()

    @property
    def batch_size(self) -> int:
        return len(self.rows) if self.rows is not None and len(self.rows) else -1

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        return self.pool is not None

    def activate_past_recording(self) -> None:
        """Every stored token is kept until crop/reset, so rollback needs nothing extra."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues row ``beam_idx[i]``, by block-table forks (no KV copied)."""
        order = torch.as_tensor(beam_idx).tolist()
        if self.rows is None or order == list(range(len(self.rows))):
            return
        if any(not 0 <= src < len(self.rows) for src in order):
            raise IndexError(f"row indices {order} out of range for a cache of {len(self.rows)} rows")
        self.rows.reorder(order)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (ids or a bool mask), in that order, as DynamicCache does."""
        indices = torch.as_tensor(indices)
        self.reorder_cache(indices.nonzero().flatten() if indices.dtype == torch.bool else indices.flatten())

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row ``repeats`` times in a row, sharing its blocks (copied on write), as DynamicCache repeats it."""
        if self.rows is not None and len(self.rows):
            self.reorder_cache(torch.arange(len(self.rows)).repeat_interleave(repeats))

    def crop(self, max_length: int) -> None:
        """Drop columns: ``crop(-n)`` removes the last n (all of them past the length, as DynamicCache); ``crop(0)``
        keeps all (transformers 5.2x); ``crop(n)`` with n > 0 keeps the first n (the older absolute-length form)."""
        columns = self.get_seq_length()
        keep = max(0, columns + max_length) if max_length <= 0 else min(max_length, columns)
        if keep >= columns:
            return
        self.rows.crop(keep)
        self.end_step()

    def reset(self) -> None:
        """Forget every row; the pool keeps its memory for the next batch."""
        if self.rows is not None:
            self.rows.clear()
            self.pool.reset_peak()
        self.end_step()
        self.active_rows = None
        self.prefix_source = None

    def __reduce_ex__(self, protocol):
        raise TypeError("a PagedCache cannot be pickled (its pools and block tables are bound to this process's "
                        "kernels); copy.deepcopy makes an independent copy, or continue generating in this process")

    def __deepcopy__(self, memo):
        """The default deep copy (every attribute), spelled out since ``__reduce_ex__`` refuses pickling."""
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone

    def check_invariants(self) -> None:
        """Raise AssertionError if the block bookkeeping is inconsistent."""
        if self.rows is not None:
            self.rows.check_invariants()

    # ------------------------------------------------------------ stats
    def stats(self) -> dict[str, int]:
        """Pool occupancy. Used bytes count each stored token once (shared blocks once)."""
        bs, per_token = self.block_size, self.bytes_per_token
        pool = self.pool
        if pool is None:
            return dict(blocks_total=0, blocks_used=0, block_size=bs, tokens_stored=0, kv_bytes_reserved=0,
                        kv_bytes_used=0, peak_blocks_used=0, peak_kv_bytes_reserved=0, bytes_per_token=per_token,
                        kv_bytes_allocated=0, **self._prefix_counts())
        filled: dict[int, int] = {}
        for table in self.rows.tables:
            for i, block in enumerate(table.blocks):
                filled[block] = max(filled.get(block, 0), min(bs, table.num_tokens - i * bs))
        tokens = sum(filled.values())
        return dict(
            blocks_total=pool.num_blocks, blocks_used=pool.num_used, block_size=bs, tokens_stored=tokens,
            kv_bytes_reserved=pool.num_used * bs * per_token, kv_bytes_used=tokens * per_token,
            peak_blocks_used=pool.peak_used, peak_kv_bytes_reserved=pool.peak_used * bs * per_token,
            bytes_per_token=per_token,
            kv_bytes_allocated=pool.num_blocks * bs * per_token + self.open_bytes,   # KIVI's open slots + sinks
            **self._prefix_counts(),
        )

    def _prefix_counts(self) -> dict[str, int]:
        """Prefix caching across calls: rows that hit, their tokens not recomputed (prefill saved), and
        the prompt tokens looked up."""
        p = self.prefix_stats
        return dict(prefix_hits=p["hits"], prefix_hit_tokens=p["hit_tokens"], prefix_query_tokens=p["query_tokens"])

    def __repr__(self) -> str:
        s = self.stats()
        return (f"PagedCache(rows={max(self.batch_size, 0)}, columns={self.get_seq_length()}, "
                f"block_size={self.block_size}, blocks_used={s['blocks_used']}/{s['blocks_total']})")

