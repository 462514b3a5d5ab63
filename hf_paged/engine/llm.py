"""The list-of-prompts API: ``LLM`` (an engine kept across calls, so its prefix cache is too) and
``generate_many`` (one call, one engine).

    llm = hf_paged.LLM(model, tokenizer, max_num_seqs=32, kv_cache_memory_bytes=2**28)
    outs = llm.generate(prompts, max_new_tokens=64, do_sample=False)     # RequestOutput per prompt, input order
    outs[0].sequences            # LongTensor [n, prompt + new], what generate returns for that prompt
    outs[0].outputs[0].text      # with a tokenizer
    outs[0].error                # a request that failed alone: its message (finish_reason "error")
    for event in llm.stream(prompts, max_new_tokens=64): ...             # TokenEvent as tokens come
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading

from collections.abc import Mapping
from dataclasses import fields

from .config import EngineConfig
from .engine import Engine
from .outputs import RequestOutput, TokenEvent
from .settings import resolve_generation

_KNOBS = frozenset(f.name for f in fields(EngineConfig))
TQDM_MIN_REQUESTS = 32


def split_options(options: dict) -> tuple[dict, dict]:
    """(engine knobs, generation settings) from one keyword dict."""
    knobs = {k: v for k, v in options.items() if k in _KNOBS}
    return knobs, {k: v for k, v in options.items() if k not in _KNOBS}


class LLM:
    """Continuous batching for lists of prompts on one model (knobs: EngineConfig fields)."""

    def __init__(self, model, tokenizer=None, **knobs):
        if isinstance(model, (str, os.PathLike)):
            raise TypeError(f"hf_paged.engine.LLM takes a loaded model, not {model!r}: hf_paged.LLM({model!r}) loads "
                            "the checkpoint (vLLM's way), or pass AutoModelForCausalLM.from_pretrained(...) and its "
                            "tokenizer")
        self.engine = Engine(model, tokenizer, **knobs)
        self.last_ids: list[int] = []           # the latest call's request ids, in input order
        self._running_past: list[int] = []      # earlier calls' requests still running (a stream left open)
        self._lock = threading.Lock()
        self._owner: int | None = None          # the thread whose calls run (generate, or a stream not finished)
        self._calls = 0

    @contextlib.contextmanager
    def _owned(self):
        """One thread's calls at a time (the engine's steps and records are not shared between threads)."""
        me = threading.get_ident()
        with self._lock:
            if self._owner not in (None, me):
                raise RuntimeError("this LLM is running another thread's generate or stream: an LLM serves one thread "
                                   "at a time. Give each thread its own LLM (several may share one model), or finish "
                                   "or close() the other thread's stream first.")
            self._owner, self._calls = me, self._calls + 1
        try:
            yield
        finally:
            with self._lock:
                self._calls -= 1
                if self._calls == 0:
                    self._owner = None

    def stream(self, prompts, settings=None, *, on_token=None, use_tqdm: bool | None = None, **common):
        """Queue every prompt, then yield a TokenEvent per new token until all are done.

        settings: one dict per prompt (merged over ``common``), one dict for every prompt (vLLM's single
        ``SamplingParams``; the same as passing its keys as keywords), or None. A request that fails alone yields
        nothing; its RequestOutput has ``error`` set and ``finish_reason == "error"``. The request ids are
        in ``self.last_ids``, in input order; their outputs stay readable (``self.engine.output(id)``) until
        the next call, which drops them from the engine's records (a long-lived LLM keeps none of its past).
        ``use_tqdm``: a progress bar (default: for lists of
        ``TQDM_MIN_REQUESTS`` or more, when tqdm is installed). A call that raises (an ``on_token`` callback,
        KeyboardInterrupt) or a stream closed before its end cancels its unfinished requests: their blocks go
        back and no later call runs them. One thread's calls at a time: another thread's call meanwhile raises.
        """
        with self._owned():
            yield from self._stream(prompts, settings, on_token, use_tqdm, common)

    def _stream(self, prompts, settings, on_token, use_tqdm, common):
        engine = self.engine
        self._forget_last()
        prompts = prompt_list(prompts)
        if isinstance(settings, Mapping):
            clash = sorted(set(settings) & set(common))
            if clash:
                raise ValueError(f"{clash} given both in settings and as keywords; give each once")
            settings, common = None, {**common, **settings}
        if settings is not None and len(settings) != len(prompts):
            raise ValueError(f"settings has {len(settings)} entries for {len(prompts)} prompts")
        shared = None if settings is not None else resolve_generation(engine.model.generation_config, **common)
        if shared is not None and shared.do_sample and "seed" not in common:
            shared = None          # each request draws its own seed
        ids = []
        try:
            for i, prompt in enumerate(prompts):
                own = {**common, **(settings[i] if settings is not None else {})}
                if shared is not None:
                    ids.append(engine.add_request(prompt, prompt_index=i, on_token=on_token, params=shared))
                else:
                    ids.append(engine.add_request(prompt, prompt_index=i, on_token=on_token, **own))
        except Exception:            # all or none: the requests added before the bad one are taken back
            for rid in ids:
                engine.withdraw(rid)
            raise
        self.last_ids = ids
        show = len(prompts) >= TQDM_MIN_REQUESTS if use_tqdm is None else use_tqdm
        try:
            with _progress(len(prompts) if show else 0) as bar, engine.session():
                finished = engine.counters.finished
                while engine.has_work:
                    yield from engine.step()
                    if bar is not None:
                        bar.update(engine.counters.finished - finished)
                        finished = engine.counters.finished
        finally:        # raised (a callback, KeyboardInterrupt) or a stream left early: nothing of it runs on
            failure = None
            for rid in ids:                           # every one, whatever one of them raises
                if rid in engine.requests:            # (a later call may have dropped it, finished)
                    try:
                        engine.cancel(rid)            # a no-op for the finished ones
                    except Exception as exc:          # noqa: BLE001  (raised after the others are cancelled)
                        failure = failure or exc
            if failure is not None and isinstance(sys.exc_info()[1], (type(None), GeneratorExit)):
                raise failure                         # (an error already in flight goes on instead)

    def generate(self, prompts, settings=None, *, on_token=None, use_tqdm: bool | None = None,
                 **common) -> list[RequestOutput]:
        """Run every prompt to the end; one RequestOutput per prompt, in input order. Logs the stats.

        A request that fails alone (e.g. a prompt longer than the model's context, or prompt + max new tokens
        over the pool; a sequence reaching the context's end just stops there, "length") does not raise: its
        output has ``error`` (the message) and ``finish_reason == "error"``, no outputs, and ``outputs[0]`` /
        ``sequences`` raise RuntimeError with that message."""
        with self._owned():
            for _ in self.stream(prompts, settings, on_token=on_token, use_tqdm=use_tqdm, **common):
                pass
            self.engine.log_stats()
            outputs = [self.engine.output(rid) for rid in self.last_ids]
            self._forget_last()
        return outputs

    def _forget_last(self) -> None:
        """Drop the previous calls' requests from the engine's records (vLLM's LLM keeps none either); one still
        running (a stream left open, whose requests later steps run on) goes at a later call, once finished."""
        running = []
        for rid in self._running_past + self.last_ids:
            if rid in self.engine.requests:
                if self.engine.requests[rid].finished:
                    self.engine.forget(rid)
                else:
                    running.append(rid)
        self._running_past, self.last_ids = running, []

    def weights_changed(self) -> None:
        """Take the model's weights as new (see ``Engine.weights_changed``): needed only after a change the
        engine cannot see by itself (``hf_paged.weights_watch``: a write through ``p.data`` to a few elements)."""
        with self._owned():
            self.engine.weights_changed()

    def cancel(self, request_id: int) -> None:
        self.engine.cancel(request_id)

    def stats(self):
        """``Engine.stats()``: a read-only EngineStats snapshot."""
        return self.engine.stats()


def prompt_list(prompts) -> list:
    """``prompts`` as a list of prompts: a text or a prompt dict is one, a 1-d tensor of ids is one, a 2-d one is
    one per row; a flat list of ints is refused (one prompt of ids, or several one-token prompts?)."""
    import torch

    if isinstance(prompts, (str, Mapping)):          # a text, or one prompt dict (vLLM's TextPrompt / TokensPrompt)
        return [prompts]
    if isinstance(prompts, torch.Tensor):
        return [prompts] if prompts.dim() == 1 else list(prompts)
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        raise ValueError(f"prompts is a flat list of {len(prompts)} ints: pass [[...]] for one prompt of token ids "
                         "(prompts is a list of prompts, each a text or a list of token ids)")
    return prompts


def generate_many(model, prompts, tokenizer=None, settings=None, *, on_token=None, use_tqdm: bool | None = None,
                  **options) -> list[RequestOutput]:
    """One-shot ``LLM(model, tokenizer, **knobs).generate(prompts, settings, **generation settings)``;
    ``options`` mixes EngineConfig knobs and generation settings (their names do not overlap)."""
    knobs, common = split_options(options)
    return LLM(model, tokenizer, **knobs).generate(prompts, settings, on_token=on_token, use_tqdm=use_tqdm, **common)


class _progress:
    """A tqdm bar over ``total`` requests; nothing for 0 or without tqdm."""

    def __init__(self, total: int):
        self.total, self.bar = total, None

    def __enter__(self):
        if self.total:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                return None
            self.bar = tqdm(total=self.total, desc="hf_paged", unit="req", leave=False)
        return self.bar

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


__all__ = ["LLM", "TokenEvent", "generate_many", "split_options"]
