"""Request schemas of /v1/completions and /v1/chat/completions: OpenAI's fields and vLLM's (every
field vLLM's protocol declares, see ``vllm_fields``); others are ignored and logged, as vLLM's
(``request_parts.Body``).

Three checks beyond the types, each answering a 400 that names the field: ``unsupported()`` (a field
asking for what the engine does not implement, or a limit of this server), ``conflicts()`` (fields that
contradict each other, as vLLM's validators refuse them). Limits that depend on the running engine
(``max_logprobs``, the vocabulary) are checked by ``intake``.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import Field, field_validator

from .request_parts import Body, StreamOptions
from .tool_choice import choice_error
from .vllm_fields import VllmSampling, refused_field

MAX_N = 64
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1      # vLLM's range (a 64-bit integer)
MAX_STOPS = 64
# The engine's finish reasons as OpenAI (and vLLM's metrics) name them.
FINISH_REASONS = {"stop": "stop", "stop_string": "stop", "length": "length", "cancelled": "abort"}
PROMPT_SHAPES = ("prompt must be a text, a list of texts, a list of token ids or a list of token-id "
                 "lists (token ids: integers >= 0)")


def finish_reason(engine_reason: str | None) -> str:
    """OpenAI's ``finish_reason`` for the engine's (none at all: the request was cancelled, "abort")."""
    return FINISH_REASONS.get(engine_reason, engine_reason or "abort")


def _is_token_id(x) -> bool:
    return type(x) is int and x >= 0          # not bool, not float


def prompt_shape(value):
    """``value`` when it is one of the four prompt shapes; else a ValueError naming the first bad item
    (a union's own error would name only the first shape it tried)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(f"{PROMPT_SHAPES}; got {type(value).__name__ if value != [] else 'an empty list'}")
    first = value[0]
    fits = (lambda x: isinstance(x, str)) if isinstance(first, str) else _is_token_id if not isinstance(
        first, list) else (lambda x: isinstance(x, list) and x != [] and all(map(_is_token_id, x)))
    bad = next((i for i, x in enumerate(value) if not fits(x)), None)
    if bad is not None:
        raise ValueError(f"{PROMPT_SHAPES}; item {bad} is {value[bad]!r:.60}")
    return value


def template_tools(tools: list | None) -> list[dict] | None:
    """OpenAI function tools as vLLM hands them to a chat template: ``{"type": "function", "function": {name,
    description, parameters[, strict]}}``, an absent description or parameters None (what a template that
    writes the tools into the prompt renders). None without tools."""
    if not tools:
        return None
    out = []
    for tool in tools:
        f = tool["function"]
        fn = {"name": f["name"], "description": f.get("description"), "parameters": f.get("parameters")}
        if f.get("strict") is not None:
            fn["strict"] = f["strict"]
        out.append({"type": "function", "function": fn})
    return out


def _arguments(arguments: str):
    """A call's arguments (a JSON text: ``tool_calls_error``) as a template reads them: an object (empty or
    malformed: {}, as vLLM's)."""
    try:
        parsed = json.loads(arguments) if arguments else {}
    except ValueError:
        parsed = {}
    return parsed if isinstance(parsed, dict) else {}


def messages_error(messages: list) -> Optional[tuple[str, str]]:
    """(param, message) for the first message whose tool-calling fields vLLM's schema refuses
    (``ChatMessage.tool_calls_error``), or None: checked wherever messages reach the template."""
    for i, m in enumerate(messages):
        refused = m.tool_calls_error()
        if refused:
            return f"messages.{i}.{refused[0]}", refused[1]
    return None


def tool_shape_error(tools: list | None) -> Optional[tuple[str, str]]:
    """(param, message) for the first tool that is not an OpenAI function tool, or None."""
    for i, tool in enumerate(tools or []):
        f = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(f, dict) or tool.get("type", "function") != "function" or not isinstance(f.get("name"), str) \
                or not isinstance(f.get("parameters", {}), (dict, type(None))):
            return f"tools.{i}", ("a tool is {\"type\": \"function\", \"function\": {\"name\": ..., "
                                  "\"description\": ..., \"parameters\": {...}}} (parameters a JSON schema object)")
    return None


class _Sampling(VllmSampling):
    """OpenAI's fields of both endpoints (vLLM's come from VllmSampling)."""
    model: Optional[str] = None
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = Field(None, ge=0.0)         # no upper bound, as vLLM's
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=MIN_SEED, le=MAX_SEED)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None

    @field_validator("n", "stream", "echo", check_fields=False, mode="before")
    @classmethod
    def _null_is_default(cls, value, info):
        """vLLM's ``Optional`` n / stream / echo: null means the default."""
        return cls.model_fields[info.field_name].default if value is None else value

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)

    def unsupported(self) -> Optional[tuple[str, str]]:
        """(param, message) of the first field asking for what this server does not do, or None."""
        refused = refused_field(self)
        if refused:
            return refused
        if self.stop == "" or (isinstance(self.stop, list) and "" in self.stop):
            return "stop", "stop cannot contain an empty string (as in vLLM)"
        if len(self.stops()) > MAX_STOPS:
            return "stop", f"{len(self.stops())} stop sequences: at most {MAX_STOPS}"
        return None

    def conflicts(self) -> Optional[tuple[str, str]]:
        """(param, message) of the first contradiction among the fields, or None."""
        if self.stream_options is not None and not self.stream and (
                self.stream_options.model_fields_set or self.stream_options.ignored_fields()):   # {} passes, as in vLLM
            return "stream_options", "stream_options can only be set with stream=true (as in vLLM)"
        if self.stream and self.prompt_logprobs not in (None, 0):
            return "prompt_logprobs", "prompt_logprobs are not available with stream=true (as in vLLM)"
        if self.truncate_prompt_tokens == 0:
            return "truncate_prompt_tokens", "truncate_prompt_tokens must be -1 (the model's context) or >= 1"
        if self.allowed_token_ids == []:
            return "allowed_token_ids", "allowed_token_ids is empty: no token could be generated"
        if self.guided_choice == [] or (self.structured_outputs and self.structured_outputs.choice == []):
            return "guided_choice" if self.guided_choice == [] else "structured_outputs.choice", \
                "an empty choice list: no text could be generated"
        return None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=0)         # OpenAI's default for completions; 0: echo only
    logprobs: Optional[int] = Field(None, ge=-1)
    echo: Optional[bool] = False
    best_of: Optional[int] = Field(None, ge=1)
    suffix: Optional[str] = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        return prompt_shape(value)

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _null_max_tokens(cls, value):
        """vLLM's ``normalize_null_max_tokens``: null is the default, 16 (chat's null: the rest of the context)."""
        return cls.model_fields["max_tokens"].default if value is None else value

    def conflicts(self):
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens=0 needs echo=true (the prompt alone comes back); else at least 1"
        return super().conflicts()


