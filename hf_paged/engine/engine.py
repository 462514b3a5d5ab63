"""The engine: requests in, one packed forward per step, tokens out as they come.

    engine = Engine(model, tokenizer=None, **knobs)      # knobs: EngineConfig fields
    rid = engine.add_request(prompt_ids, max_new_tokens=32, do_sample=True, seed=0)
    while engine.has_work:
        for event in engine.step(): ...                  # TokenEvent(request_id, index, token, finished)
    engine.output(rid), engine.stats()

A step: schedule (running sequences first, then waiting ones; preempt the newest when blocks run
out), apply copy-on-write, run the model on the packed tokens, commit full blocks to the prefix
cache, sample the sequences that reached their last token, finish those that stop (their blocks go
back at once), fork the extra sequences of ``num_return_sequences`` requests.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, fields

import torch

from hf_paged.integrations.families import adapter_for

from ..attention import ATTENTION_NAME
from ..patching import use_paged_attention
from .block_manager import BlockManager
from .config import EngineConfig, kv_pool_blocks
from .request import CompletionOutput, Request, RequestOutput, SamplingParams, Sequence, Status
from ..pools import kv_bytes_per_token
from .runner import EngineCache, ModelRunner
from .sampler import sample
from .scheduler import Scheduler

log = logging.getLogger("hf_paged.engine")


class RequestTooLongError(ValueError):
    """A request that can never fit: prompt + max new tokens over the model's context or the whole pool."""


@dataclass(frozen=True)
class TokenEvent:
    """A new token of sequence ``index`` of request ``request_id``; ``finished`` names why it ended, if it did."""
    request_id: int
    index: int
    token: int
    finished: str | None


