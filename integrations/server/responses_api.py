"""OpenAI's Responses API, as vLLM serves it without its response store (its default): ``POST /v1/responses``
(whole or streamed), ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` (nothing is stored, so
both answer 404, as vLLM's do). Clients: ``client.responses.create`` of the ``openai`` SDK, and agents written
against it. A request becomes a chat completion as vLLM renders it (``to_chat``): ``instructions`` as the first
system message, ``input`` (a text: one user message; or items: messages whose text parts are joined, an
assistant item's first part taken, a reasoning item an assistant turn of its own unless folded into the assistant
message next to it, as vLLM's) in order; a last assistant item that is
``in_progress`` or ``incomplete`` is continued rather than answered; ``max_output_tokens`` as max_tokens;
``text.format`` as a ``response_format``; ``include: ["message.output_text.logprobs"]`` with ``top_logprobs`` as
chat logprobs; ``reasoning.effort`` as ``reasoning_effort``; ``truncation: "auto"`` as truncate_prompt_tokens
-1; function ``tools`` and ``tool_choice`` (auto, required, none, ``{"type": "function", "name": ...}``) as
chat's, ``function_call`` input items as the assistant's tool calls (joined to the assistant message before them,
as vLLM's) and ``function_call_output`` items as tool messages (tool calling needs the chat endpoint's flags);
vLLM's sampling fields as they are. ``store`` has no effect (vLLM's default); ``previous_response_id`` answers
404 and ``background`` 400, as vLLM's do without ``VLLM_ENABLE_RESPONSES_API_STORE``. Hosted and custom tools,
their items and images are refused by name. The answer is one ``message`` output item with one
``output_text`` part (none for an empty text, and streamed no item at all, as vLLM's), then a ``function_call``
item per call (where calls were made, the message only if it has text), ``status`` "incomplete" with
``incomplete_details.reason`` "max_output_tokens" where the length ended it, or the event stream vLLM sends
(response.created, .in_progress, .output_item.added, .content_part.added, .output_text.delta...,
.output_text.done, .content_part.done, .output_item.done; per call .output_item.added,
.function_call_arguments.delta..., .function_call_arguments.done, .output_item.done; response.completed).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field

from .body import read_json
from .errors import ApiError, as_api_error, error_response
from .intake import chat_request, start_chat_call
from .protocol import ChatCompletionRequest
from .request_parts import Body, StructuredOutputsParams
from .responses import STREAM_HEADERS, AnswerStream, answer_fields, collected, formatter

LOGPROBS = "message.output_text.logprobs"
NAMESPACE_SEPARATOR = "__"        # a namespaced function's flat name: namespace__name (vLLM's)
TEXT_PARTS = ("input_text", "output_text", "text")
TOOL_ITEMS = ("custom_tool_call", "custom_tool_call_output", "mcp_call", "web_search_call", "file_search_call",
              "computer_call", "computer_call_output", "code_interpreter_call", "local_shell_call",
              "local_shell_call_output", "image_generation_call")
# the chat fields whose values pass through unchanged (vLLM's sampling fields of the Responses request)
PASSED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
          "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "include_stop_str_in_output",
          "skip_special_tokens", "structured_outputs", "chat_template_kwargs", "include_reasoning")


class InputPart(Body):
    type: str
    text: Optional[str] = None
    annotations: Optional[list[Any]] = None     # an earlier answer's output_text, sent back whole
    logprobs: Optional[list[Any]] = None


class InputItem(Body):
    type: Optional[str] = None                 # "message" where absent (an easy input message)
    role: Optional[str] = None
    content: Optional[Union[str, list[InputPart]]] = None
    status: Optional[str] = None
    id: Optional[str] = None
    summary: Optional[list[Any]] = None        # a reasoning item's (read where it has no content)
    encrypted_content: Optional[str] = None
    call_id: Optional[str] = None              # function_call and function_call_output items'
    name: Optional[str] = None
    arguments: Optional[str] = None
    output: Optional[Any] = None
    namespace: Optional[str] = None


class TextFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(Body):
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None            # a hint to OpenAI's models: no effect here


class Reasoning(Body):
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None
    summary: Optional[str] = None
    generate_summary: Optional[str] = None


class ResponsesRequest(Body):
    model: Optional[str] = None
    input: Union[str, list[InputItem]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    stream: Optional[bool] = False
    store: Optional[bool] = True
    background: Optional[bool] = False
    previous_response_id: Optional[str] = None
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = Field(0, ge=0, le=20)
    text: Optional[TextConfig] = None
    reasoning: Optional[Reasoning] = None
    truncation: Optional[Literal["auto", "disabled"]] = "disabled"
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = "auto"
    parallel_tool_calls: Optional[bool] = True
    max_tool_calls: Optional[int] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    service_tier: Optional[str] = "auto"
    prompt_cache_key: Optional[str] = None     # OpenAI's routing hint: no effect here
    safety_identifier: Optional[str] = None
    # vLLM's sampling fields
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: Optional[StructuredOutputsParams] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    include_reasoning: Optional[bool] = None   # vLLM's: false leaves the reasoning item out
    request_id: Optional[str] = None           # vLLM's: the response's id when given


def input_messages(items: list[InputItem]) -> list[dict]:
    """The chat messages of the input items, as vLLM's ``construct_chat_messages_with_tool_call`` makes them: a
    reasoning item is an assistant turn's ``reasoning`` (its first reasoning_text part, else its first summary's
    text), folded into the assistant message just before it, else opening one that the next assistant message's
    text fills."""
    messages, thinking = [], []         # thinking[k]: message k is an assistant turn that holds a reasoning item
    for i, item in enumerate(items):
        before = len(messages) and messages[-1]["role"] == "assistant"
        if (item.type or "message") == "reasoning":
            if item.encrypted_content:
                raise ApiError(400, "encrypted reasoning content is not supported", param=f"input.{i}")
            if not (before and not thinking[-1]):
                messages.append({"role": "assistant", "content": None})
                thinking.append(True)
            thinking[-1] = True
            messages[-1]["reasoning"] = _reasoning_text(item)
            continue
        if item.type == "function_call":         # joined to the assistant message before it, as vLLM's
            call = _tool_call(item, i)
            if before:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                thinking.append(False)
            continue
        if item.type == "function_call_output":
            if not isinstance(item.call_id, str):
                raise ApiError(400, f"input.{i}: a function_call_output item needs its call_id", param=f"input.{i}")
            output = item.output if isinstance(item.output, str) else _output_text(item.output, i)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
            thinking.append(False)
            continue
        message = _item_message(item, i)
        if message["role"] == "assistant" and before and messages[-1]["content"] is None:
            messages[-1]["content"] = message["content"]
            continue
        messages.append(message)
        thinking.append(False)
    return messages


def _reasoning_text(item: InputItem) -> str:
    """A reasoning input item's text (vLLM's: its first content part's, else its first summary's, else none)."""
    parts = item.content if isinstance(item.content, list) else []
    if parts:
        return parts[0].text or ""
    first = (item.summary or [None])[0]
    return (first.get("text") if isinstance(first, dict) else None) or ""


def _output_text(parts, i: int) -> str:
    """A function_call_output's parts as text (joined by newlines); an image or a file is refused, as the model
    is text-only (vLLM refuses them too)."""
    texts = []
    for j, part in enumerate(parts if isinstance(parts, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise ApiError(400, f"input.{i}.output.{j} has type {kind!r}: this server runs text-only models, whose "
                                f"tool results take parts of type {' / '.join(TEXT_PARTS)} only",
                           param=f"input.{i}.output.{j}")
        texts.append(part.get("text") or "")
    return "\n".join(texts)


def flat_name(namespace: str | None, name: str) -> str:
    """A namespaced function's name as the template and the parser see it: ``namespace__name`` (vLLM's)."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


