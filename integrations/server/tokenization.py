"""vLLM's utility endpoints: ``POST /tokenize``, ``POST /detokenize``, ``GET /version`` and
``GET /tokenizer_info``, with the bodies and answers of vLLM's serving_tokenization (lm-eval's ``tokenizer_backend=auto`` asks
/tokenize first). Behind the API key like every endpoint but /health.
"""
from __future__ import annotations

from importlib import metadata
from typing import Any, Optional

from fastapi import Request
from pydantic import Field
from pydantic_core import from_json

from .body import parse, read_body
from .errors import ApiError
from .intake import chat_text, check_ids, model_checked, tokenize
from .protocol import RESERVED_TEMPLATE_KWARGS, ChatMessage, messages_error, tool_shape_error
from .request_parts import Body
from .state import ServerState

FALLBACK_VERSION = "0.1.0"


class TokenizeCompletionRequest(Body):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: Optional[bool] = False


class TokenizeChatRequest(Body):
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: Optional[bool] = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None


class DetokenizeRequest(Body):
    model: Optional[str] = None
    tokens: list[int]


def chat_checked(req: TokenizeChatRequest) -> TokenizeChatRequest:
    """What /v1/chat/completions refuses among these fields, refused alike."""
    shape = tool_shape_error(req.tools) or messages_error(req.messages)   # as a chat renders them
    if shape:
        raise ApiError(400, shape[1], param=shape[0])
    if req.continue_final_message and req.add_generation_prompt:
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true "
                            "(set add_generation_prompt=false)", param="continue_final_message")
    clash = sorted(RESERVED_TEMPLATE_KWARGS & set(req.chat_template_kwargs or {}))
    if clash:
        raise ApiError(400, f"chat_template_kwargs may not set {clash}: the server sets them",
                       param="chat_template_kwargs")
    return req


def _has_key(raw: bytes, key: str) -> bool:
    """Whether ``raw`` is a JSON object with ``key`` (a body that is no JSON object says no; ``parse``
    then answers its 400)."""
    try:
        body = from_json(raw)
    except ValueError:
        return False
    return isinstance(body, dict) and key in body


async def tokenize_endpoint(request: Request):
    """{"prompt"} or {"messages"} -> {"count", "max_model_len", "tokens", "token_strs"}."""
    state: ServerState = request.app.state.server
    raw = await read_body(request, state.config.max_body_bytes)
    schema = TokenizeChatRequest if _has_key(raw, "messages") else TokenizeCompletionRequest
    req = model_checked(state, parse(raw, schema))
    return await state.off_loop(_tokenized, state, req)


def _tokenized(state: ServerState, req) -> dict:
    text = chat_text(state, chat_checked(req)) if isinstance(req, TokenizeChatRequest) else req.prompt
    ids = tokenize(state, text, special=req.add_special_tokens)
    strs = list(state.tokenizer.convert_ids_to_tokens(ids)) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}


async def detokenize_endpoint(request: Request):
    """{"tokens": [ids]} -> {"prompt": their text} (special tokens kept, as vLLM decodes them)."""
    state: ServerState = request.app.state.server
    req = model_checked(state, parse(await read_body(request, state.config.max_body_bytes), DetokenizeRequest))
    ids = check_ids(state, req.tokens, "tokens") if req.tokens else []
    return {"prompt": await state.off_loop(state.tokenizer.decode, ids) if ids else ""}


def package_version() -> str:
    try:
        return metadata.version("hf-paged")
    except metadata.PackageNotFoundError:      # pragma: no cover - a source tree not installed
        return FALLBACK_VERSION


async def version(request: Request):
    return {"version": package_version()}


def _jsonable(value) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


async def tokenizer_info(request: Request):
    """vLLM's ``GET /tokenizer_info``: the tokenizer's class, special tokens, chat template and plain
    settings, as lm-evaluation-harness' ``tokenizer_backend=remote`` reads them (it then encodes and
    decodes through /tokenize and /detokenize)."""
    tokenizer = request.app.state.server.tokenizer
    info = {k: v for k, v in getattr(tokenizer, "init_kwargs", {}).items() if _jsonable(v)}
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        token = getattr(tokenizer, name, None)
        info[name] = None if token is None else str(token)
    info.update(tokenizer_class=type(tokenizer).__name__, chat_template=getattr(tokenizer, "chat_template", None),
                model_max_length=getattr(tokenizer, "model_max_length", None))
    if not _jsonable(info["model_max_length"]) or info["model_max_length"] != info["model_max_length"]:
        info["model_max_length"] = None
    return info
