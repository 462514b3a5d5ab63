"""Model runner: one packed forward per step through the paged KV pool.

All scheduled tokens of all sequences go in as one row, ``input_ids [1, N]`` with each token's own
``position_ids [1, N]``, so the linear layers never see padding. ``EngineCache`` holds the pools and
writes the new K/V of [1, Hkv, N, D] through the plan's packed ``slot_mapping [N]``; the attention
function reads the ``PackedPlan`` passed in the forward's kwargs (``PLAN_KWARG``). Only the rows that
sample (a sequence's last scheduled token when it reaches the end of its tokens) reach the LM head.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from hf_paged.cache import PLAN_KWARG
from hf_paged.integrations.generate import cache_keyword

from ..plan import PackedPlan, StepPlan
from ..pools import KVPools


class EngineCache(KVPools):
    """The engine's KV pools (``[Hkv, num_blocks, block_size, D]`` per layer, keys and values).

    Not a PagedCache: the generate pre-hook leaves it alone; the runner sets the plan of each forward.
    """

    def __init__(self, config, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__(config)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.allocate_pools(num_blocks, block_size, dtype, device)
        self.plan: PackedPlan | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states [1, Hkv, N, D] -> written at ``plan.slot_mapping``; returns the layer's pools."""
        return self.write(layer_idx, key_states, value_states, self.plan.slot_mapping)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    is_initialized = True


def _tables(seqs, block_size: int, width_tokens: list[int]) -> np.ndarray:
    """int32 [B, W]: the blocks holding each sequence's first ``width_tokens[b]`` tokens (0-padded)."""
    width = max(1, max(-(-t // block_size) for t in width_tokens))
    tables = np.zeros((len(seqs), width), dtype=np.int32)
    for row, (seq, total) in enumerate(zip(seqs, width_tokens)):
        used = -(-total // block_size)
        tables[row, :used] = seq.block_table[:used]
    return tables


class ModelRunner:
    """Builds the packed inputs and plan for a scheduled batch and runs the model once."""

    def __init__(self, model, cache: EngineCache):
        self.model, self.cache = model, cache
        self.device = cache.key_pools[0].device
        self.cache_kw = cache_keyword(model)
        self.prepare_s = 0.0

    def prepare(self, batch: list[tuple[object, int]]):
        """batch: (sequence, number of its tokens to compute), decode entries (1 token) first.

        Returns (input_ids [1, N], position_ids [1, N], plan, sample_index [S]: packed index of each
        sampling sequence's last token, sampling sequences).
        """
        bs = self.cache.block_size
        ids, positions, slots, sample_at, samplers = [], [], [], [], []
        decode, extend = [], []
        for seq, n in batch:
            c = seq.num_computed
            table = seq.block_table
            for p in range(c, c + n):
                slots.append(table[p // bs] * bs + p % bs)
            ids.extend(seq.token_ids[c:c + n])
            positions.extend(range(c, c + n))
            if c + n == seq.num_tokens:
                sample_at.append(len(ids) - 1)
                samplers.append(seq)
            (decode if n == 1 else extend).append((seq, n))
        if decode and extend and batch[len(decode) - 1][1] != 1:
            raise ValueError("decode entries must come first in the batch")
        dev = self.device

        def t(x, dtype):
            return torch.as_tensor(x, dtype=dtype).to(dev, non_blocking=True)

        decode_plan = extend_plan = None
        if decode:
            seqs = [s for s, _ in decode]
            ctx = [s.num_computed + 1 for s in seqs]
            lens = t(ctx, torch.int32)
            decode_plan = StepPlan(slot_mapping=None, block_tables=t(_tables(seqs, bs, ctx), torch.int32),
                                   context_lens=lens, query_pos=(lens - 1).view(-1, 1), decode_lens=lens,
                                   max_context=max(ctx), backend=self.cache.backend)
        if extend:
            seqs = [s for s, _ in extend]
            q_len = max(n for _, n in extend)
            ctx = [s.num_computed + n for s, n in extend]
            query_pos = np.full((len(extend), q_len), -1, dtype=np.int32)
            index = []
            for row, (s, n) in enumerate(extend):
                query_pos[row, :n] = np.arange(s.num_computed, s.num_computed + n)
                index.extend(range(row * q_len, row * q_len + n))
            extend_plan = StepPlan(slot_mapping=None, block_tables=t(_tables(seqs, bs, ctx), torch.int32),
                                   context_lens=t(ctx, torch.int32), query_pos=t(query_pos, torch.int32),
                                   decode_lens=None, max_context=max(ctx), backend=self.cache.backend,
                                   packed_index=t(index, torch.int64))
        plan = PackedPlan(slot_mapping=t(slots, torch.int64), decode=decode_plan, extend=extend_plan,
                          num_decode=len(decode), backend=self.cache.backend)
        return t(ids, torch.long).view(1, -1), t(positions, torch.long).view(1, -1), plan, \
            t(sample_at, torch.long), samplers

    @torch.inference_mode()
    def execute(self, batch: list[tuple[object, int]]) -> tuple[torch.Tensor, list]:
        """Run one packed forward. Returns (float32 logits [S, V] of the sampling sequences, those sequences).
        ``prepare_s`` accumulates the host time spent building inputs and plans."""
        start = time.perf_counter()
        input_ids, position_ids, plan, sample_at, samplers = self.prepare(batch)
        self.prepare_s += time.perf_counter() - start
        self.cache.plan = plan
        try:
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=True,
                             logits_to_keep=sample_at, **{self.cache_kw: self.cache, PLAN_KWARG: plan})
        finally:
            self.cache.plan = None
        return out.logits[0].float(), samplers