def _tool_call(item: InputItem, i: int) -> dict:
    """A function_call input item as a chat tool call (a namespaced tool's name flattened, ``flat_name``)."""
    if not (isinstance(item.call_id, str) and isinstance(item.name, str) and isinstance(item.arguments, str)):
        raise ApiError(400, f"input.{i}: a function_call item needs call_id, name and arguments (a JSON text)",
                       param=f"input.{i}")
    name = flat_name(item.namespace, item.name)
    return {"id": item.call_id, "type": "function", "function": {"name": name, "arguments": item.arguments}}


def _item_message(item: InputItem, i: int) -> dict:
    """The chat message of input item ``i`` (not a reasoning item)."""
    kind = item.type or "message"
    where = f"input.{i}"
    if kind in TOOL_ITEMS or item.role == "tool":
        what = f"a {kind!r} item" if kind in TOOL_ITEMS else "a message of role 'tool'"
        raise ApiError(400, f"{where} is {what}: this API takes function tools only, their calls as function_call "
                            "items and their results as function_call_output items", param=where)
    if kind != "message" or item.role is None:
        raise ApiError(400, f"{where}: an item of type {kind!r} is not supported (messages with a role and text "
                            "only; item references need a response store, which this server does not keep)",
                       param=where)
    content = item.content
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.type not in TEXT_PARTS:
                raise ApiError(400, f"{where}.content.{j} has type {part.type!r}: this server runs text-only "
                                    f"models, whose messages take parts of type {' / '.join(TEXT_PARTS)} only",
                               param=f"{where}.content.{j}")
        texts = [p.text or "" for p in content]
        content = (texts[:1] if item.role == "assistant" else texts) or None     # vLLM: an assistant's first part
        content = None if content is None else "\n".join(content)
    return {"role": item.role, "content": content}


