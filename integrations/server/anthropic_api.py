"""Anthropic's Messages API, as vLLM serves it: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``
(clients: the ``anthropic`` SDK, Claude Code and agents written against it, pointed at this server).

A request becomes a chat completion the way vLLM converts it (``to_chat``): the top-level ``system`` (its text
blocks joined, Claude Code's per-request ``x-anthropic-billing-header`` block left out) as the first system message;
``system`` messages in the list kept in place, or merged into the first one where the chat template takes a system
message only first (vLLM renders [system, user, system, user] to find out); text blocks as text parts; an
assistant's ``thinking`` blocks joined as its ``reasoning`` (signatures unchecked, ``redacted_thinking`` dropped, as
vLLM's); ``stop_sequences`` as ``stop``; ``output_config.format`` as a JSON-schema ``response_format``; ``thinking:
{"type": "disabled"}`` as ``reasoning_effort: "none"``, ``{"type": "enabled", "budget_tokens": N}`` as vLLM's
``thinking_token_budget`` (``--reasoning-parser``: at most N thinking tokens, then ``</think>``); ``tools`` as
OpenAI function tools and ``tool_choice`` auto / any / tool / none as chat's auto / required / named / none
(``disable_parallel_tool_use`` as ``parallel_tool_calls: false``); an assistant's ``tool_use`` blocks as its
``tool_calls``, a user's ``tool_result`` blocks as ``tool`` messages before the user's text. Tool calling needs the
chat endpoint's flags (``--enable-auto-tool-choice --tool-call-parser``). Server and MCP tool blocks and images are
refused by name. The answer is Anthropic's message (a ``thinking`` block where a reasoning parser split thinking
off, with a random signature as vLLM's; text, then a ``tool_use`` block per call; ``stop_reason`` end_turn /
max_tokens / stop_sequence / tool_use, as vLLM maps them) or its event stream (message_start; thinking, text and
tool_use blocks, each started, its deltas (``thinking_delta`` and a ``signature_delta`` before it stops,
``text_delta``, ``input_json_delta``) and stopped, none for an empty text, as vLLM's; message_delta with the stop
reason and usage; message_stop). Errors answer Anthropic's body ``{"type": "error", "error": {"type", "message"}}``.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Literal, Optional, Union

import jinja2.ext
import jinja2.sandbox
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field

from .body import read_json
from .errors import ApiError, as_api_error
from .intake import chat_prompt, chat_request, start_chat_call
from .protocol import ChatCompletionRequest
from .request_parts import Body
from .responses import STREAM_HEADERS, AnswerStream, answer_fields, collected

BILLING_HEADER = "x-anthropic-billing-header"      # Claude Code's per-request hash (vLLM drops it: prefix caching)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 499: "invalid_request_error", 500: "api_error",
               503: "overloaded_error"}
SERVER_TOOL_BLOCKS = ("server_tool_use", "web_search_tool_result", "mcp_tool_use", "mcp_tool_result")
SKIPPED_BLOCKS = ("thinking", "redacted_thinking")     # a client sends its earlier answers back whole (thinking: read
                                                       # as the assistant's reasoning, not as text)


class AnthropicBlock(Body):
    type: str
    text: Optional[str] = None
    thinking: Optional[str] = None       # the fields of the blocks that are read or skipped, so as not to log them
    signature: Optional[str] = None
    data: Optional[str] = None
    cache_control: Optional[dict[str, Any]] = None     # a prompt-caching hint (prefix caching here is automatic)
    citations: Optional[Any] = None
    source: Optional[Any] = None         # an image's or document's (refused by name, not logged as unknown first)
    id: Optional[str] = None             # tool_use and tool_result blocks'
    name: Optional[str] = None
    input: Optional[Any] = None
    tool_use_id: Optional[str] = None
    content: Optional[Any] = None
    is_error: Optional[bool] = None


class AnthropicMessage(Body):
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[AnthropicBlock]]


class AnthropicTool(Body):
    name: str
    description: Optional[str] = None
    input_schema: dict[str, Any]
    strict: Optional[bool] = None
    cache_control: Optional[dict[str, Any]] = None


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class Thinking(Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = None
    display: Optional[str] = None


class JsonFormat(Body):
    type: Literal["json_schema"] = "json_schema"
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")


class OutputConfig(Body):
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None
    format: Optional[JsonFormat] = None


class _Common(Body):
    """The fields count_tokens shares with a message request."""
    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Optional[Union[str, list[AnthropicBlock]]] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    output_config: Optional[OutputConfig] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class MessagesRequest(_Common):
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = None
    stream: Optional[bool] = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    metadata: Optional[dict[str, Any]] = None     # Anthropic's user id: no effect here
    service_tier: Optional[str] = None             # an Anthropic account feature: no effect here


def error_response(exc: ApiError) -> JSONResponse:
    """Anthropic's error body for ``exc`` (the status kept)."""
    body = {"type": "error", "error": {"type": ERROR_TYPES.get(exc.status, "api_error"), "message": exc.message}}
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def _block_text(block: AnthropicBlock, where: str) -> str | None:
    """A block's text; None for a block that is skipped (an empty text too, as vLLM's, and the tool blocks
    ``_tool_parts`` reads); refused: server tool and media blocks."""
    if block.type == "text":
        return block.text or None
    if block.type in SKIPPED_BLOCKS or block.type in ("tool_use", "tool_result", "tool_reference"):
        return None
    if block.type in SERVER_TOOL_BLOCKS:
        raise ApiError(400, f"{where} is a {block.type!r} block: server and MCP tools are not run by this server; "
                            "send the result as a text block", param=where)
    raise ApiError(400, f"{where} is a {block.type!r} block: this server runs text-only models, whose messages take "
                        "'text' blocks only", param=where)


