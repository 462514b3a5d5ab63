"""The answers of /v1/completions and /v1/chat/completions: one JSON body, or server-sent events.

A ``Shape`` says how one endpoint's choices look (``COMPLETION``, ``CHAT``); ``respond`` runs an
``ApiCall`` to its end and answers either way. A client that leaves cancels its requests: a stream
when Starlette stops iterating it, a whole answer when ``http.disconnect`` arrives (then 499).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .call import ApiCall
from .errors import sse_error
from .logprob_format import LogprobFormat, prompt_logprobs
from .tool_parsers import StreamParser

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "data: [DONE]\n\n"


class CompletionShape:
    """/v1/completions: choices carry ``text`` and, when asked, the completions ``logprobs`` object."""
    object = chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def choice(self, index: int, text: str, reason: str | None, fmt, deltas, role: str = "") -> dict:
        """``deltas``: (tokens, entries, offset, text length, prompt) of the choice's deltas, in order. An
        echoed prompt's tokens are placed from its text's start (at most its end), the generated ones from where
        their text starts, each after the one before, past the text's end for the tokens of a stop string cut
        off (vLLM's, and the stream's): text held back (a possible stop string) reaches the client in a later
        delta than its tokens, so a delta's start is not its tokens'."""
        if fmt.k is None:
            return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
        pieces = [fmt.completion(t, e, offset, offset + n) for t, e, offset, n, prompt in deltas if prompt]
        generated = [d for d in deltas if not d[4]]
        if generated:
            pieces.append(fmt.completion([t for d in generated for t in d[0]], [e for d in generated for e in d[1]],
                                         generated[0][2]))
        return {"index": index, "text": text, "logprobs": fmt.merged(pieces), "finish_reason": reason}

    def delta(self, index: int, text: str, reason: str | None, fmt, tokens, entries, offset: int = 0,
              prompt: bool = False) -> dict:
        """A stream's chunk: ``offset``, where its first token's text starts (an echoed prompt's are kept
        within its text; a generated token's offset is the previous one's plus that token's text length)."""
        logprobs = fmt.completion(tokens, entries, offset, offset + len(text) if prompt else None) \
            if fmt.k is not None else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def opening(self, choices: int, role: str = "") -> list[dict]:
        return []


class ChatShape:
    """/v1/chat/completions: choices carry an assistant ``message``; a stream opens with the role."""
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def _logprobs(self, fmt, tokens, entries):
        return {"content": fmt.chat(tokens, entries)} if fmt.k is not None else None

    def choice(self, index: int, text: str, reason: str | None, fmt, deltas, role: str = "assistant") -> dict:
        tokens = [t for d in deltas for t in d[0]]
        entries = [e for d in deltas for e in d[1]]
        return {"index": index, "message": {"role": role, "content": text},
                "logprobs": self._logprobs(fmt, tokens, entries), "finish_reason": reason}

    def delta(self, index: int, delta: str, reason: str | None, fmt, tokens, entries, offset: int = 0,
              prompt: bool = False) -> dict:
        return {"index": index, "delta": {"content": delta} if delta or not reason else {},
                "logprobs": self._logprobs(fmt, tokens, entries), "finish_reason": reason}

    def opening(self, choices: int, role: str = "assistant") -> list[dict]:
        return [{"index": k, "delta": {"role": role, "content": ""}, "logprobs": None,
                 "finish_reason": None} for k in range(choices)]


COMPLETION, CHAT = CompletionShape(), ChatShape()


def formatter(call: ApiCall) -> LogprobFormat:
    options = call.options
    return LogprobFormat(call.tokenizer, options.logprobs, options.return_tokens_as_token_ids)


def with_prompt_logprobs(choice: dict, call: ApiCall, index: int) -> dict:
    """vLLM's ``prompt_logprobs`` on a choice, when the request asks it (completions)."""
    k = call.options.prompt_logprobs
    if k is not None:
        choice["prompt_logprobs"] = prompt_logprobs(call.prompt_logprobs.get(index // call.n), k)
    return choice


class Reply:
    """The envelope every body and chunk of one answer shares (id, object, created, model)."""

    def __init__(self, shape, model: str):
        self.shape, self.model = shape, model
        self.id = shape.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())

    def body(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def chunk(self, choices: list[dict], include_usage: bool, usage: dict | None = None, **extra) -> str:
        body = self.body(self.shape.chunk_object, choices, **({"usage": usage} if include_usage else {}), **extra)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def respond(request: Request, call: ApiCall, reply: Reply, stream: bool, include_usage: bool) -> Response:
    """Submit ``call``'s requests (503 when the queue is full) and answer with their text."""
    call.submit()
    if stream:
        return StreamingResponse(events(call, reply, include_usage), media_type="text/event-stream",
                                 headers=STREAM_HEADERS)
    return await whole(request, call, reply)


def answer_fields(options, text: str, reason: str | None) -> tuple[dict, str | None]:
    """A chat answer's message fields and finish reason: its thinking split off (a reasoning parser: vLLM's
    ``reasoning``, None where include_reasoning is false), the rest read for tool calls."""
    reasoning = None
    if options.reasoning is not None:
        reasoning, text = options.reasoning.split(text)
    if options.tools is not None and (text is not None or options.tools.mode != "auto"):
        fields, reason = options.tools.answer(text or "", reason)     # (a forced choice: content "", vLLM's)
    else:
        fields = {"content": text}
    if options.reasoning is not None:
        fields["reasoning"] = reasoning if options.include_reasoning else None
    return fields, reason


class AnswerStream:
    """One streamed chat choice read for its thinking (a reasoning parser, from ``prompt``'s end) and then for tool
    calls: ``feed`` gives a delta's fields (``reasoning``, ``content``, ``tool_calls``; {} for none)."""

    def __init__(self, options, prompt: list[int]):
        self.options = options
        self.thinking = options.reasoning.stream(prompt, options.include_reasoning) \
            if options.reasoning is not None else None
        self.parser = StreamParser(options.tools.parser) if options.tools is not None else None

    @property
    def called(self) -> bool:
        return self.parser is not None and self.parser.called

    def feed(self, text: str, ids: list[int], last: bool) -> dict:
        out = {}
        if self.thinking is not None:
            reasoning, text = self.thinking.feed(text, ids, last)
            if reasoning is not None:
                out["reasoning"] = reasoning
        if self.parser is not None:
            out.update(self.options.tools.streamed(self.parser, text or "", last))
        elif text or (text is not None and self.thinking is not None):    # (after thinking, "" too: vLLM's)
            out["content"] = text
        return out


def read_delta(choice: dict, reader: AnswerStream, text: str, ids: list[int]) -> dict | None:
    """A chat chunk's choice with its text read (``reader``: the choice's), or None where it has nothing to send (no
    finish reason, no field, no log-probabilities): vLLM skips such chunks, and sends one with an empty delta where
    it carries log-probabilities. Without include_reasoning (vLLM's), no thinking, log-probabilities or token ids
    go out, and content carries ``"reasoning": null``."""
    options = reader.options
    out = reader.feed(text, ids, last=bool(choice["finish_reason"]))
    if choice["finish_reason"] and options.tools is not None:
        choice["finish_reason"] = options.tools.stream_reason(reader.called, choice["finish_reason"])
    if not options.include_reasoning:
        choice["logprobs"] = None
        if options.reasoning is not None and out:
            out["reasoning"] = None
        if not out.get("content") and not out.get("tool_calls"):     # nothing left to send: vLLM drops it
            out = {}
    if not out and not choice["finish_reason"] and not choice["logprobs"]:
        return None
    choice["delta"] = out
    return choice


async def events(call: ApiCall, reply: Reply, include_usage: bool):
    """The stream's events: a chunk per delta, the usage chunk if asked, ``[DONE]``; an error mid-way is
    an event with the error body."""
    try:
        continuous = call.options.continuous_usage       # each chunk: its choice's usage so far (vLLM's)
        opening = reply.shape.opening(call.choices, call.options.role)
        for choice in opening:          # (chat's; with return_token_ids the first carries the prompt's ids, as vLLM's)
            first_one = call.options.return_token_ids and choice["index"] == 0
            extra = {"prompt_token_ids": call.prompts[0]} if first_one else {}
            yield reply.chunk([choice], include_usage, call.usage(choice["index"]) if continuous else None, **extra)
        fmt, sent, first = formatter(call), [0] * call.choices, set()
        offsets = [0] * call.choices          # where each choice's next generated token's text starts
        options = call.options
        readers = [AnswerStream(options, call.prompts[k // call.n]) for k in range(call.choices)] \
            if options.tools is not None or options.reasoning is not None else None
        async for d in call.deltas():
            at = sent[d.index] if d.prompt else offsets[d.index]
            choice = reply.shape.delta(d.index, d.text, d.reason, fmt, d.tokens, d.entries, at, d.prompt)
            if readers is not None and not d.prompt:
                held = read_delta(choice, readers[d.index], d.text, d.ids)
                if held is None and options.return_token_ids and options.include_reasoning:   # ids go out, as vLLM's
                    choice["delta"], held = {}, choice
                choice = held
                if choice is None:            # text held back (a call being written): nothing to send yet
                    offsets[d.index] = at + fmt.text_length(d.tokens, d.entries)
                    sent[d.index] += len(d.text)
                    continue
            choice["stop_reason"] = d.stop_reason
            if options.return_token_ids:
                choice["token_ids"] = d.ids if options.include_reasoning else None
            if d.index not in first and reply.shape is COMPLETION:
                first.add(d.index)
                with_prompt_logprobs(choice, call, d.index)
                if options.return_token_ids:
                    choice["prompt_token_ids"] = call.prompts[d.index // call.n]
            sent[d.index] += len(d.text)
            offsets[d.index] = sent[d.index] if d.prompt else at + fmt.text_length(d.tokens, d.entries)
            yield reply.chunk([choice], include_usage, call.usage(d.index) if continuous else None)
        if include_usage:
            yield reply.chunk([], include_usage, call.usage())
    except Exception as exc:
        yield sse_error(exc)
    finally:
        call.cancel()
    yield DONE


@dataclass
class Collected:
    """Every choice of a call, whole (index: choice): its text, finish reason, stop reason (vLLM's), generated
    token ids and its deltas as (tokens, entries, offset, text length, prompt)."""
    texts: list[str]
    reasons: list[str | None]
    stop_reasons: list[str | int | None]
    ids: list[list[int]]
    deltas: list[list[tuple]]


async def collected(request: Request, call: ApiCall) -> Collected | None:
    """``call`` run to its end and every choice's text, or None when the client left first (then its
    requests are cancelled)."""
    n = call.choices
    got = Collected([""] * n, [None] * n, [None] * n, [[] for _ in range(n)], [[] for _ in range(n)])

    async def collect():
        async for d in call.deltas():
            got.deltas[d.index].append((d.tokens, d.entries, len(got.texts[d.index]), len(d.text), d.prompt))
            got.texts[d.index] += d.text
            got.ids[d.index] += d.ids
            if d.reason:
                got.reasons[d.index], got.stop_reasons[d.index] = d.reason, d.stop_reason

    collecting = asyncio.ensure_future(collect())
    watching = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not collecting.done():          # the client left (or this task was cancelled)
            collecting.cancel()
        call.cancel()                      # no-op for finished requests; frees a disconnected one's
    if not collecting.done() or collecting.cancelled():
        return None                        # nobody reads it
    collecting.result()                    # re-raises an ApiError from the engine side
    return got


async def whole(request: Request, call: ApiCall, reply: Reply) -> Response:
    """The whole text of every choice in one body, or 499 when the client left first."""
    got = await collected(request, call)
    if got is None:
        return Response(status_code=499)
    texts, reasons, stop_reasons, ids, deltas = got.texts, got.reasons, got.stop_reasons, got.ids, got.deltas
    fmt = formatter(call)
    choices = [{**reply.shape.choice(k, texts[k], reasons[k], fmt, deltas[k], call.options.role),
                "stop_reason": stop_reasons[k]} for k in range(call.choices)]
    options = call.options
    if options.tools is not None or options.reasoning is not None:   # the generated text read (chat); an echo first
        for k, choice in enumerate(choices):
            echo = sum(d[3] for d in deltas[k] if d[4])
            fields, choice["finish_reason"] = answer_fields(options, texts[k][echo:], reasons[k])
            if echo:
                fields["content"] = texts[k][:echo] + (fields["content"] or "")
            choice["message"] = {"role": choice["message"]["role"], **fields}
            if not options.include_reasoning:
                choice["logprobs"] = None
    extra = {}
    if options.return_token_ids:   # vLLM's: a choice's ids; the prompt's on each completion choice, beside chat's
        for k, choice in enumerate(choices):
            choice["token_ids"] = ids[k] if options.include_reasoning else None
            if reply.shape is COMPLETION:
                choice["prompt_token_ids"] = call.prompts[k // call.n]
        if reply.shape is not COMPLETION:
            extra["prompt_token_ids"] = call.prompts[0]
    if reply.shape is COMPLETION:
        choices = [with_prompt_logprobs(c, call, k) for k, c in enumerate(choices)]
    elif call.options.prompt_logprobs is not None:        # chat: vLLM puts them beside the choices
        extra["prompt_logprobs"] = prompt_logprobs(call.prompt_logprobs.get(0), call.options.prompt_logprobs)
    return JSONResponse(reply.body(reply.shape.object, choices, usage=call.usage(), **extra))


async def disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