def to_chat(req: ResponsesRequest, state) -> ChatCompletionRequest:
    """``req`` as the chat completion vLLM renders it, checked as the chat endpoint checks one."""
    functions = function_tools(req.tools)
    if req.previous_response_id is not None:
        raise ApiError(404, f"Response with id '{req.previous_response_id}' not found. (this server stores no "
                            "responses, as vLLM without VLLM_ENABLE_RESPONSES_API_STORE: send the conversation "
                            "as input items)", param="previous_response_id")
    if req.background:
        raise ApiError(400, "background mode needs a response store (and store=true), which this server does not "
                            "keep (vLLM: VLLM_ENABLE_RESPONSES_API_STORE=1)", param="background")
    if req.input == []:
        raise ApiError(400, "input is an empty list: give a text or at least one message item", param="input")
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else \
        input_messages(req.input)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + items
    last = None if isinstance(req.input, str) or not req.input else req.input[-1]
    partial = last is not None and ((last.type or "message") == "reasoning" or last.role == "assistant") \
        and last.status in ("in_progress", "incomplete")
    chat = {name: getattr(req, name) for name in PASSED}
    if functions:                      # chat's form: the template sees them, the parser reads the calls
        chat.update(tools=[{"type": "function", "function": f} for f in functions.values()],
                    tool_choice=_chat_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls)
    chat.update(messages=messages, max_tokens=req.max_output_tokens, stream=bool(req.stream),
                continue_final_message=partial, add_generation_prompt=not partial)
    if req.include and LOGPROBS in req.include:
        chat.update(logprobs=True, top_logprobs=req.top_logprobs)
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type != "text":
        if req.structured_outputs is not None:
            raise ApiError(400, "Cannot specify both structured_outputs and text.format", param="structured_outputs")
        chat["response_format"] = {"type": "json_object"} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": fmt.name or "json_schema", "schema": fmt.schema_}}
    if req.reasoning is not None and req.reasoning.effort is not None:
        chat["reasoning_effort"] = req.reasoning.effort
    if req.truncation == "auto":
        chat["truncate_prompt_tokens"] = -1
    return chat_request(chat, state)