def _texts(content, where: str, system: bool = False) -> list[str]:
    """The texts of a message's content (a system message's without Claude Code's billing header)."""
    texts = [content] if isinstance(content, str) else [_block_text(b, f"{where}.{i}") for i, b in enumerate(content)]
    return [t for t in texts if t is not None and not (system and t.startswith(BILLING_HEADER))]


def _tool_parts(message: AnthropicMessage, where: str) -> tuple[list[dict], list[dict]]:
    """(the chat tool_calls of an assistant's tool_use blocks, the tool messages of a user's tool_result blocks),
    as vLLM converts them: a call's input as JSON arguments, a result's text blocks joined by newlines."""
    calls, results = [], []
    for i, block in enumerate([] if isinstance(message.content, str) else message.content):
        if block.type == "tool_use":
            calls.append({"id": block.id or "", "type": "function",
                          "function": {"name": block.name or "", "arguments": json.dumps(block.input or {})}})
        elif block.type == "tool_result":
            results.append({"role": "tool", "tool_call_id": block.tool_use_id or "",
                            "content": _result_text(block.content, f"{where}.{i}.content")})
    return (calls, []) if message.role == "assistant" else ([], results)


def _result_text(content, where: str) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    texts = []
    for j, item in enumerate(content if isinstance(content, list) else []):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "text":
            texts.append(item.get("text") or "")
        elif kind not in ("tool_reference", None):
            raise ApiError(400, f"{where}.{j} is a {kind!r} block: this server runs text-only models; a tool result "
                                "takes 'text' blocks", param=f"{where}.{j}")
    return "\n".join(texts)


def takes_system_first(state) -> bool:
    """``system_first`` of the served tokenizer's template, probed once."""
    if state.system_first is None:
        state.system_first = system_first(str(getattr(state.tokenizer, "chat_template", None) or ""))
    return state.system_first


def system_first(template: str) -> bool:
    """Whether ``template`` takes a system message only first (it fails on [system, user, system, user])."""
    try:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols])
        env.from_string(template).render(messages=[{"role": r, "content": "t"} for r in ("system", "user") * 2],
                                         add_generation_prompt=False)
        return False
    except jinja2.TemplateError:
        return True


def chat_messages(req: _Common, state) -> list[dict]:
    """The chat messages vLLM's conversion makes of ``req``'s system and messages."""
    system = _texts(req.system, "system", system=True) if req.system else []
    merge = any(m.role == "system" for m in req.messages) and takes_system_first(state)
    out = []
    for i, m in enumerate(req.messages):
        texts = _texts(m.content, f"messages.{i}.content", system=m.role == "system")
        if m.role == "system":
            if merge:
                system += texts
            elif "".join(texts):
                out.append({"role": "system", "content": "".join(texts)})
            continue
        calls, results = _tool_parts(m, f"messages.{i}.content")
        out += results                                 # a user's tool results come before its text, as vLLM's
        if m.role == "user" and not texts and not isinstance(m.content, str):
            continue                                   # vLLM drops a user turn left without content
        content = texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts] or None
        thinking = [b.thinking or "" for b in m.content if b.type == "thinking"] \
            if m.role == "assistant" and not isinstance(m.content, str) else []
        out.append({"role": m.role, "content": content, **({"tool_calls": calls} if calls else {}),
                    **({"reasoning": "".join(thinking)} if thinking else {})})
    return ([{"role": "system", "content": "".join(system)}] if system else []) + out


