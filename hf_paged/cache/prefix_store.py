"""Prefix caching across ``generate`` calls: a model's store of full prompt blocks, kept between calls.

The store is a block pool of its own (``prefix_cache_bytes`` of K/V, allocated once) whose blocks are
full blocks of earlier prompts, identified by a chained hash of their tokens (``blocks.PrefixCache``,
every hit checked against the stored tokens) and evicted least recently used. Each paged ``generate``
call still runs on its own PagedCache; the store meets it twice:

* before the call, :meth:`PrefixStore.attach` matches each row's real prompt tokens (pads excluded)
  block by block and gives the cache the batch's common cached column count C: the cache then holds
  columns ``[0, C)`` of every row (the hit blocks copied in once, shared by the rows that hit them), so
  transformers' generate, which asks the cache for its length, feeds only the columns after C (its own
  continuation logic). Each row's last prompt token is always computed: its logits start generation;
* after each multi-token forward (prefill and its chunks), :meth:`PrefixStore.commit` copies the full
  blocks of prompt tokens that the store lacks out of the cache.

So the store never holds more than its budget whatever a call needs, and a call's own pool grows as it
always does. A hit reuses K/V computed in another batch: in fp32 outputs can change only through a
near-tie at float noise; in half precision a near-tie can flip (README, "Prefix caching").
"""
from __future__ import annotations

import threading

import torch

from ..blocks import BlockPool, BlockTable, PrefixCache, blocks_for_budget
from ..kivi import KIVI, aligned_hit
from .pools import KVPools

DEFAULT_PREFIX_CACHE_BYTES = 256 * 2**20