def function_tools(tools: list | None) -> dict[str, dict]:
    """The request's function tools as chat functions, by the name the model calls them: a ``namespace`` tool's
    functions flattened to ``namespace__name`` (vLLM's). Hosted, MCP and custom tools are refused by name."""
    out = {}
    for i, tool in enumerate(tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        inner = tool.get("tools") if kind == "namespace" else [tool]
        if kind not in ("function", "namespace") or not isinstance(inner, list) or \
                any(not isinstance(t, dict) or t.get("type") != "function" for t in inner):
            raise ApiError(400, f"tools.{i} is a {kind!r} tool: this server runs function tools (alone or in a "
                                "namespace) only; hosted, MCP and custom tools are not run here", param=f"tools.{i}")
        for t in inner:
            function = {k: v for k, v in t.items() if k != "type"}
            function["name"] = flat_name(tool.get("name") if kind == "namespace" else None, str(t.get("name")))
            out[function["name"]] = function
    return out


def _chat_tool_choice(choice):
    """The Responses API's tool_choice as chat's (a function named at the top level, not under "function")."""
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ApiError(400, f"tool_choice {json.dumps(choice)[:80]}: only \"auto\", \"required\", \"none\" or "
                                "{\"type\": \"function\", \"name\": ...} (function tools)", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


class Answer:
    """The response object of one call, built up as it runs."""

    def __init__(self, req: ResponsesRequest, chat: ChatCompletionRequest, state, call):
        self.req, self.call, self.model = req, call, state.name
        self.id = req.request_id or "resp_" + uuid.uuid4().hex
        self.item_id = "msg_" + uuid.uuid4().hex
        self.created = int(time.time())
        defaults = state.defaults
        self.temperature = chat.temperature if chat.temperature is not None else defaults.temperature
        self.top_p = chat.top_p if chat.top_p is not None else defaults.top_p
        # what the engine runs at most: max_tokens, trimmed to the room the prompt leaves (vLLM's answer too)
        self.max_tokens = min(call.params.max_new_tokens, state.max_model_len - call.prompt_tokens)
        self.logprobs = req.top_logprobs if chat.logprobs else None

    def body(self, status: str, output: list, usage: dict | None) -> dict:
        req = self.req
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": req.instructions, "metadata": req.metadata, "model": self.model, "output": output,
                "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
                "temperature": self.temperature, "tool_choice": req.tool_choice if req.tools else "none",
                "tools": req.tools or [], "top_p": self.top_p,
                "background": bool(req.background), "max_output_tokens": self.max_tokens,
                "max_tool_calls": req.max_tool_calls, "previous_response_id": None,
                "reasoning": req.reasoning.model_dump() if req.reasoning else None, "service_tier": req.service_tier,
                "store": False, "text": req.text.model_dump(by_alias=True, exclude_none=True) if req.text else None,
                "top_logprobs": self.logprobs, "truncation": req.truncation, "usage": usage, "user": req.user}

    def usage(self) -> dict:
        u = self.call.usage()
        cached = sum(self.call.cached_tokens)          # prompt tokens the prefix cache held
        return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": u["completion_tokens"], "output_tokens_details": {
                    "reasoning_tokens": u.get("completion_tokens_details", {}).get("reasoning_tokens", 0)},
                "total_tokens": u["total_tokens"]}

    def part(self, text: str, logprobs: list | None) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def item(self, status: str, content: list) -> dict:
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant", "content": content}

    def reasoning(self, item_id: str, text: str | None, status: str | None) -> dict:
        """A reasoning output item (vLLM's: its text one reasoning_text part, no summary; None: none yet)."""
        return {"id": item_id, "type": "reasoning", "summary": [], "encrypted_content": None, "status": status,
                "content": None if text is None else [{"type": "reasoning_text", "text": text}]}

    def function_call(self, item_id: str, call: dict, status: str) -> dict:
        """A function_call output item of a chat tool call (its id the call_id; a namespaced function's name and
        namespace apart again, vLLM's)."""
        name, namespace = call["function"]["name"], None
        for tool in self.req.tools or []:
            prefix = f"{tool.get('name')}{NAMESPACE_SEPARATOR}"
            if tool.get("type") == "namespace" and name.startswith(prefix) and \
                    any(t.get("name") == name[len(prefix):] for t in tool.get("tools") or []):
                name, namespace = name[len(prefix):], tool["name"]
                break
        return {"id": item_id, "type": "function_call", "call_id": call["id"], "name": name,
                "arguments": call["function"]["arguments"], "status": status,
                **({"namespace": namespace} if namespace else {})}