TEXT_PARTS = ("text", "input_text", "output_text")              # vLLM reads the last two as text too


class TextPart(Body):
    type: Literal[TEXT_PARTS]
    text: str


class ChatMessage(Body):
    role: str                  # any role, as vLLM's (the chat template decides): "tool" for a tool's result
    content: Optional[Union[str, list[TextPart]]] = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value):
        """An image, audio or file part refused by name (else the union's error would say "a string")."""
        for i, part in enumerate(value if isinstance(value, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in TEXT_PARTS:
                raise ValueError(f"part {i} has type {kind!r}: this server runs text-only models, whose messages "
                                 f"take parts of type {' / '.join(map(repr, TEXT_PARTS))} only")
        return value
    name: Optional[str] = None
    tool_call_id: Optional[str] = None          # a tool result's call (the template sees it)
    tool_calls: Optional[list[Any]] = None      # an assistant's calls (the template sees them: ``template_message``)
    reasoning: Optional[str] = None             # an assistant's thinking (vLLM's field; reasoning_content its old name)
    reasoning_content: Optional[str] = None

    def template_message(self) -> dict:
        """The message as a chat template reads it (vLLM's form): text content; an assistant's tool calls with
        their arguments as objects (vLLM's ``_postprocess_messages``: a JSON text parsed, an empty or
        malformed one as {}); a tool result's tool_call_id; an assistant's thinking as both ``reasoning`` and
        ``reasoning_content`` (the template picks; ``reasoning`` wins where both are sent)."""
        out = {"role": self.role, "content": self.text(), **({"name": self.name} if self.name else {})}
        thinking = self.reasoning if self.reasoning is not None else self.reasoning_content
        if self.role == "assistant" and thinking is not None:
            out["reasoning"] = out["reasoning_content"] = thinking
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [{**call, "function": {**call["function"],
                                                       "arguments": _arguments(call["function"].get("arguments"))}}
                                 for call in self.tool_calls]
        return out

    def tool_calls_error(self) -> Optional[tuple[str, str]]:
        """(the field, why) of a tool-calling field vLLM's message schema refuses, or None: an assistant's call
        needs its id, name and JSON-text arguments; a tool result its text."""
        for j, call in enumerate(self.tool_calls or []):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or call.get("type", "function") != "function" \
                    or not isinstance(call.get("id"), str) or not isinstance(function.get("name"), str) \
                    or not isinstance(function.get("arguments"), str):
                return f"tool_calls.{j}", ("an assistant's tool_calls are {\"id\": ..., \"type\": \"function\", "
                                           "\"function\": {\"name\": ..., \"arguments\": \"<JSON text>\"}}")
        if self.role == "tool" and self.content is None:
            return "content", "a tool message needs its content (the tool's result as text)"
        return None

    def text(self) -> str:
        if self.content is None:
            return ""
        # text parts joined by newlines, as vLLM joins them for templates that take a string
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


# chat_template_kwargs the server sets itself (passing them again would clash or change the output type);
# add_generation_prompt and continue_final_message there give way to the request's fields, as vLLM merges them
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "chat_template", "tools", "documents",
                                      "return_dict", "return_tensors", "tokenizer_kwargs"})
TEMPLATE_FLAGS = ("add_generation_prompt", "continue_final_message")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=-1)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    service_tier: Optional[str] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None
    include_reasoning: bool = True
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: Optional[list[dict[str, str]]] = None
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    media_io_kwargs: Optional[dict[str, Any]] = None
    mm_processor_kwargs: Optional[dict[str, Any]] = None
    return_prompt_text: Optional[bool] = None

    def conflicts(self):
        if self.top_logprobs not in (None, 0) and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs=true"
        if self.continue_final_message and self.add_generation_prompt:
            return "continue_final_message", ("continue_final_message and add_generation_prompt cannot both "
                                              "be true (set add_generation_prompt=false)")
        refused = messages_error(self.messages)
        if refused:
            return refused
        clash = sorted(RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {}))
        if clash:
            return "chat_template_kwargs", f"chat_template_kwargs may not set {clash}: the server sets them"
        return tool_shape_error(self.tools) or choice_error(self.tools, self.tool_choice) or super().conflicts()
