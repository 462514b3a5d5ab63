"""The engine: requests in, one packed forward per step, tokens out as they come.

    engine = Engine(model, tokenizer=None, **knobs)      # knobs: EngineConfig fields
    rid = engine.add_request(prompt_ids, max_new_tokens=32, do_sample=True, seed=0)
    while engine.has_work:
        for event in engine.step(): ...                  # TokenEvent(request_id, index, token, finished)
    engine.output(rid), engine.stats()

A step: the scheduler schedules (running sequences first, then waiting ones; it preempts the newest
when blocks run out; the cache applies each copy-on-write pair as it is made), the runner runs the model on the
packed tokens, the scheduler's ``postprocess`` does the bookkeeping (computed tokens, prefix-cache
commits, forks of ``num_return_sequences`` requests), the sampler draws a token for each sequence
that reached its last token, and the engine appends it and decides whether the sequence stops (the
scheduler then finishes it: its blocks go back at once).

The engine owns intake (``intake``), the forward, sampling, finish decisions (EOS, stop strings,
length), output records (``outputs``) and stats (``stats``); the scheduler owns every sequence's
lifecycle (``scheduler``).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import fields, replace

import torch

from ..attention_interface import use_paged_attention
from ..backends import backend_kind
from ..blocks import BlockPool, PrefixCache
from ..introspect import length_dependent_rope, model_geometry, trained_context
from ..kivi import split_budget
from ..kv_formats import kv_format
from ..parallel import tensor_parallel_ranks
from ..weights_watch import WeightsWatch
from .config import EngineConfig, kv_pool_blocks
from .cpu_bf16 import bf16_warning
from .fused import FusedOps
from .graphs import DecodeGraphs, capture_sizes, cuda_capture
from .intake import never_fits, token_ids
from .logprobs import TokenTexts, logprob_entries
from .outputs import RequestOutput, TokenEvent, write_record
from .prepack import PrepackedLinears
from .request import Request, SamplingParams, Sequence, Status
from .runner import EngineCache, ModelRunner
from .sampler import sample, sampled_logprobs
from .scheduler import Scheduler
from .settings import resolve_generation
from .stats import EngineCounters, EngineStats, snapshot, stats_line
from .stop_strings import StopStrings

log = logging.getLogger("hf_paged.engine")
LONG_CONTEXT_ENV = "HF_PAGED_ALLOW_LONG_MAX_MODEL_LEN"   # "1": a max_model_len past the model's trained context


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
        trained = trained_context(text_config)
        if config.max_model_len is not None and trained is not None and config.max_model_len > trained \
                and os.environ.get(LONG_CONTEXT_ENV) != "1":
            raise ValueError(f"max_model_len={config.max_model_len} is over the {trained} tokens this model's "
                             "positions cover (max_position_embeddings, with its RoPE scaling): past them its outputs "
                             f"are not what it was trained for. Lower max_model_len, or set {LONG_CONTEXT_ENV}=1 to "
                             "allow it (as vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN)")
        self.max_model_len = config.max_model_len or getattr(text_config, "max_position_embeddings", None) or 2**31
        self.model_len = None        # the model's own context, where the KV pool lowered max_model_len below it
        self.rope_limit = length_dependent_rope(model)     # requests past it fail alone (never_fits)
        weight = model.get_input_embeddings().weight
        dtype, device = weight.dtype, weight.device
        # Ranks of a tensor-parallel model must hold identical pools and schedules (see hf_paged.parallel).
        self.tp_ranks = tensor_parallel_ranks(model)
        fmt = kv_format(config.kv_cache_dtype)
        self.bytes_per_token = geometry.bytes_per_token(dtype, fmt)
        self.open_slots = config.max_num_seqs        # kivi: open slots and sinks the cache holds (_minus_open_slots)
        blocks = self._num_blocks(geometry, device)
        if config.max_model_len is None and blocks * config.block_size < self.max_model_len:
            # the context a request can ever have here: the whole pool (vLLM refuses to start where the pool holds
            # less than max_model_len; a derived one is lowered instead, and a sequence stops there, "length")
            log.info("max_model_len %d (the model's) lowered to the %d tokens the KV pool holds (%d blocks of %d); "
                     "raise kv_cache_memory_bytes / gpu_memory_utilization for more", self.max_model_len,
                     blocks * config.block_size, blocks, config.block_size)
            self.model_len, self.max_model_len = self.max_model_len, blocks * config.block_size
        capture = self._graph_capture(device, geometry)
        # With decode graphs the pools get one block more than the block pool manages: the scratch block
        # that the pad rows of a bucket write and read (hf_paged.engine.graphs).
        self.cache = EngineCache(model.config, blocks + (capture is not None), config.block_size, dtype, device,
                                 geometry, fmt, open_slots=self.open_slots)
        self.pool = BlockPool(blocks, config.block_size)
        self.pool.free_listeners.append(self.cache.release_blocks)
        self.prefix_cache = PrefixCache(self.pool) if config.enable_prefix_caching else None
        self.counters = EngineCounters()
        self.scheduler = Scheduler(self.pool, self.prefix_cache, self.open_slots, config.max_num_batched_tokens,
                                   self.counters, copy_blocks=self.cache.copy_blocks)
        self.runner = ModelRunner(model, self.cache)
        if capture is not None:
            width = min(-(-self.max_model_len // config.block_size), blocks)
            self.runner.graphs = DecodeGraphs(self.runner, capture_sizes(config.max_num_seqs), width, blocks, capture)
        if (slow := bf16_warning(dtype, device)) is not None:
            log.warning("%s", slow)
        self._device, self._dtype = device, dtype
        self._build_cpu_forwards()
        self._weights = WeightsWatch(model)         # what the prefix cache's K/V and the prepacked copies came from
        self._weights_settled = False               # read again after the next forward (see step)
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self.token_texts = TokenTexts(tokenizer)       # decoded tokens of log-probability entries
        self._grammars = None                          # a GrammarCompiler, built at first use
        self._grammars_lock = threading.Lock()

    def _build_cpu_forwards(self) -> None:
        """The fused CPU ops and the prepacked linears (copies of the weights), as the config asks."""
        config, cpu = self.config, self._device.type == "cpu"
        self.fused = FusedOps(self.model) if config.fused_ops and not config.enforce_eager and cpu else None
        # q/k/v and gate/up as one packed weight each when the fused forwards (which call them as one) run
        self.prepacked = None if config.enforce_eager or not cpu else \
            PrepackedLinears(self.model, group_siblings=bool(self.fused and self.fused.forwards),
                             prefill_rows=config.max_num_batched_tokens)

    def _check_weights(self) -> None:
        """At each new request and session: new weights since (``load_state_dict``, an optimizer step between
        calls; ``hf_paged.weights_watch``)? The prefix cache's K/V and the prepacked copies came from the old
        ones: the first is emptied, the second made again. A dtype change, or new weights while requests run,
        cannot be followed: refused, saying so. While requests run only the cheap reading is taken (the
        values were read when the first of them came)."""
        if self._weights.changed(values=not self.has_work):
            self.weights_changed()

    def weights_changed(self) -> None:
        """Take the model's weights as new: the prefix cache is emptied and the CPU linears prepacked again.
        Called by the checks above; call it after changing weights in a way they cannot see (a write through
        ``p.data`` to a few elements). Refused while requests run or when the dtype changed."""
        if self.has_work:
            raise RuntimeError("the model's weights changed while the engine has requests running or waiting: "
                               "their K/V came from the old weights. Change weights between calls only.")
        weight = next(self.model.parameters(), None)
        if weight is not None and weight.is_floating_point() and weight.dtype != self._dtype:
            raise RuntimeError(f"the model's dtype changed from {self._dtype} to {weight.dtype} since this engine "
                               "was built (its KV pools and kernels are of the old one): build a new LLM / Engine")
        if self.prefix_cache is not None:
            self.prefix_cache.forget_all()
        self._build_cpu_forwards()
        self._weights.settle()
        self._weights_settled = False
        log.info("the model's weights changed: prefix cache emptied, CPU linears prepacked again")

    def _num_blocks(self, geometry, device: torch.device) -> int:
        """Blocks in the pool: each device holding layers (a device_map) must fit its layers' share of
        every block, and every tensor-parallel rank gets the smallest count any rank allows."""
        layers_on = Counter(geometry.layer_devices or (device,) * geometry.num_layers)
        return self.tp_ranks.smallest(self._minus_open_slots(geometry, min(
            kv_pool_blocks(self.config, self.bytes_per_token * layers // geometry.num_layers, self.max_model_len,
                           on, profile=self._profile) for on, layers in layers_on.items())))

    def _graph_capture(self, device: torch.device, geometry):
        """How decode steps are captured (``graphs.cuda_capture``), or None to run them eagerly: CUDA graphs
        unless ``enforce_eager``, on one CUDA device with the CUDA kernels and pools they read in place
        (not kivi, not a device_map, not tensor-parallel)."""
        if (self.config.enforce_eager or device.type != "cuda" or self.config.kv_cache_dtype == "kivi"
                or geometry.layer_devices or self.tp_ranks.size > 1 or backend_kind(device) != "cuda"):
            return None
        return cuda_capture

    def _minus_open_slots(self, geometry, blocks: int) -> int:
        """kivi: the side rows of running sequences (an open block and a sink row each, the model's dtype) are
        paid for out of the KV budget and cap the running sequences (``kivi.split_budget``); an explicit
        ``num_blocks`` counts sealed blocks, the side rows come on top."""
        if self.config.kv_cache_dtype != "kivi" or self.config.num_blocks is not None:
            return blocks
        dtype = self.model.get_input_embeddings().weight.dtype
        blocks, self.open_slots = split_budget(blocks, self.bytes_per_token * self.config.block_size,
                                               (self.config.block_size + 1) * geometry.bytes_per_token(dtype),
                                               self.config.max_num_seqs)
        return blocks

    # ------------------------------------------------------------ requests
    def never_fits(self, prompt_len: int, params: SamplingParams) -> str | None:
        """Why a prompt of ``prompt_len`` tokens with ``params`` can never run on this engine, or None (a server
        asks before it answers; ``add_request`` fails such a request alone)."""
        max_new_tokens, _ = params.new_tokens_for(prompt_len, getattr(self.model.config, "max_position_embeddings",
                                                                      None), self.max_model_len)
        return never_fits(prompt_len, max_new_tokens, params.num_return_sequences, max_model_len=self.max_model_len,
                          max_num_seqs=self.config.max_num_seqs, block_size=self.config.block_size,
                          num_blocks=self.pool.num_blocks, rope_limit=self.rope_limit, model_len=self.model_len)

    def add_request(self, prompt, prompt_index: int | None = None, on_token=None, params: SamplingParams | None = None,
                    **settings) -> int:
        """Queue one prompt (token ids, or text with a tokenizer); returns its request id.
        ``prompt_index``: its position in the caller's list (``RequestOutput.prompt_index``; default the id).

        settings: generate's names (max_new_tokens, min_new_tokens, do_sample, temperature, top_k, top_p,
        eos_token_id, stop_strings, num_return_sequences) plus ``seed`` and ``ignore_eos``; unset ones are
        resolved as ``model.generate`` resolves them (``settings.resolve_generation``: the model's
        generation config, then transformers' defaults). ``on_token(TokenEvent)`` is called for each new token.
        Raises ValueError for an empty prompt, a token id outside the vocabulary or an unknown setting. A
        prompt that can never fit (or that
        an explicit ``max_length`` leaves no room after) is not raised: its output carries the error
        (``output.error``, ``finish_reason == "error"``) and the other requests run.
        """
        self._check_weights()
        ids, params = self.prepare(prompt, params, **settings)
        request_id = next(self._ids)
        request = Request(request_id, request_id if prompt_index is None else prompt_index, ids, params, on_token,
                          max_position_embeddings=getattr(self.model.config, "max_position_embeddings", None),
                          max_model_len=self.max_model_len)
        request.output.prompt = prompt if isinstance(prompt, str) else (
            prompt.get("prompt") if isinstance(prompt, Mapping) else None)
        request.output.request_id = str(request_id)
        self.requests[request_id] = request
        error = self.never_fits(len(ids), params)
        if error:
            request.output.error = error
            self.counters.failed += 1
            log.warning("request %d fails alone: %s", request.prompt_index, error)
            return request_id
        self.scheduler.add(request)
        return request_id

    def prepare(self, prompt, params: SamplingParams | None = None, **settings) -> tuple[list[int], SamplingParams]:
        """``prompt``'s token ids and its settings resolved and checked for this engine, without adding it: the
        ValueError ``add_request`` would raise (a caller that must not fail a whole batch checks rows alone)."""
        ids = token_ids(prompt, self.tokenizer, self.model.get_input_embeddings().weight.shape[0])
        if params is None:
            params = resolve_generation(self.model.generation_config, **settings)
        params = self._checked(params)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError(f"stop_strings={list(params.stop_strings)} need a tokenizer: Engine(model, tokenizer=...)")
        return ids, params

    def _checked(self, params: SamplingParams) -> SamplingParams:
        """``params`` within this engine's limits, with a structured-output spec compiled."""
        most = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > most:
                raise ValueError(f"{name}={k} is over this engine's max_logprobs={most}: ask for fewer, or raise "
                                 "max_logprobs (hf-paged serve --max-logprobs)")
        vocab = self.model.get_input_embeddings().weight.shape[0]
        ids = ([t for t, _ in params.logit_bias] + sorted(params.allowed_token_ids or ()) + sorted(params.stop_token_ids)
               + [t for word in params.bad_words_ids or () for t in word])
        if any(t >= vocab for t in ids):
            raise ValueError(f"token id {max(ids)} is outside the vocabulary of {vocab} (logit_bias / "
                             "allowed_token_ids / stop_token_ids / bad_words_ids)")
        spec = params.structured_output
        if spec is not None and not hasattr(spec, "matcher"):
            params = replace(params, structured_output=self.compile_grammar(spec))
        return params

    def compile_grammar(self, spec):
        """``spec`` (a StructuredOutput) compiled for this engine's tokenizer and vocabulary; ValueError
        when it cannot compile (its subclass StructuredOutputUnavailable when no spec could: no tokenizer, or
        one llguidance cannot read). Safe to call from another thread (the server compiles off the engine thread)."""
        with self._grammars_lock:      # one compiler per engine: a step's masks must share it
            if self._grammars is None:
                from .structured import GrammarCompiler, StructuredOutputUnavailable
                if self.tokenizer is None:
                    raise StructuredOutputUnavailable("structured output needs a tokenizer: "
                                                      "Engine(model, tokenizer=...)")
                vocab = self.model.get_input_embeddings().weight.shape[0]
                eos = self.model.generation_config.eos_token_id
                eos = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
                self._grammars = GrammarCompiler(self.tokenizer, vocab, eos)
            compiler = self._grammars
        return compiler.compile(spec)

    def cancel(self, request_id: int) -> None:
        """Stop a request now: its sequences end with finish_reason 'cancelled' and their blocks go back."""
        request = self.requests[request_id]
        if request.finished:
            return
        self.scheduler.cancel(request)
        self.counters.cancelled += 1
        self._record(request)

    def withdraw(self, request_id: int) -> None:
        """Take back a request that has not run (a call that failed while adding its requests): its record
        and its count go, as if it had never been added."""
        request = self.requests.pop(request_id)
        if request.output.error is not None:        # failed alone when added
            self.counters.failed -= 1
        elif not request.finished:
            self.scheduler.cancel(request)

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
            events = self._step()
        if not self._weights_settled:
            # A model's first forward may re-lay its own weights (bitsandbytes repacks 4-bit weights for its
            # bf16 CPU kernel): the same weights, new storage. Taken as they are after it, once, so that only
            # a change made between calls counts as new weights.
            self._weights.settle()
            self._weights_settled = True
        return events

    @contextlib.contextmanager
    def session(self):
        """Switch the model to paged attention once for many steps, and count their wall time."""
        start = time.perf_counter()
        self._check_weights()
        try:
            with self._forward_mode():
                yield self
        finally:
            self.counters.wall_s += time.perf_counter() - start

    @contextlib.contextmanager
    def _forward_mode(self):
        """The model as the engine runs it: paged attention and, unless enforce_eager, prepacked linears and
        (unless fused_ops=False) the fused CPU ops."""
        with use_paged_attention(self.model), (self.prepacked.installed() if self.prepacked else contextlib.nullcontext()), \
                (self.fused.installed() if self.fused else contextlib.nullcontext()):
            yield

    @contextlib.contextmanager
    def _own_forward(self):
        """The step's forward: the only one the fused forwards and prepacked linears installed for a session
        apply to (a plain forward on the model meanwhile, from another thread or between a stream's steps,
        gets the model's own modules)."""
        with (self.prepacked.running() if self.prepacked else contextlib.nullcontext()), \
                (self.fused.running() if self.fused else contextlib.nullcontext()):
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
        forward_start = time.perf_counter()
        with self._own_forward():
            logits, samplers, spans, prepare_s = self.runner.execute(scheduled.batch)
        forward_end = time.perf_counter()
        self._prompt_logprobs(logits[len(samplers):], spans)
        samplers, rows = self.scheduler.postprocess(scheduled.batch, samplers)
        logits = logits[rows] if len(rows) != logits.shape[0] else logits
        tokens = self.tp_ranks.share_tokens(sample(logits, samplers))   # tensor-parallel ranks: the first rank's draw
        entries = sampled_logprobs(logits, samplers, tokens, self.token_texts)
        # An on_token callback may cancel a request mid-loop: its sequences get no further token. One that
        # raises stops the callbacks, not the step: every sequence still gets its token (the engine stays
        # consistent), then the error propagates.
        events, failure = [], None
        for seq, token, entry in zip(samplers, tokens, entries):
            if seq.status is not Status.RUNNING:
                continue
            events.append(self._append(seq, token, entry))
            if failure is None and seq.request.on_token is not None:
                try:
                    seq.request.on_token(events[-1])
                except BaseException as exc:      # noqa: BLE001  (re-raised below, KeyboardInterrupt too)
                    failure = exc
        if failure is not None:
            raise failure
        host_s = (forward_start - start) + prepare_s + (time.perf_counter() - forward_end)
        self.counters.add_step(scheduled.num_tokens, host_s=host_s, forward_s=forward_end - forward_start - prepare_s)
        return events

    def _prompt_logprobs(self, logits, spans) -> None:
        """Record the prompt log-probabilities of this step's spans (rows of ``logits`` in span order)."""
        if not spans:
            return
        chosen, ks, contexts = [], [], []
        for seq, first, count in spans:
            prompt = seq.request.prompt
            chosen.extend(prompt[first + 1:first + 1 + count])
            ks.extend([seq.request.params.prompt_logprobs] * count)
            # each token's text read after the prompt tokens before it (vLLM's: from prompt token 1 on)
            contexts.extend(prompt[max(1, p - TokenTexts.CONTEXT):p] for p in range(first + 1, first + 1 + count))
        entries = iter(logprob_entries(logits[:len(chosen)], chosen, ks, self.token_texts, contexts))
        for seq, first, count in spans:
            seq.request.prompt_logprobs.extend(next(entries) for _ in range(count))

    def _append(self, seq: Sequence, token: int, entry: dict | None = None) -> TokenEvent:
        """``token`` joins running ``seq`` (``entry``: its log-probabilities, when asked); the sequence
        finishes if it stops here (its request's record is written when it was the last). The caller
        calls ``on_token``."""
        request = seq.request
        seq.token_ids.append(token)
        if entry is not None:
            seq.logprobs.append(entry)
            seq.cumulative_logprob += entry[token].logprob
        refused = False
        if seq.matcher is not None:
            try:
                seq.matcher.accept(token)
            except RuntimeError as exc:       # no token was allowed (e.g. min_new_tokens against the grammar)
                log.warning("request %d: the grammar refused token %d (%s); the sequence ends", request.prompt_index,
                            token, exc)
                refused = True
        self.counters.generated_tokens += 1
        reason = "stop" if refused else self._finish_reason(seq, token)
        if reason:
            self.scheduler.finish(seq, reason)
        event = TokenEvent(request.request_id, seq.index, token, reason, entry)
        if reason and request.finished:
            self._record(request)
        return event

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Why ``seq`` stops at its new last token ``token``: "stop" (EOS, a stop token, its grammar's end),
        "stop_string", "length", or None; ``seq.stop_reason`` is then vLLM's: the stop string or the
        stop_token_ids entry (None for EOS, a grammar, a length)."""
        request, params = seq.request, seq.request.params
        if token in params.stops_on:
            if token in params.stop_token_ids and token not in params.eos_token_ids:
                seq.stop_reason = token
            return "stop"
        if seq.matcher is not None and seq.matcher.is_finished:
            # as vLLM's, a sequence ends on the EOS its grammar's mask leaves once complete (counted, no text): the
            # token after the end is one of the compiler's EOS ids, whether or not this request stops on it; a
            # request that stops on none of them (ignore_eos) ends with the grammar
            eos = seq.matcher.grammar.compiler.eos_token_ids
            if token in eos or not params.eos_token_ids & eos:
                return "stop"
        wait = request.min_new_tokens if params.stop_strings_wait else 0       # vLLM's min_tokens
        if params.stop_strings:
            found = StopStrings(params.stop_strings).in_tail(self.tokenizer, seq.token_ids, seq.num_output, wait)
            if found is not None:
                seq.stop_reason = found
                return "stop_string"
        if seq.num_output >= request.max_new_tokens:
            return "length"
        return None

    def _record(self, request: Request) -> None:
        """Write the request's output record, once (it finished or was cancelled)."""
        if write_record(request, self.tokenizer):
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
        log.info("hf_paged engine: %s", stats_line(self.stats()))

    def stats(self) -> EngineStats:
        """A read-only snapshot (see README): requests, blocks, KV utilisation, prefix hits, preemptions, speed."""
        sched = self.scheduler
        return snapshot(self.counters, self.pool, self.prefix_cache.num_hashed if self.prefix_cache is not None else 0,
                        sched.requests_running(), sched.requests_waiting(), self.bytes_per_token)

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
