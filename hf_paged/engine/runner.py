"""Model runner: one packed forward per step through the paged KV pool.

All scheduled tokens of all sequences go in as one row, ``input_ids [1, N]`` with each token's own
``position_ids [1, N]``, so the linear layers never see padding. ``EngineCache`` holds the pools; the
runner builds the step's ``StepPlan`` (``plan.packed_plan``) and prepares it on the cache, whose
``update`` writes the new K/V of [1, Hkv, N, D] through the plan's ``slot_mapping [N]`` and hands the
step to the attention function. Only the rows that sample (a sequence's last scheduled token when it
reaches the end of its tokens) reach the LM head.
"""
from __future__ import annotations

import time

import torch

from ..attention_interface import cache_keyword
from ..cache import KVPools
from ..plan import packed_plan


class EngineCache(KVPools):
    """The engine's KV pools (``[Hkv, num_blocks, block_size, D]`` per layer, keys and values).

    Not a PagedCache: the generate pre-hook leaves it alone; the runner prepares the plan of each forward.
    """

    no_step_message = "EngineCache.update ran outside ModelRunner.execute (no step was planned)"

    def __init__(self, config, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 geometry=None, kv_format=None, open_slots: int = 8):
        super().__init__(config, geometry=geometry, kv_format=kv_format)
        self.block_size = block_size
        self.open_slots = open_slots        # kivi: one open slot and sink per running sequence
        self.allocate_pools(num_blocks, block_size, dtype, device)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    is_initialized = True


class ModelRunner:
    """Builds the packed inputs and plan for a scheduled batch and runs the model once."""

    def __init__(self, model, cache: EngineCache):
        self.model, self.cache = model, cache
        self.device = cache.key_pools[0].device
        self.cache_kw = cache_keyword(model)
        self.graphs = None          # a graphs.DecodeGraphs when decode steps run on static buffers

    def prepare(self, batch: list[tuple[object, int]]):
        """batch: (sequence, number of its tokens to compute), decode entries (1 token) first.

        Returns (input_ids [1, N], position_ids [1, N], the step's plan, keep [K]: packed indices whose
        logits the LM head makes — each sampling sequence's last token, then the prompt positions whose
        log-probabilities are asked —, sampling sequences, prompt spans (sequence, first prompt position,
        count), in the order of their rows after the samplers').
        """
        ids, sample_at, samplers, prompt_at, spans = [], [], [], [], []
        for seq, n in batch:
            c = seq.num_computed
            start = len(ids)
            ids.extend(seq.token_ids[c:c + n])
            if c + n == seq.num_tokens:
                sample_at.append(len(ids) - 1)
                samplers.append(seq)
            span = prompt_span(seq, c, n)
            if span:
                first, count = span
                prompt_at.extend(range(start + first - c, start + first - c + count))
                spans.append((seq, first, count))
        plan = packed_plan([(seq.block_table, seq.num_computed, n) for seq, n in batch], self.cache.block_size,
                           self.device)

        def t(x):
            return torch.as_tensor(x, dtype=torch.long).to(self.device, non_blocking=True)

        # a token's position id is its stored index: the plan's token_pos
        return t(ids).view(1, -1), plan.token_pos.view(1, -1).long(), plan, t(sample_at + prompt_at), samplers, spans

    @torch.inference_mode()
    def execute(self, batch: list[tuple[object, int]]) -> tuple[torch.Tensor, list, list, float]:
        """Run one packed forward. Returns (float32 logits [K, V]: the sampling sequences' rows, then the
        asked prompt positions', those sequences, the prompt spans, seconds spent building the inputs
        and the plan)."""
        start = time.perf_counter()
        graphs = self.graphs
        if graphs is not None and graphs.eligible(batch) and not any(prompt_span(s, s.num_computed, 1) for s, _ in batch):
            logits = graphs.execute(batch)
            if logits is not None:          # None: capture failed just now, graphs are off; run eagerly
                return logits, [seq for seq, _ in batch], [], 0.0
        input_ids, position_ids, plan, keep, samplers, spans = self.prepare(batch)
        prepare_s = time.perf_counter() - start
        return self.forward(input_ids, position_ids, plan, keep).float(), samplers, spans, prepare_s

    def forward(self, input_ids, position_ids, plan, keep) -> torch.Tensor:
        """The model once on a planned step: logits [K, V] (the model's dtype) of the ``keep`` rows."""
        self.cache.prepare(plan)
        try:
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=True,
                             logits_to_keep=keep, **{self.cache_kw: self.cache})
        finally:
            self.cache.end_step()
        return out.logits[0]


def prompt_span(seq, computed: int, n: int) -> tuple[int, int] | None:
    """(first position, count) of the positions in ``[computed, computed + n)`` whose logits give prompt
    log-probabilities still missing for ``seq``'s request (position p scores prompt token p + 1), or None.
    Only sequence 0 computes its request's prompt."""
    request = seq.request
    if seq.index != 0 or not request.needs_prompt_logprobs:
        return None
    first = max(computed, len(request.prompt_logprobs) - 1)
    end = min(computed + n, len(request.prompt) - 1)
    return (first, end - first) if end > first else None