class Engine:
    """Continuous batching over a paged KV pool for one model of a supported family (see module doc)."""

    def __init__(self, model, tokenizer=None, **knobs):
        unknown = set(knobs) - {f.name for f in fields(EngineConfig)}
        if unknown:
            raise ValueError(f"unknown engine option(s) {sorted(unknown)}; known: "
                             f"{', '.join(f.name for f in fields(EngineConfig))}")
        self.config = config = EngineConfig(**knobs)
        config.validate()
        adapter_for(model.config)
        self.model, self.tokenizer = model, tokenizer
        text_config = model.config.get_text_config(decoder=True)
        self.max_model_len = config.max_model_len or getattr(text_config, "max_position_embeddings", None) or 2**31
        weight = model.get_input_embeddings().weight
        dtype, device = weight.dtype, weight.device
        per_token = kv_bytes_per_token(model.config, dtype)
        blocks = kv_pool_blocks(config, per_token, self.max_model_len, device, profile=self._profile)
        self.bytes_per_token = per_token
        self.cache = EngineCache(model.config, blocks, config.block_size, dtype, device)
        self.block_manager = BlockManager(blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.cache)
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._seq_ids = itertools.count()
        self.totals = dict(steps=0, forward_s=0.0, host_s=0.0, prompt_tokens=0, computed_tokens=0,
                           generated_tokens=0, prepare_s=0.0, finished=0, failed=0, cancelled=0)

    # ------------------------------------------------------------ requests
    def add_request(self, prompt, index: int | None = None, on_token=None, params: SamplingParams | None = None,
                    **settings) -> int:
        """Queue one prompt (token ids, or text with a tokenizer); returns its request id.

        settings: generate's names (max_new_tokens, min_new_tokens, do_sample, temperature, top_k, top_p,
        eos_token_id, stop_strings, num_return_sequences) plus ``seed`` and ``ignore_eos``; unset ones come
        from ``model.generation_config``. ``on_token(TokenEvent)`` is called for each new token.
        Raises ValueError for an empty prompt or an unknown setting. A prompt that can never fit is not
        raised: its output carries the error and the other requests run.
        """
        ids = self._token_ids(prompt)
        if params is None:
            params = SamplingParams.resolve(self.model.generation_config, **settings)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError(f"stop_strings={list(params.stop_strings)} need a tokenizer: Engine(model, tokenizer=...)")
        request_id = next(self._ids)
        request = Request(request_id, request_id if index is None else index, ids, params, on_token)
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens} (request {request.index})")
        self.requests[request_id] = request
        error = self._never_fits(request)
        if error:
            request.output.error = error
            self.totals["failed"] += 1
            log.warning("request %d fails alone: %s", request.index, error)
            return request_id
        self._spawn(request, 0, list(ids))
        return request_id

    def _token_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: Engine(model, tokenizer=...) or pass token ids")
            prompt = self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() == 2 and prompt.shape[0] == 1:
                prompt = prompt[0]
            prompt = prompt.tolist()
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt: a request needs at least one token (add a BOS token or some text)")
        return ids

    def _never_fits(self, request: Request) -> str | None:
        total = len(request.prompt) + request.max_new_tokens
        if total > self.max_model_len:
            return (f"prompt of {len(request.prompt)} tokens + max_new_tokens={request.max_new_tokens} = {total} "
                    f"tokens exceeds the model's context of {self.max_model_len} (max_model_len). Shorten the "
                    "prompt or lower max_new_tokens.")
        blocks = -(-total // self.config.block_size)
        if blocks > self.block_manager.num_blocks:
            return (f"prompt + max_new_tokens = {total} tokens need {blocks} blocks but the whole KV pool holds "
                    f"{self.block_manager.num_blocks}. Raise kv_cache_memory_bytes / num_blocks / "
                    "gpu_memory_utilization, or lower max_new_tokens.")
        return None

    def _spawn(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(next(self._seq_ids), request, index, token_ids, self.totals["steps"])
        request.sequences.append(seq)
        self.scheduler.add(seq)
        return seq

    def cancel(self, request_id: int) -> None:
        """Stop a request now: its sequences end with finish_reason 'cancelled' and their blocks go back."""
        request = self.requests[request_id]
        if request.finished:
            return
        request.forked = True
        for seq in request.sequences:
            if seq.status is Status.RUNNING:
                self.scheduler.finish(seq, "cancelled")
            elif seq.status is Status.WAITING:
                seq.status, seq.finish_reason = Status.FINISHED, "cancelled"
        while len(request.sequences) < request.params.num_return_sequences:
            seq = Sequence(next(self._seq_ids), request, len(request.sequences), list(request.prompt), 0)
            seq.status, seq.finish_reason = Status.FINISHED, "cancelled"
            request.sequences.append(seq)
        self.scheduler.drop_finished()
        self.totals["cancelled"] += 1
        self._record_finished(request)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def output(self, request_id: int) -> RequestOutput:
        return self.requests[request_id].output

    # ------------------------------------------------------------ one step
    def step(self) -> list[TokenEvent]:
        """Schedule, run one packed forward, sample; returns this step's new tokens."""
        if self.model.config._attn_implementation != ATTENTION_NAME:
            with use_paged_attention(self.model):
                return self._step()
        return self._step()

    def _step(self) -> list[TokenEvent]:
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.batch:
            if self.has_work:
                raise RuntimeError(f"the scheduler could not place any waiting request: {self.block_manager.num_free} "
                                   f"free blocks of {self.block_manager.num_blocks}, max_num_seqs="
                                   f"{self.config.max_num_seqs}. Raise num_blocks / kv_cache_memory_bytes.")
            return []
        self.cache.copy_blocks(plan.copies)
        forward_start = time.perf_counter()
        logits, samplers = self.runner.execute(plan.batch)
        forward_end = time.perf_counter()
        bm = self.block_manager
        for seq, n in plan.batch:
            seq.num_computed += n
            seq.high_water = max(seq.high_water, seq.num_computed)
            bm.commit(seq.block_table, seq.token_ids, seq.num_computed, seq.block_hashes)
        rows = list(range(len(samplers)))
        for row, seq in enumerate(list(samplers)):     # extra sequences of num_return_sequences
            request = seq.request
            if not request.forked and seq.index == 0:
                request.forked = True
                for i in range(1, request.params.num_return_sequences):
                    child = self._fork(seq, i)
                    samplers.append(child)
                    rows.append(row)
        tokens = sample(logits[rows] if len(rows) != logits.shape[0] else logits, samplers)
        events = [self._append(seq, token) for seq, token in zip(samplers, tokens)]
        self.scheduler.drop_finished()
        t = self.totals
        t["steps"] += 1
        t["computed_tokens"] += plan.num_tokens
        prepare = self.runner.prepare_s - t["prepare_s"]
        t["prepare_s"] = self.runner.prepare_s
        t["forward_s"] += forward_end - forward_start - prepare
        t["host_s"] += (forward_start - start) + prepare + (time.perf_counter() - forward_end)
        return events

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        request = parent.request
        child = Sequence(next(self._seq_ids), request, index, list(parent.token_ids), parent.arrival)
        child.num_computed = child.high_water = parent.num_computed
        self.block_manager.fork(parent.seq_id, child.seq_id, child.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.status = Status.RUNNING
        request.sequences.append(child)
        self.scheduler.running.append(child)
        return child

    def _append(self, seq: Sequence, token: int) -> TokenEvent:
        request, params = seq.request, seq.request.params
        seq.token_ids.append(token)
        self.totals["generated_tokens"] += 1
        reason = None
        if token in params.eos_token_ids:
            reason = "stop"
        elif params.stop_strings and self._hits_stop_string(seq):
            reason = "stop_string"
        elif seq.num_output >= request.max_new_tokens:
            reason = "length"
        if reason:
            self.scheduler.finish(seq, reason)
        event = TokenEvent(request.request_id, seq.index, token, reason)
        if request.on_token is not None:
            request.on_token(event)
        if reason and request.finished:
            self._record_finished(request)
        return event

    def _hits_stop_string(self, seq: Sequence) -> bool:
        stops = seq.request.params.stop_strings
        window = max(len(s) for s in stops) + 2
        text = self.tokenizer.decode(seq.output_ids[-window:])
        return any(s in text for s in stops)

    def _record_finished(self, request: Request) -> None:
        out = request.output
        out.outputs = []
        for seq in sorted(request.sequences, key=lambda s: s.index):
            text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True) if self.tokenizer else None
            out.outputs.append(CompletionOutput(seq.index, seq.output_ids, text, seq.finish_reason))
        self.totals["finished"] += 1

    # ------------------------------------------------------------ whole runs
    def run(self, progress=None) -> None:
        """Step until no request is left. ``progress``: a tqdm-like bar advanced per finished request."""
        before = self.totals["finished"]
        start = time.perf_counter()
        with use_paged_attention(self.model):
            while self.has_work:
                self.step()
                if progress is not None:
                    done = self.totals["finished"]
                    progress.update(done - before)
                    before = done
        self.totals["wall_s"] = self.totals.get("wall_s", 0.0) + time.perf_counter() - start
        self.log_stats()

    def log_stats(self) -> None:
        """Log ``stats()`` on one line (logger ``hf_paged.engine``, level INFO)."""
        log.info("hf_paged engine: %s", ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                                 for k, v in self.stats().items()))

    def stats(self) -> dict:
        """Engine-wide counters (see README): requests, blocks, KV utilisation, prefix hits, preemptions, speed."""
        bm, sched, t = self.block_manager, self.scheduler, self.totals
        c = sched.counters
        wall = t.get("wall_s", 0.0)
        waiting = sum(1 for s in sched.waiting if s.status is Status.WAITING)
        return dict(
            requests_running=len({s.request.request_id for s in sched.running}),
            requests_waiting=waiting, requests_finished=t["finished"], requests_failed=t["failed"],
            requests_cancelled=t["cancelled"], blocks_total=bm.num_blocks, blocks_used=bm.num_used,
            blocks_free=bm.num_free, blocks_cached=bm.num_cached_free + sum(
                1 for b in range(bm.num_blocks) if bm.refcounts[b] and bm.block_hash[b] is not None),
            kv_utilization=bm.num_used / bm.num_blocks, block_size=bm.block_size,
            prefix_query_tokens=c.prefix_query_tokens, prefix_hit_tokens=c.prefix_hit_tokens,
            prefix_hit_rate=c.prefix_hit_tokens / c.prefix_query_tokens if c.prefix_query_tokens else 0.0,
            prefix_evictions=bm.evictions, preemptions=c.preemptions, recomputed_tokens=c.recomputed_tokens,
            steps=t["steps"], computed_tokens=t["computed_tokens"], generated_tokens=t["generated_tokens"],
            forward_s=t["forward_s"], host_s=t["host_s"], wall_s=wall,
            tokens_per_s=t["generated_tokens"] / wall if wall else 0.0,
        )

    def _profile(self) -> None:
        """The largest forward (``max_num_batched_tokens`` tokens) without KV, for GPU memory sizing."""
        n = self.config.max_num_batched_tokens
        device = self.model.get_input_embeddings().weight.device
        with torch.inference_mode():
            self.model(input_ids=torch.zeros(1, n, dtype=torch.long, device=device), use_cache=False,
                       logits_to_keep=min(n, self.config.max_num_seqs))