def to_chat(req: _Common, state, stream: bool = False) -> ChatCompletionRequest:
    """``req`` as the chat completion vLLM makes of it, checked as the chat endpoint checks one."""
    chat = {"model": req.model, "messages": chat_messages(req, state)}
    if req.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema,
                                                           **({"strict": t.strict} if t.strict is not None else {})}}
                         for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        chat["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool" else
                               {"auto": "auto", "any": "required", "none": "none"}[choice.type])
        chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if req.chat_template_kwargs:
        chat["chat_template_kwargs"] = req.chat_template_kwargs
    thinking = req.thinking.type if req.thinking else None
    if thinking == "enabled":                       # vLLM's thinking_token_budget (it needs --reasoning-parser)
        budget = req.thinking.budget_tokens
        if not isinstance(budget, int) or budget < 1024:
            raise ApiError(400, "thinking.budget_tokens must be an integer >= 1024", param="thinking.budget_tokens")
        if isinstance(req, MessagesRequest) and budget >= req.max_tokens:
            raise ApiError(400, "thinking.budget_tokens must be less than max_tokens", param="thinking.budget_tokens")
        chat["thinking_token_budget"] = budget
    if thinking == "disabled":
        chat["reasoning_effort"] = "none"
    config = req.output_config
    if config is not None and config.effort is not None:
        chat["reasoning_effort"] = config.effort
    if config is not None and config.format is not None and config.format.schema_ is not None:
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "json_schema", "schema": config.format.schema_}}
    if isinstance(req, MessagesRequest):
        chat.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                    top_p=req.top_p, top_k=req.top_k, stream=stream)
    return chat_request(chat, state)


def stop_reason(reason: str | None, stop: str | int | None, tool_used: bool = False,
                tool_complete: bool = False) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for the chat answer's finish reason and vLLM's stop reason, as
    vLLM maps them: max_tokens first; tool_use where the calls are complete (whole JSON arguments), else a stop
    string's stop_sequence, else tool_use where a call was made (a named one ends "stop"), else end_turn."""
    if reason == "length":
        return "max_tokens", None
    if reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return ("tool_use", None) if reason == "tool_calls" or tool_used else ("end_turn", None)


def content_blocks(fields: dict) -> list[dict]:
    """A chat message's reasoning, content and tool calls as Anthropic's blocks (one empty text block for none, as
    vLLM's; a thinking block's signature is random, as vLLM's, which checks none)."""
    blocks = [{"type": "thinking", "thinking": fields["reasoning"], "signature": uuid.uuid4().hex}] \
        if fields.get("reasoning") else []
    blocks += [{"type": "text", "text": fields["content"]}] if fields.get("content") else []
    blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                "input": json.loads(c["function"]["arguments"])} for c in fields.get("tool_calls") or []]
    return blocks or [{"type": "text", "text": ""}]


def usage(call) -> dict:
    u = call.usage()
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"]}


# the chat completion's field names in its errors, as this API names them
PARAMS = {"stop": "stop_sequences", "prompt": "messages", "max_completion_tokens": "max_tokens"}


def error_response_of(exc: BaseException, where: str) -> JSONResponse:
    """Anthropic's error body for any failure of a handler (an unexpected one: 500, logged)."""
    exc = as_api_error(exc, where)
    if exc.param in PARAMS:
        exc.param = PARAMS[exc.param]
    return error_response(exc)


async def messages(request: Request):
    state = request.app.state.server
    try:
        req = await read_json(request, MessagesRequest, state.config.max_body_bytes)
        chat = to_chat(req, state, stream=bool(req.stream))
        call = await start_chat_call(state, chat)
    except Exception as exc:
        return error_response_of(exc, "on /v1/messages")
    message_id = "msg_" + uuid.uuid4().hex
    if req.stream:
        return StreamingResponse(events(call, message_id, state.name), media_type="text/event-stream",
                                 headers=STREAM_HEADERS)
    try:
        got = await collected(request, call)
    except Exception as exc:
        return error_response_of(exc, "on /v1/messages")
    if got is None:
        return Response(status_code=499)
    fields, finish = answer_fields(call.options, got.texts[0], got.reasons[0])
    called = bool(fields.get("tool_calls"))
    reason, sequence = stop_reason(finish, got.stop_reasons[0], called, called)
    return JSONResponse({"id": message_id, "type": "message", "role": "assistant", "content": content_blocks(fields),
                         "model": state.name, "stop_reason": reason, "stop_sequence": sequence, "usage": usage(call)})


def event(kind: str, body: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=False)}\n\n"