class PrefixStore(KVPools):
    """Full prompt blocks kept across the generate calls of one model.

    budget_bytes: K/V bytes over all layers, keys and values (``hf_paged.patch(...,
    prefix_cache_bytes=...)``); the pools are allocated on first use, with the first cache's dtype and
    device. A cache with another block size, KV format, geometry, dtype or device is not served.
    """

    def __init__(self, config, geometry, kv_format, block_size: int, budget_bytes: int, dtype: torch.dtype):
        super().__init__(config, None, geometry, kv_format)
        self.block_size, self.budget_bytes = block_size, budget_bytes
        per_token = self.geometry.bytes_per_token(dtype, kv_format)
        if kv_format is KIVI:       # each block may hold a sequence's position 0: one model-dtype sink row
            per_token += -(-self.geometry.bytes_per_token(dtype) // block_size)
        self.num_blocks = blocks_for_budget(budget_bytes, per_token, block_size, "prefix_cache_bytes")
        self.open_slots, self.sink_slots = 0, self.num_blocks      # kivi: full blocks only, never open
        self.pool = BlockPool(self.num_blocks, block_size)
        self.pool.free_listeners.append(self.release_blocks)      # kivi's open slots (hf_paged.kivi)
        self.index = PrefixCache(self.pool)
        self.dtype, self.device = dtype, None
        self.lock = threading.Lock()      # concurrent generate calls of one patched model share the store

    def serves(self, cache) -> bool:
        """Whether ``cache`` stores K/V exactly as this store does."""
        return (cache.block_size == self.block_size and cache.kv_format == self.kv_format
                and cache.geometry == self.geometry and cache._dtype == self.dtype
                and (self.device is None or cache._device == self.device))

    # ------------------------------------------------------------ before a call
    def attach(self, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, expand: int) -> int:
        """Give the fresh ``cache`` the columns its batch has cached; returns that column count C (0: none).

        input_ids / attention_mask: the call's prompt [B, W], left-padded (another layout is not served);
        expand: the rows generate makes of each prompt row (beams or ``num_return_sequences``), which
        share the copied blocks. The cache keeps each row's prompt tokens for :meth:`commit`.
        """
        prompts = left_padded_prompts(input_ids, attention_mask)
        if prompts is None or not self.serves(cache):
            return 0
        with self.lock:
            return self._attach(cache, prompts, input_ids, attention_mask, expand)

    def _attach(self, cache, prompts, input_ids, attention_mask, expand: int) -> int:
        cache.prefix_source = (self, [tokens for _, tokens in prompts for _ in range(expand)])
        hits = [self.index.match(tokens, len(tokens) - 1)[0] for _, tokens in prompts]
        common = min(pad + len(blocks) * self.block_size for (pad, _), blocks in zip(prompts, hits))
        if self.kv_format is KIVI:          # each row's hit ends on a block boundary (kivi.aligned_hit)
            common = aligned_hit(common, [pad for pad, _ in prompts], self.block_size)
        cache.prefix_stats["query_tokens"] += sum(len(t) for _, t in prompts) * expand
        if common == 0 or not self.key_pools:
            return 0
        bs = self.block_size
        used = [blocks[:-(-(common - pad) // bs)] if common > pad else [] for (pad, _), blocks in zip(prompts, hits)]
        placed = cache.adopt_prefix(used, [max(0, common - pad) for pad, _ in prompts], common, expand,
                                    attention_mask_or_ones(input_ids, attention_mask)[:, :common])
        distinct = sorted(placed)
        copy_blocks_between(self, cache, distinct, [placed[b] for b in distinct])
        for block in distinct:                  # a hit is a use: back to the tail of the LRU order
            self.pool.hold(block)
        self.pool.release(distinct)
        cache.prefix_stats["hits"] += sum(common > pad for pad, _ in prompts) * expand
        cache.prefix_stats["hit_tokens"] += sum(max(0, common - pad) for pad, _ in prompts) * expand
        return common

    # ------------------------------------------------------------ after a prefill forward
    def commit(self, cache, prompts: list[list[int]]) -> None:
        """Copy into the store the full blocks of each live row's prompt tokens (``prompts[row]``) that
        the cache has stored and the store lacks, taking the least recently used blocks for them."""
        with self.lock:
            self._commit(cache, prompts)

    def _commit(self, cache, prompts: list[list[int]]) -> None:
        if len(prompts) != len(cache.rows):     # generate made other rows of the prompt than attach expected
            cache.prefix_source = None
            return
        if not self.key_pools:
            self.device = cache._device
            self.allocate_pools(self.num_blocks, self.block_size, self.dtype, cache._device)
        bs, held, sources, targets = self.block_size, [], [], []
        try:
            for row, tokens in enumerate(prompts):
                table = cache.rows.tables[row]
                full = min(table.num_tokens, len(tokens)) // bs
                if cache.rows.finished[row] or full == 0:
                    continue
                blocks, _ = self.index.match(tokens, full * bs)
                for block in blocks:                # held while this commit runs: nothing evicts them
                    self.pool.hold(block)
                held.extend(blocks)
                while len(blocks) < full and self.pool.num_free:
                    block = self.pool.take()
                    sources.append(table.blocks[len(blocks)])
                    targets.append(block)
                    blocks.append(block)
                    held.append(block)
                # published now, so that a later row with the same prompt (beams, samples) matches these
                # blocks instead of copying its own; their K/V are copied in below
                self.index.commit(BlockTable(list(blocks), len(blocks) * bs), tokens, [])
            copy_blocks_between(cache, self, sources, targets)
        except BaseException:
            # the new blocks' K/V may never have been copied in (an out-of-memory error, Ctrl-C): their hashes
            # go, so that the failure loses only the caching and no later call hits unfilled blocks
            for block in targets:
                self.index.evicted(block)
            raise
        finally:
            self.pool.release(held)

    def check_invariants(self) -> None:
        self.pool.check_invariants([])
        self.index.check_invariants()


def copy_blocks_between(src: KVPools, dst: KVPools, src_blocks: list[int], dst_blocks: list[int]) -> None:
    """Block ``dst_blocks[i]`` of ``dst``'s pools = block ``src_blocks[i]`` of ``src``'s, every layer's keys
    and values (codes and scales of quantised pools); both hold the same geometry and format."""
    if not src_blocks:
        return
    for source, target in zip(src.pool_tensors(), dst.pool_tensors()):
        rows = torch.tensor(src_blocks, dtype=torch.int64, device=source.device)
        picked = source.index_select(1, rows).to(target.device)
        target.index_copy_(1, torch.tensor(dst_blocks, dtype=torch.int64, device=target.device), picked)
    dst.copy_side_from(src, src_blocks, dst_blocks)     # kivi: sinks travel with their (full, sealed) blocks


def attention_mask_or_ones(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if attention_mask is None:
        return torch.ones(input_ids.shape, dtype=torch.bool)
    return attention_mask.to("cpu", torch.bool)


def left_padded_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    """Each row's (pad columns, real token ids) when every row is pads then real tokens, else None."""
    if input_ids is None or input_ids.dim() != 2:
        return None
    mask = attention_mask_or_ones(input_ids, attention_mask)
    if mask.shape != input_ids.shape:
        return None
    real = mask.sum(1)
    pads = mask.shape[1] - real
    columns = torch.arange(mask.shape[1])
    if not torch.equal(mask, columns.unsqueeze(0) >= pads.unsqueeze(1)) or bool((real == 0).any()):
        return None
    ids = input_ids.tolist()
    return [(int(p), row[int(p):]) for p, row in zip(pads, ids)]
