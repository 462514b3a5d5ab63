"""One API call seen from the asyncio side: its engine requests (one per prompt, ``n`` sequences each;
several per prompt when ``n`` exceeds the engine's max_num_seqs, see ``engine_parts``), their text
streams (stop sequences cut off), their log-probabilities and its token usage.

The engine thread hands each request's items over with ``loop.call_soon_threadsafe``; ``deltas()``
turns them into ``Delta``s in arrival order. A delta carries the tokens (and their log-probability
entries) that arrived since its choice's last delta, so that text held back (a stop string's start, a
broken UTF-8 character) keeps its tokens with it. With ``echo``, each choice's first delta is its
prompt (``Delta.prompt``), with the prompt's log-probabilities when they are asked.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from functools import partial

from .detokenize import TextStream
from .errors import ApiError
from .options import CallOptions
from .protocol import finish_reason
from .worker import EngineFailed, EngineWorker, Handle, QueueFull, ShuttingDown


@dataclass
class Delta:
    """Choice ``index`` gains ``text``; ``tokens`` / ``entries``: the token ids it covers and their
    log-probability entries ({id: Logprob}, None for a prompt's first token; empty without logprobs);
    ``reason``: the choice's finish reason when this is its last delta; ``prompt``: an echoed prompt."""
    index: int
    text: str
    reason: str | None = None
    tokens: list[int] = field(default_factory=list)
    entries: list = field(default_factory=list)
    prompt: bool = False
    stop_reason: str | int | None = None    # vLLM's: the stop string or stop_token_ids entry it ended on
    ids: list[int] = field(default_factory=list)     # the generated token ids it covers (vLLM's return_token_ids)


def engine_parts(params, max_num_seqs: int) -> list[tuple[int, object]]:
    """(first sequence, params) of the engine requests that run one prompt's ``n`` sequences: one request,
    or, when n exceeds ``max_num_seqs`` (a request's sequences run together), parts of at most that many,
    as vLLM runs n > 1 as independent child requests, each beginning at a multiple of max_num_seqs. A part
    from sequence j0 is seeded seed + j0, so that sequence j still samples with seed + j (the engine's rule):
    the same tokens as one request of n."""
    n = params.num_return_sequences
    if n <= max_num_seqs:
        return [(0, params)]
    return [(j0, replace(params, num_return_sequences=min(max_num_seqs, n - j0),
                         seed=None if params.seed is None else params.seed + j0))
            for j0 in range(0, n, max_num_seqs)]


class ApiCall:
    """Choice ``i * n + j`` is sequence ``j`` of prompt ``i``; ``handles`` holds the engine requests, keyed
    (prompt, first sequence)."""

    def __init__(self, worker: EngineWorker, tokenizer, prompts: list[list[int]], params, options: CallOptions,
                 texts: list[str | None] | None = None):
        self.worker, self.tokenizer, self.options, self.n = worker, tokenizer, options, options.n
        self.prompts = prompts
        self.texts = texts or [None] * len(prompts)     # what an echo answers (None: the ids decoded)
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.streams = {(i, j): TextStream(tokenizer, options.stops, options.skip_special_tokens,
                                           options.include_stop_str_in_output, context=prompts[i],
                                           min_tokens=options.min_tokens)
                        for i in range(len(prompts)) for j in range(self.n)}
        self.pending = {key: ([], []) for key in self.streams}     # tokens / entries not sent yet
        self.pending_ids = {key: [] for key in self.streams}       # every generated id not sent yet
        self.done: set[tuple[int, int]] = set()          # (prompt, sequence) pairs whose last delta went out
        self.echoed: set[int] = set()                    # prompts whose echo went out
        self.prompt_logprobs: dict[int, list] = {}       # prompt -> its entries, as the engine sent them
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.cached_tokens = [0] * len(prompts)          # per prompt: its tokens the prefix cache held (when done)
        self.completion_tokens = 0
        self.choice_tokens = [0] * (len(prompts) * self.n)     # completion tokens per choice
        self.answer_ids = [[] for _ in range(len(prompts) * self.n)]   # per choice, with a reasoning parser: its ids
        self.params = params
        self.part_size = worker.engine.config.max_num_seqs
        parts = engine_parts(params, self.part_size)
        self.handles = {(i, j0): Handle(ids, part, partial(self._deliver, (i, j0)))
                        for i, ids in enumerate(prompts) for j0, part in parts}

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    def _deliver(self, key: tuple[int, int], item) -> None:           # engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (key, item))

    def submit(self) -> None:
        """Hand every request to the engine thread; all or none (503 when the queue is full or closing)."""
        try:
            for handle in self.handles.values():
                self.worker.submit(handle)
        except QueueFull as exc:
            self.cancel()
            raise ApiError.unavailable(exc, "queue_full")
        except ShuttingDown as exc:
            self.cancel()
            raise ApiError.unavailable(exc, "shutting_down")
        except EngineFailed as exc:
            self.cancel()
            raise ApiError(500, str(exc), code="engine_error") from None

    def cancel(self) -> None:
        """Cancel what still runs (a no-op for finished requests)."""
        for handle in self.handles.values():
            self.worker.cancel(handle)

    async def deltas(self):
        """Yield ``Delta``s until every sequence is done."""
        pending = len(self.handles)
        while pending:
            (i, j0), item = await self.queue.get()
            if isinstance(item, tuple) and item[0] == "prompt":     # the prompt's log-probabilities (each part's alike)
                self.prompt_logprobs[i] = item[1]
                continue
            for delta in self._echo(i):
                yield delta
            if isinstance(item, tuple):                  # ("done", output), ("error" / "fault", message): the last
                kind, value = item
                if kind == "error":
                    raise ApiError(400, value, param="prompt")
                if kind == "fault":                      # the server's fault, not the request's
                    raise ApiError(500, value, code="engine_error")
                if value is not None:
                    self.cached_tokens[i] = max(self.cached_tokens[i], value.num_cached_tokens)
                pending -= 1
                for j in range(j0, j0 + self.handles[i, j0].params.num_return_sequences):
                    if (i, j) not in self.done:          # sequences that ended without an event (cancelled)
                        self.done.add((i, j))
                        yield self._delta(i, j, self.streams[i, j].finish(), "abort")
                continue
            for event in item:
                out = self._token(i, j0 + event.index, event)
                if out is not None:
                    yield out

    def _echo(self, i: int):
        """The echo deltas of prompt ``i`` (one per choice), once, before anything else of it."""
        if not self.options.echo or i in self.echoed:
            return []
        self.echoed.add(i)
        ids = self.prompts[i]
        text = self.texts[i] if self.texts[i] is not None else self.tokenizer.decode(ids, skip_special_tokens=False)
        # completions answer the prompt's log-probabilities with it; chat's echo has none
        entries = self.prompt_logprobs.get(i) if self.options.logprobs is not None and not self.options.chat else None
        return [Delta(i * self.n + j, text, None, list(ids) if entries else [], list(entries or []), prompt=True)
                for j in range(self.n)]

    def _delta(self, i: int, j: int, text: str, reason: str | None) -> Delta:
        tokens, entries = self.pending[i, j]
        self.pending[i, j] = ([], [])
        ids, self.pending_ids[i, j] = self.pending_ids[i, j], []
        if self.options.reasoning is not None:
            self.answer_ids[i * self.n + j] += ids
        return Delta(i * self.n + j, text, reason, tokens, entries, ids=ids)

    def _token(self, i: int, j: int, event) -> Delta | None:
        """The delta one TokenEvent of sequence ``j`` of prompt ``i`` adds to its choice, or None (nothing to
        send yet, or already done)."""
        key = (i, j)
        if key in self.done:
            return None
        if self.options.max_tokens_zero:                 # echo only: the engine's one token is not answered
            self.done.add(key)
            return Delta(i * self.n + j, "", "length")
        stream = self.streams[key]
        self.pending_ids[key].append(event.token)
        self.completion_tokens += 1
        self.choice_tokens[i * self.n + j] += 1
        if event.logprobs is not None:
            tokens, entries = self.pending[key]
            tokens.append(event.token)
            entries.append(event.logprobs)
        # EOS or a stop_token_ids token that ended the sequence: its text stays out (vLLM's rule)
        last_stop = event.finished == "stop" and event.token in self.params.stops_on
        delta = stream.add(event.token, last_stop)
        if event.finished or stream.stopped:
            self.done.add(key)
            delta += stream.finish()                     # may find a stop string in the last characters
            reason = "stop" if stream.stopped else finish_reason(event.finished)
            if not event.finished:                       # the text stopped where the engine did not (yet)
                self._release(i, j)
            out = self._delta(i, j, delta, reason)
            out.stop_reason = stream.stop_string if stream.stopped else (
                event.token if last_stop and event.token not in self.params.eos_token_ids else None)
            return out
        return self._delta(i, j, delta, None) if delta else None

    def _release(self, i: int, j: int) -> None:
        """Cancel the engine request holding sequence ``j`` of prompt ``i`` once all its sequences are done
        here, so that it gives back its slots and blocks rather than run to max_tokens for nobody."""
        j0 = j - j % self.part_size                      # engine_parts: parts begin at its multiples
        handle = self.handles[i, j0]
        if all((i, k) in self.done for k in range(j0, j0 + handle.params.num_return_sequences)):
            self.worker.cancel(handle)

    def usage(self, choice: int | None = None) -> dict:
        """The call's usage, or (vLLM's continuous usage) one choice's so far: its prompt and its tokens; with a
        reasoning parser, vLLM's ``completion_tokens_details.reasoning_tokens`` too."""
        prompt, completion = ((self.prompt_tokens, self.completion_tokens) if choice is None else
                              (len(self.prompts[choice // self.n]), self.choice_tokens[choice]))
        out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if self.options.reasoning is not None:
            ids = self.answer_ids if choice is None else [self.answer_ids[choice]]
            out["completion_tokens_details"] = {"reasoning_tokens": sum(map(self.options.reasoning.count, ids))}
        return out
