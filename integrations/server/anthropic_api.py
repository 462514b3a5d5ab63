"""Anthropic's Messages API, as vLLM serves it: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``
(clients: the ``anthropic`` SDK, Claude Code and agents written against it, pointed at this server).

A request becomes a chat completion the way vLLM converts it (``to_chat``): the top-level ``system`` (its text
blocks joined, Claude Code's per-request ``x-anthropic-billing-header`` block left out) as the first system
message; ``system`` messages in the list kept in place, or merged into the first one where the chat template
takes a system message only first (vLLM renders [system, user, system, user] to find out); text blocks as text
parts; ``thinking`` blocks of earlier answers dropped (no reasoning parser here); ``stop_sequences`` as
``stop``; ``output_config.format`` as a JSON-schema ``response_format``; ``thinking: {"type": "disabled"}`` as
``reasoning_effort: "none"``; ``tools`` with ``tool_choice: {"type": "none"}`` handed to the chat template in
OpenAI's form. Other tool use, tool results and images are refused by name, as the chat endpoint refuses them.
The answer is Anthropic's message (``stop_reason`` end_turn / max_tokens / stop_sequence) or its event stream
(message_start, one text block's start, deltas and stop (none for an empty text, as vLLM's), message_delta with
the stop reason and usage, message_stop). Errors answer Anthropic's body ``{"type": "error", "error": {"type",
"message"}}``.
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
from .vllm_fields import TOOLS
from .responses import STREAM_HEADERS, collected

BILLING_HEADER = "x-anthropic-billing-header"      # Claude Code's per-request hash (vLLM drops it: prefix caching)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 499: "invalid_request_error", 500: "api_error",
               503: "overloaded_error"}
TOOL_BLOCKS = ("tool_use", "tool_result", "tool_reference", "server_tool_use", "web_search_tool_result",
               "mcp_tool_use", "mcp_tool_result")
SKIPPED_BLOCKS = ("thinking", "redacted_thinking")     # a client sends its earlier answers back whole


class AnthropicBlock(Body):
    type: str
    text: Optional[str] = None
    thinking: Optional[str] = None       # the fields of the blocks that are read or skipped, so as not to log them
    signature: Optional[str] = None
    data: Optional[str] = None
    cache_control: Optional[dict[str, Any]] = None     # a prompt-caching hint (prefix caching here is automatic)
    citations: Optional[Any] = None
    source: Optional[Any] = None         # an image's or document's (refused by name, not logged as unknown first)
    id: Optional[str] = None             # tool blocks' (refused by name)
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
    """A block's text; None for a block that is skipped (an empty text too, as vLLM's); refused: tool and media
    blocks."""
    if block.type == "text":
        return block.text or None
    if block.type in SKIPPED_BLOCKS:
        return None
    if block.type in TOOL_BLOCKS:
        raise ApiError(400, f"{where} is a {block.type!r} block: tool calling is not supported by this server "
                            "(vLLM parses tool calls with model-specific parsers); send the tool's text as a text "
                            "block instead", param=where)
    raise ApiError(400, f"{where} is a {block.type!r} block: this server runs text-only models, whose messages take "
                        "'text' blocks only", param=where)


def _texts(content, where: str, system: bool = False) -> list[str]:
    """The texts of a message's content (a system message's without Claude Code's billing header)."""
    texts = [content] if isinstance(content, str) else [_block_text(b, f"{where}.{i}") for i, b in enumerate(content)]
    return [t for t in texts if t is not None and not (system and t.startswith(BILLING_HEADER))]


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
        elif m.role == "user" and not texts and not isinstance(m.content, str):
            continue                                   # vLLM drops a user turn left without content
        else:
            content = texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts] or None
            out.append({"role": m.role, "content": content})
    return ([{"role": "system", "content": "".join(system)}] if system else []) + out


def to_chat(req: _Common, state, stream: bool = False) -> ChatCompletionRequest:
    """``req`` as the chat completion vLLM makes of it, checked as the chat endpoint checks one."""
    chat = {"model": req.model, "messages": chat_messages(req, state)}
    if req.tools:
        if req.tool_choice is None or req.tool_choice.type != "none":
            raise ApiError(400, f"tools are not supported unless tool_choice is {{\"type\": \"none\"}}: {TOOLS}",
                           param="tools")
        chat.update(tool_choice="none", tools=[{"type": "function", "function": {   # the template sees them, as vLLM's
            "name": t.name, "description": t.description, "parameters": t.input_schema}} for t in req.tools])
    if req.chat_template_kwargs:
        chat["chat_template_kwargs"] = req.chat_template_kwargs
    thinking = req.thinking.type if req.thinking else None
    if thinking == "enabled":
        raise ApiError(400, "thinking type 'enabled' (a thinking budget) needs a reasoning parser, which this "
                            "server does not have; leave thinking out or set it 'disabled'", param="thinking.type")
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


def stop_reason(reason: str | None, stop: str | int | None) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for the chat answer's finish reason and vLLM's stop reason."""
    if reason == "length":
        return "max_tokens", None
    if reason != "stop":
        return None, None
    return ("stop_sequence", stop) if isinstance(stop, str) else ("end_turn", None)


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
    reason, sequence = stop_reason(got.reasons[0], got.stop_reasons[0])
    return JSONResponse({"id": message_id, "type": "message", "role": "assistant",
                         "content": [{"type": "text", "text": got.texts[0]}], "model": state.name,
                         "stop_reason": reason, "stop_sequence": sequence, "usage": usage(call)})


def event(kind: str, body: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=False)}\n\n"


async def events(call, message_id: str, model: str):
    """Anthropic's event stream of one answer (its text block opened with the first text: an empty answer has
    none, as vLLM's stream)."""
    try:
        yield event("message_start", {"message": {
            "id": message_id, "type": "message", "role": "assistant", "content": [], "model": model,
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": call.prompt_tokens, "output_tokens": 0}}})
        reason = sequence = None
        opened = False
        async for d in call.deltas():
            if d.text:
                if not opened:
                    opened = True
                    yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                yield event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": d.text}})
            if d.reason:
                reason, sequence = stop_reason(d.reason, d.stop_reason)
        if opened:
            yield event("content_block_stop", {"index": 0})
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