class Blocks:
    """The content blocks of one streamed answer, as vLLM's stream converter opens and closes them: thinking goes
    to a thinking block (closed with a random signature's ``signature_delta``), text deltas to a text block (text
    that comes while a tool_use block is open waits for it to close), each call opens a tool_use block (its id and
    name, ``input: {}``) whose arguments follow as ``input_json_delta``s."""

    def __init__(self):
        self.index, self.kind, self.pending, self.arguments = -1, None, [], []
        self.tool_used = False

    def _start(self, block: dict) -> list[str]:
        self.index, self.kind = self.index + 1, block["type"]
        return [event("content_block_start", {"index": self.index, "content_block": block})]

    def stop(self) -> list[str]:
        """Close the open block (and send the text that waited for a tool_use block to close)."""
        out = [event("content_block_delta", {"index": self.index, "delta": {
            "type": "signature_delta", "signature": uuid.uuid4().hex}})] if self.kind == "thinking" else []
        out += [event("content_block_stop", {"index": self.index})] if self.kind else []
        self.kind = None
        if self.pending:
            text, self.pending = "".join(self.pending), []
            out += self.text(text) + self.stop()
        return out

    def text(self, text: str) -> list[str]:
        if not text:
            return []
        if self.kind == "tool_use":
            self.pending.append(text)
            return []
        out = [] if self.kind == "text" else self.stop() + self._start({"type": "text", "text": ""})
        delta = {"type": "text_delta", "text": text}
        return out + [event("content_block_delta", {"index": self.index, "delta": delta})]

    def thinking(self, text: str) -> list[str]:
        if not text:
            return []
        out = [] if self.kind == "thinking" else self.stop() + self._start({"type": "thinking", "thinking": ""})
        return out + [event("content_block_delta", {"index": self.index,
                                                    "delta": {"type": "thinking_delta", "thinking": text}})]

    def call(self, delta: dict) -> list[str]:
        """One chat tool-call delta: a name opens a tool_use block, arguments extend it."""
        out = []
        function = delta.get("function") or {}
        if function.get("name") is not None:
            out += self.stop() + self._start({"type": "tool_use", "id": delta["id"], "name": function["name"],
                                              "input": {}})
            self.tool_used, self.arguments = True, []
        if function.get("arguments") and self.kind == "tool_use":
            self.arguments.append(function["arguments"])
            out.append(event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": function["arguments"]}}))
        return out

    def complete(self) -> bool:
        """The last call's arguments are whole JSON (a call cut short must not run: vLLM's rule)."""
        try:
            json.loads("".join(self.arguments))
            return self.tool_used
        except ValueError:
            return False


async def events(call, message_id: str, model: str):
    """Anthropic's event stream of one answer (a text block opened with the first text: an empty answer has
    none, as vLLM's stream; a tool_use block per call where the request has tool calling)."""
    try:
        yield event("message_start", {"message": {
            "id": message_id, "type": "message", "role": "assistant", "content": [], "model": model,
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": call.prompt_tokens, "output_tokens": 0}}})
        reason = sequence = None
        tools, blocks = call.options.tools, Blocks()
        reader = AnswerStream(call.options, call.prompts[0])
        async for d in call.deltas():
            out = reader.feed(d.text, d.ids, last=bool(d.reason))
            for piece in blocks.thinking(out.get("reasoning") or ""):
                yield piece
            for piece in blocks.text(out.get("content") or ""):
                yield piece
            for delta in out.get("tool_calls") or []:
                for piece in blocks.call(delta):
                    yield piece
            if d.reason:
                finish = tools.stream_reason(reader.called, d.reason) if tools is not None else d.reason
                reason, sequence = stop_reason(finish, d.stop_reason, blocks.tool_used, blocks.complete())
        for piece in blocks.stop():
            yield piece
        yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": usage(call)})
        yield event("message_stop", {})
    except Exception as exc:
        exc = as_api_error(exc)
        yield event("error", {"error": {"type": ERROR_TYPES.get(exc.status, "api_error"), "message": exc.message}})
    finally:
        call.cancel()


async def count_tokens(request: Request):
    """The prompt's tokens as ``/v1/messages`` would run it (vLLM's answer, with its context_management)."""
    state = request.app.state.server
    try:
        req = await read_json(request, _Common, state.config.max_body_bytes)
        prompt = await state.off_loop(chat_prompt, state, to_chat(req, state))
    except Exception as exc:
        return error_response_of(exc, "on /v1/messages/count_tokens")
    return {"input_tokens": len(prompt), "context_management": {"original_input_tokens": len(prompt)}}
