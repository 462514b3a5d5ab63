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

import contextlib
import itertools
from collections import Counter
import logging
import time
from dataclasses import dataclass, fields

import torch

from ..attention_interface import use_paged_attention
from ..blocks import BlockPool, PrefixCache
from ..families import model_geometry
from ..kv_formats import kv_format
from ..parallel import tensor_parallel_ranks
from .config import EngineConfig, kv_pool_blocks
from .prepack import PrepackedLinears
from .request import CompletionOutput, Request, RequestOutput, SamplingParams, Sequence, Status
from .runner import EngineCache, ModelRunner
from .sampler import sample
from .scheduler import Scheduler
from .settings import resolve_generation
from .stats import EngineCounters, EngineStats

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
        geometry = model_geometry(model)      # raises for an unsupported family
        self.model, self.tokenizer = model, tokenizer
        text_config = model.config.get_text_config(decoder=True)
        self.max_model_len = config.max_model_len or getattr(text_config, "max_position_embeddings", None) or 2**31
        weight = model.get_input_embeddings().weight
        dtype, device = weight.dtype, weight.device
        # Ranks of a tensor-parallel model must hold identical pools and schedules (see hf_paged.parallel).
        self.tp_ranks = tensor_parallel_ranks(model)
        fmt = kv_format(config.kv_cache_dtype)
        per_token = geometry.bytes_per_token(dtype, fmt)
        # Each device holding layers (a device_map) must fit its layers' share of every block.
        layers_on = Counter(geometry.layer_devices or (device,) * geometry.num_layers)
        blocks = self.tp_ranks.smallest(min(
            kv_pool_blocks(config, per_token * layers // geometry.num_layers, self.max_model_len, on,
                           profile=self._profile) for on, layers in layers_on.items()))
        self.bytes_per_token = per_token
        self.cache = EngineCache(model.config, blocks, config.block_size, dtype, device, geometry, fmt)
        self.pool = BlockPool(blocks, config.block_size)
        self.prefix_cache = PrefixCache(self.pool) if config.enable_prefix_caching else None
        self.counters = EngineCounters()
        self.scheduler = Scheduler(self.pool, self.prefix_cache, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.counters)
        self.runner = ModelRunner(model, self.cache)
        self.prepacked = None if config.enforce_eager or device.type != "cpu" else PrepackedLinears(model)
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._seq_ids = itertools.count()

    # ------------------------------------------------------------ requests
    def add_request(self, prompt, prompt_index: int | None = None, on_token=None, params: SamplingParams | None = None,
                    **settings) -> int:
        """Queue one prompt (token ids, or text with a tokenizer); returns its request id.
        ``prompt_index``: its position in the caller's list (``RequestOutput.prompt_index``; default the id).

        settings: generate's names (max_new_tokens, min_new_tokens, do_sample, temperature, top_k, top_p,
        eos_token_id, stop_strings, num_return_sequences) plus ``seed`` and ``ignore_eos``; unset ones are
        resolved as ``model.generate`` resolves them (``settings.resolve_generation``: the model's
        generation config, then transformers' defaults). ``on_token(TokenEvent)`` is called for each new token.
        Raises ValueError for an empty prompt or an unknown setting. A prompt that can never fit (or that
        an explicit ``max_length`` leaves no room after) is not raised: its output carries the error
        (``output.error``, ``finish_reason == "error"``) and the other requests run.
        """
        ids = self._token_ids(prompt)
        if params is None:
            params = resolve_generation(self.model.generation_config, **settings)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError(f"stop_strings={list(params.stop_strings)} need a tokenizer: Engine(model, tokenizer=...)")
        request_id = next(self._ids)
        request = Request(request_id, request_id if prompt_index is None else prompt_index, ids, params, on_token,
                          max_position_embeddings=getattr(self.model.config, "max_position_embeddings", None))
        self.requests[request_id] = request
        error = self._never_fits(request)
        if error:
            request.output.error = error
            self.counters.failed += 1
            log.warning("request %d fails alone: %s", request.prompt_index, error)
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
        if request.max_new_tokens < 1:       # generate raises "Input length of input_ids is ..." for these
            limit = len(request.prompt) + request.max_new_tokens
            return (f"input length of {len(request.prompt)} tokens is >= max_length={limit} (prompt + new tokens, "
                    "as model.generate counts it, which raises for this prompt): set max_new_tokens, or a larger "
                    "max_length.")
        total = len(request.prompt) + request.max_new_tokens
        if total > self.max_model_len:
            return (f"prompt of {len(request.prompt)} tokens + max_new_tokens={request.max_new_tokens} = {total} "
                    f"tokens exceeds the model's context of {self.max_model_len} (max_model_len). Shorten the "
                    "prompt or lower max_new_tokens.")
        n = request.params.num_return_sequences
        if n > self.config.max_num_seqs:
            return (f"num_return_sequences={n} sequences must run together but max_num_seqs="
                    f"{self.config.max_num_seqs}. Raise max_num_seqs or lower num_return_sequences.")
        blocks = -(-total // self.config.block_size)
        if blocks > self.pool.num_blocks:
            return (f"prompt + max_new_tokens = {total} tokens need {blocks} blocks but the whole KV pool holds "
                    f"{self.pool.num_blocks}. Raise kv_cache_memory_bytes / num_blocks / "
                    "gpu_memory_utilization, or lower max_new_tokens.")
        return None

    def _spawn(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(next(self._seq_ids), request, index, token_ids)
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
            seq = Sequence(next(self._seq_ids), request, len(request.sequences), list(request.prompt))
            seq.status, seq.finish_reason = Status.FINISHED, "cancelled"
            request.sequences.append(seq)
        self.scheduler.drop_finished()
        self.counters.cancelled += 1
        self._record_finished(request)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def output(self, request_id: int) -> RequestOutput:
        return self.requests[request_id].output

    def forget(self, request_id: int) -> RequestOutput:
        """Drop a finished (or failed, or cancelled) request from the engine's records; returns its
        output. A long-running server calls this so that the records do not grow without bound."""
        request = self.requests[request_id]
        if not request.finished:
            raise ValueError(f"request {request_id} is still running: cancel it first")
        return self.requests.pop(request_id).output

    # ------------------------------------------------------------ one step
    def step(self) -> list[TokenEvent]:
        """Schedule, run one packed forward, sample; returns this step's new tokens. Inside ``session()``
        the model is already switched (see ``_forward_mode``); a bare call switches it for this step."""
        with self._forward_mode():
            return self._step()

    @contextlib.contextmanager
    def session(self):
        """Switch the model to paged attention once for many steps, and count their wall time."""
        start = time.perf_counter()
        try:
            with self._forward_mode():
                yield self
        finally:
            self.counters.wall_s += time.perf_counter() - start

    @contextlib.contextmanager
    def _forward_mode(self):
        """The model as the engine runs it: paged attention and, unless enforce_eager, prepacked linears."""
        with use_paged_attention(self.model), (self.prepacked.installed() if self.prepacked else contextlib.nullcontext()):
            yield

    def _step(self) -> list[TokenEvent]:
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled.batch:
            if self.has_work:
                raise RuntimeError(f"the scheduler could not place any waiting request: {self.pool.num_free} "
                                   f"free blocks of {self.pool.num_blocks}, max_num_seqs="
                                   f"{self.config.max_num_seqs}. Raise num_blocks / kv_cache_memory_bytes.")
            return []
        self.cache.copy_blocks(scheduled.copies)
        forward_start = time.perf_counter()
        logits, samplers, prepare_s = self.runner.execute(scheduled.batch)
        forward_end = time.perf_counter()
        for seq, n in scheduled.batch:
            seq.num_computed += n
            seq.high_water = max(seq.high_water, seq.num_computed)
            if self.prefix_cache is not None:
                self.prefix_cache.commit(seq.block_table, seq.token_ids, seq.block_hashes)
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
        tokens = self.tp_ranks.share_tokens(tokens)       # tensor-parallel ranks: the first rank's draw
        # An on_token callback may cancel a request mid-loop: its sequences get no further token.
        events = [self._append(seq, token) for seq, token in zip(samplers, tokens) if seq.status is Status.RUNNING]
        self.scheduler.drop_finished()
        c = self.counters
        c.steps += 1
        c.computed_tokens += scheduled.num_tokens
        c.forward_s += forward_end - forward_start - prepare_s
        c.host_s += (forward_start - start) + prepare_s + (time.perf_counter() - forward_end)
        return events

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        request = parent.request
        child = Sequence(next(self._seq_ids), request, index, list(parent.token_ids))
        child.num_computed = child.high_water = parent.num_computed
        child.block_table = parent.block_table.fork(self.pool)
        child.block_hashes = list(parent.block_hashes)
        child.status = Status.RUNNING
        request.sequences.append(child)
        self.scheduler.running.append(child)
        return child

    def _append(self, seq: Sequence, token: int) -> TokenEvent:
        request, params = seq.request, seq.request.params
        seq.token_ids.append(token)
        self.counters.generated_tokens += 1
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
        """Write the request's output record, once."""
        if request.recorded:
            return
        request.recorded = True
        out = request.output
        out.completions = []
        for seq in sorted(request.sequences, key=lambda s: s.index):
            text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True) if self.tokenizer else None
            out.completions.append(CompletionOutput(seq.index, seq.output_ids, text, seq.finish_reason))
        self.counters.finished += 1

    # ------------------------------------------------------------ whole runs
    def run(self, progress=None) -> None:
        """Step until no request is left. ``progress``: a tqdm-like bar advanced per finished request."""
        before = self.counters.finished
        with self.session():
            while self.has_work:
                self.step()
                if progress is not None:
                    progress.update(self.counters.finished - before)
                    before = self.counters.finished
        self.log_stats()

    def log_stats(self) -> None:
        """Log ``stats()`` on one line (logger ``hf_paged.engine``, level INFO)."""
        log.info("hf_paged engine: %s", ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                                 for k, v in self.stats().as_dict().items()))

    def stats(self) -> EngineStats:
        """A read-only snapshot (see README): requests, blocks, KV utilisation, prefix hits, preemptions, speed."""
        pool, sched, c = self.pool, self.scheduler, self.counters
        return EngineStats(
            requests_running=len({s.request.request_id for s in sched.running}),
            requests_waiting=len({s.request.request_id for s in sched.waiting if s.status is Status.WAITING}),
            requests_finished=c.finished, requests_failed=c.failed, requests_cancelled=c.cancelled,
            blocks_total=pool.num_blocks, blocks_used=pool.num_used, blocks_free=pool.num_free,
            blocks_cached=self.prefix_cache.num_hashed if self.prefix_cache is not None else 0,
            kv_utilization=pool.num_used / pool.num_blocks, block_size=pool.block_size,
            bytes_per_token=self.bytes_per_token,
            prefix_query_tokens=c.prefix_query_tokens, prefix_hit_tokens=c.prefix_hit_tokens,
            prefix_hit_rate=c.prefix_hit_tokens / c.prefix_query_tokens if c.prefix_query_tokens else 0.0,
            prefix_evictions=pool.evictions, preemptions=c.preemptions, recomputed_tokens=c.recomputed_tokens,
            steps=c.steps, computed_tokens=c.computed_tokens, generated_tokens=c.generated_tokens,
            forward_s=c.forward_s, host_s=c.host_s, wall_s=c.wall_s,
            tokens_per_s=c.generated_tokens / c.wall_s if c.wall_s else 0.0,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if the block bookkeeping is inconsistent (leaks, refcounts, stale hashes)."""
        self.pool.check_invariants(s.block_table.blocks for s in self.scheduler.running)
        if self.prefix_cache is not None:
            self.prefix_cache.check_invariants()

    def allocator_state(self) -> tuple:
        """The block pool's state and each running sequence's block table (hashable; equal on every
        tensor-parallel rank after every step — the distributed tests compare them)."""
        tables = tuple((s.seq_id, tuple(s.block_table.blocks)) for s in self.scheduler.running)
        return self.pool.state(), tables

    def _profile(self) -> None:
        """The largest forward (``max_num_batched_tokens`` tokens) without KV, for GPU memory sizing."""
        n = self.config.max_num_batched_tokens
        device = self.model.get_input_embeddings().weight.device
        with torch.inference_mode():
            self.model(input_ids=torch.zeros(1, n, dtype=torch.long, device=device), use_cache=False,
                       logits_to_keep=min(n, self.config.max_num_seqs))

