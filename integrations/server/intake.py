"""From an HTTP request to the engine's inputs: the body (size-limited, parsed, validated), the prompts'
token ids and the sampling settings, resolved as ``generate`` resolves them. Every refusal is an
``ApiError`` (400, 404 or 413) naming the field and the limit."""
from __future__ import annotations

import json

from fastapi import Request
from pydantic import ValidationError

from hf_paged.engine.settings import resolve_generation

from .errors import ApiError
from .protocol import ChatCompletionRequest, CompletionRequest
from .state import ServerState


async def read_body(request: Request, limit: int) -> bytes:
    too_large = ApiError(413, f"request body over {limit} bytes (max_body_bytes)", code="body_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise too_large
    return bytes(raw)


def parse(raw: bytes, schema):
    """``schema`` validated from a JSON object body."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}", code="invalid_json")
    if not isinstance(body, dict):
        raise ApiError(400, "the JSON body must be an object", code="invalid_json")
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        kind = "unknown field" if err.get("type") == "extra_forbidden" else "invalid value"
        raise ApiError(400, f"{kind} {param!r}: {err.get('msg')}", param=param, code="invalid_request")


async def read_request(request: Request, schema, state: ServerState):
    """The validated request, for this server's model, with no field the engine does not implement."""
    req = parse(await read_body(request, state.config.max_body_bytes), schema)
    if req.model is not None and req.model != state.name:
        raise ApiError(404, f"the model {req.model!r} does not exist (this server serves {state.name!r})",
                       param="model", code="model_not_found")
    refused = req.unsupported()
    if refused:
        raise ApiError(400, refused[1], param=refused[0], code="unsupported")
    return req


def tokenize(state: ServerState, text: str, special: bool = True) -> list[int]:
    return list(state.tokenizer(text, add_special_tokens=special)["input_ids"])


def check_ids(state: ServerState, ids: list[int], param: str) -> list[int]:
    if not ids:
        raise ApiError(400, "empty prompt", param=param)
    vocab = state.vocab_size
    bad = next((t for t in ids if t < 0 or t >= vocab), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is outside the vocabulary: token ids must be in [0, {vocab})",
                       param=param)
    return ids


def completion_prompts(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    """One token-id list per prompt: ``prompt`` is a text, texts, token ids or lists of token ids."""
    p = req.prompt
    if isinstance(p, str):
        prompts = [tokenize(state, p)]
    elif p and all(isinstance(x, str) for x in p):
        prompts = [tokenize(state, x) for x in p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]
    elif p:
        prompts = [list(x) for x in p]
    else:
        raise ApiError(400, "empty prompt", param="prompt")
    return [check_ids(state, ids, "prompt") for ids in prompts]


def chat_prompt(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    """The messages through the tokenizer's chat template, with the assistant's turn opened."""
    tokenizer = state.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions",
                       param="messages", code="no_chat_template")
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:              # jinja's TemplateError (e.g. roles must alternate)
        raise ApiError(400, f"the chat template refused the messages: {exc}", param="messages")
    return check_ids(state, tokenize(state, text, special=False), "messages")


def context_checked(prompts: list[list[int]], max_tokens: int | None, max_model_len: int) -> int:
    """``max_tokens`` (chat without it: up to the context), refused when the longest prompt plus it
    exceeds ``max_model_len``."""
    longest = max(len(p) for p in prompts)
    if max_tokens is None:
        max_tokens = max_model_len - longest
    if longest + max_tokens > max_model_len:
        raise ApiError(400, f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                            f"context of {max_model_len} tokens (max_model_len)",
                       param="max_tokens" if longest < max_model_len else "prompt", code="context_too_long")
    return max_tokens


def generation_settings(req, max_tokens: int) -> dict:
    """The request's settings as ``generate`` keywords; unset ones stay unset (the model's own apply)."""
    settings = dict(max_new_tokens=max_tokens, num_return_sequences=req.n)
    if req.temperature is not None:
        settings["do_sample"] = req.temperature > 0
        if req.temperature > 0:
            settings["temperature"] = req.temperature
    optional = dict(top_p=req.top_p, top_k=None if req.top_k is None else max(req.top_k, 0), seed=req.seed,
                    stop_strings=list(req.stops()) or None, ignore_eos=req.ignore_eos or None)
    settings.update({k: v for k, v in optional.items() if v is not None})
    if settings.get("do_sample") is False:        # greedy: sampling knobs would only warn
        settings.pop("top_p", None), settings.pop("top_k", None)
    return settings


def sampling_params(state: ServerState, req, prompts: list[list[int]], max_tokens: int | None):
    """The engine's SamplingParams for every prompt of ``req`` (400 for what ``generate`` refuses)."""
    max_tokens = context_checked(prompts, max_tokens, state.max_model_len)
    try:
        return resolve_generation(state.model.generation_config, **generation_settings(req, max_tokens))
    except ValueError as exc:
        raise ApiError(400, str(exc), code="invalid_sampling")