def _without_bytes(entry: dict) -> dict:
    """A stream delta's logprob entry: token, logprob and top_logprobs without ``bytes`` (the delta event's type)."""
    return {"token": entry["token"], "logprob": entry["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in entry.get("top_logprobs") or []]}


def _status(reason: str | None) -> str:
    return "incomplete" if reason == "length" else "cancelled" if reason == "abort" else "completed"


def as_input_error(exc: ApiError) -> ApiError:
    """``exc`` from the chat checks, its field named as this API names it (max_output_tokens, input)."""
    param = exc.param or ""
    if param in ("max_tokens", "max_completion_tokens"):
        return ApiError(exc.status, exc.message.replace(f"{param}=", "max_output_tokens="), "max_output_tokens",
                        exc.code, exc.headers)
    if param == "prompt" or param == "messages" or param.startswith("messages."):
        return ApiError(exc.status, exc.message, "input", exc.code, exc.headers)
    return exc


async def create(request: Request):
    state = request.app.state.server
    req = await read_json(request, ResponsesRequest, state.config.max_body_bytes)
    try:
        chat = to_chat(req, state)
        call = await start_chat_call(state, chat)
    except ApiError as exc:
        raise as_input_error(exc) from None
    answer = Answer(req, chat, state, call)
    if req.stream:
        return StreamingResponse(events(answer), media_type="text/event-stream", headers=STREAM_HEADERS)
    got = await collected(request, call)
    if got is None:
        return Response(status_code=499)
    logprobs = None
    if answer.logprobs is not None:
        fmt = formatter(call)
        logprobs = fmt.chat([t for d in got.deltas[0] for t in d[0]], [e for d in got.deltas[0] for e in d[1]])
    fields, _ = answer_fields(call.options, got.texts[0], got.reasons[0])
    text, calls, thinking = fields.get("content") or "", fields.get("tool_calls") or [], fields.get("reasoning")
    output = [answer.item("completed", [answer.part(text, logprobs)] if text else [])]      # (vLLM's: no part)
    if calls or thinking:       # the message only where it has text (vLLM's output items with calls or reasoning)
        output = (output if text else []) + [answer.function_call("fc_" + uuid.uuid4().hex, c, "completed")
                                             for c in calls]
    if thinking:
        output.insert(0, answer.reasoning("rs_" + uuid.uuid4().hex, thinking, None))
    return JSONResponse(answer.body(_status(got.reasons[0]), output, answer.usage()))


async def events(answer: Answer):
    """vLLM's event stream of one response (each event numbered by ``sequence_number``): the message item opens
    with the first text; with tool calling, each call closes what is open and opens a function_call item whose
    arguments stream as they are written."""
    number = -1

    def event(kind: str, **body) -> str:
        nonlocal number
        number += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **body, 'sequence_number': number})}\n\n"

    call = answer.call
    reader = AnswerStream(call.options, call.prompts[0])
    output: list[dict] = []
    text = logprobs = open_call = None          # the open message's text and logprobs, or the open call's item
    thinking = thinking_id = None               # the open reasoning item's text and id

    def close() -> list[str]:
        nonlocal text, logprobs, open_call, thinking
        out = []
        if thinking is not None:
            where = dict(item_id=thinking_id, output_index=len(output), content_index=0)
            part = {"type": "reasoning_text", "text": thinking}
            output.append(answer.reasoning(thinking_id, thinking, "completed"))
            out += [event("response.reasoning_text.done", **where, text=thinking),
                    event("response.content_part.done", **where, part=part),
                    event("response.output_item.done", output_index=len(output) - 1, item=output[-1])]
            thinking = None
        if text is not None:
            where = dict(item_id=answer.item_id, output_index=len(output), content_index=0)
            part = answer.part(text, logprobs if answer.logprobs is not None else None)
            output.append(answer.item("completed", [part]))
            out += [event("response.output_text.done", **where, text=text, logprobs=[]),   # (vLLM's: [])
                    event("response.content_part.done", **where, part=part),
                    event("response.output_item.done", output_index=len(output) - 1, item=output[-1])]
        if open_call is not None:
            item = {**open_call, "status": "completed"}
            output.append(item)
            out += [event("response.function_call_arguments.done", output_index=len(output) - 1, item_id=item["id"],
                          arguments=item["arguments"], name=item["name"]),
                    event("response.output_item.done", output_index=len(output) - 1, item=item)]
        text = logprobs = open_call = None
        return out

    try:
        opening = answer.body("in_progress", [], None)
        yield event("response.created", response=opening)
        yield event("response.in_progress", response=opening)
        fmt, reason = formatter(call), None
        async for d in call.deltas():
            reason = d.reason or reason
            out = reader.feed(d.text, d.ids, last=bool(d.reason))
            if out.get("reasoning"):
                if thinking is None:   # a reasoning item opens with the first thinking, closing what is open
                    for e in close():
                        yield e
                    thinking, thinking_id = "", "rs_" + uuid.uuid4().hex
                    yield event("response.output_item.added", output_index=len(output),
                                item=answer.reasoning(thinking_id, None, "in_progress"))
                    yield event("response.content_part.added", item_id=thinking_id, output_index=len(output),
                                content_index=0, part={"type": "reasoning_text", "text": ""})
                thinking += out["reasoning"]
                yield event("response.reasoning_text.delta", item_id=thinking_id, output_index=len(output),
                            content_index=0, delta=out["reasoning"])
            if out.get("content"):
                if open_call is not None or thinking is not None:
                    for e in close():
                        yield e
                where = dict(item_id=answer.item_id, output_index=len(output), content_index=0)
                if text is None:       # the item opens with the first text (an empty answer has none: vLLM's)
                    text, logprobs = "", []
                    yield event("response.output_item.added", output_index=len(output),
                                item=answer.item("in_progress", []))
                    yield event("response.content_part.added", **where, part=answer.part("", []))
                chunk = fmt.chat(d.tokens, d.entries) if answer.logprobs is not None else []
                text, logprobs = text + out["content"], logprobs + chunk
                yield event("response.output_text.delta", **where, delta=out["content"],
                            logprobs=[_without_bytes(e) for e in chunk])
            for delta in out.get("tool_calls") or []:
                function = delta.get("function") or {}
                if function.get("name") is not None:
                    for e in close():
                        yield e
                    open_call = answer.function_call("fc_" + uuid.uuid4().hex, {
                        "id": delta["id"], "function": {"name": function["name"], "arguments": ""}}, "in_progress")
                    yield event("response.output_item.added", output_index=len(output), item=open_call)
                if function.get("arguments") and open_call is not None:
                    open_call["arguments"] += function["arguments"]
                    yield event("response.function_call_arguments.delta", output_index=len(output),
                                item_id=open_call["id"], delta=function["arguments"])
        for e in close():
            yield e
        yield event("response.completed", response=answer.body(_status(reason), output, answer.usage()))
    except Exception as exc:
        exc = as_api_error(exc)
        yield event("error", code=exc.code or str(exc.status), message=exc.message, param=exc.param)
    finally:
        call.cancel()


async def not_stored(request: Request):
    """GET /v1/responses/{id} and its cancel: nothing is stored, every id is unknown (vLLM's answer without its
    store)."""
    response_id = request.path_params["response_id"]
    return error_response(404, f"Response with id '{response_id}' not found.", param="response_id")
