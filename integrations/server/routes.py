"""The endpoints (``add_routes``). Each reads the app's ``ServerState`` from ``request.app.state.server``."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from .call import ApiCall
from .errors import error_response
from .intake import (call_options, chat_prompt, completion_prompts, read_request, requested_max_tokens,
                     sampling_params)
from .metrics import CONTENT_TYPE_LATEST
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses import CHAT, COMPLETION, Reply, respond
from .state import ServerState
from .tokenization import detokenize_endpoint, tokenize_endpoint, tokenizer_info, version

def state_of(request: Request) -> ServerState:
    return request.app.state.server


async def health(request: Request):
    if not state_of(request).worker.alive:
        return error_response(503, "the engine is not running")
    return Response(status_code=200)


async def prometheus(request: Request):
    return Response(state_of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def models(request: Request):
    state = state_of(request)
    return {"object": "list", "data": [{"id": state.name, "object": "model", "created": state.created,
                                        "owned_by": "hf_paged", "root": state.name, "parent": None,
                                        "max_model_len": state.max_model_len}]}


async def completions(request: Request):
    state = state_of(request)
    req = await read_request(request, CompletionRequest, state)
    return await answer(request, state, req, completion_prompts(state, req), COMPLETION)


async def chat_completions(request: Request):
    state = state_of(request)
    req = await read_request(request, ChatCompletionRequest, state)
    return await answer(request, state, req, [chat_prompt(state, req)], CHAT)


async def answer(request: Request, state: ServerState, req, prompts: list[list[int]], shape):
    """Run ``prompts`` with ``req``'s settings and answer in ``shape`` (whole or streamed)."""
    params = await sampling_params(state, req, prompts, requested_max_tokens(req))
    call = ApiCall(state.worker, state.tokenizer, prompts, params, call_options(req))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await respond(request, call, Reply(shape, state.name), req.stream, include_usage)


ROUTES = (("GET", "/health", health), ("GET", "/metrics", prometheus), ("GET", "/v1/models", models),
          ("POST", "/v1/completions", completions), ("POST", "/v1/chat/completions", chat_completions),
          ("POST", "/tokenize", tokenize_endpoint), ("POST", "/detokenize", detokenize_endpoint),
          ("GET", "/version", version), ("GET", "/tokenizer_info", tokenizer_info))


def add_routes(app) -> None:
    for method, path, endpoint in ROUTES:
        app.add_api_route(path, endpoint, methods=[method])
