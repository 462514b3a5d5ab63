"""The endpoints (``add_routes``). Each reads the app's ``ServerState`` from ``request.app.state.server``."""
from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from . import anthropic_api, responses_api
from .body import parse, read_body
from .errors import ApiError, error_response
from .intake import api_call, chat_echo, chat_prompt, checked, completion_prompts, echo_texts, read_request
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


def model_card(state: ServerState) -> dict:
    return {"id": state.name, "object": "model", "created": state.created, "owned_by": "hf_paged", "root": state.name,
            "parent": None, "max_model_len": state.max_model_len}


async def models(request: Request):
    return {"object": "list", "data": [model_card(state_of(request))]}


async def model(request: Request):
    """GET /v1/models/{name} (the OpenAI client's ``models.retrieve``): the served model's card, else 404."""
    state, name = state_of(request), request.path_params["name"]
    if name != state.name:
        return error_response(404, f"model {name!r} is not served here; this server serves {state.name!r}",
                              param="model", code="model_not_found")
    return model_card(state)


async def completions(request: Request):
    state = state_of(request)
    return await complete(request, state, await read_request(request, CompletionRequest, state))


async def complete(request: Request, state: ServerState, req: CompletionRequest):
    prompts = await state.off_loop(completion_prompts, state, req)
    return await answer(request, state, req, prompts, COMPLETION, echo_texts(req) if req.echo else None)


async def chat_completions(request: Request):
    state = state_of(request)
    return await chat(request, state, await read_request(request, ChatCompletionRequest, state))


async def chat(request: Request, state: ServerState, req: ChatCompletionRequest):
    echo = chat_echo(req)                  # the answer's text begins with it (vLLM's chat echo)
    prompt = await state.off_loop(chat_prompt, state, req)
    return await answer(request, state, req, [prompt], CHAT, [echo] if echo else None)


class _Invocation(BaseModel):
    """What tells a SageMaker invocation's kind: chat (``messages``) before completions (``prompt``), as vLLM."""
    model_config = ConfigDict(extra="ignore")
    messages: Any = None
    prompt: Any = None


async def invocations(request: Request):
    """SageMaker's ``POST /invocations`` (vLLM's): a chat completion or a completion, told by the body."""
    state = state_of(request)
    raw = await read_body(request, state.config.max_body_bytes)
    kind = parse(raw, _Invocation)
    if kind.messages is not None:
        return await chat(request, state, checked(parse(raw, ChatCompletionRequest), state))
    if kind.prompt is not None:
        return await complete(request, state, checked(parse(raw, CompletionRequest), state))
    raise ApiError(400, "an invocation is a chat completion (with messages) or a completion (with prompt); this "
                        "body has neither", code="invalid_request")


async def answer(request: Request, state: ServerState, req, prompts: list[list[int]], shape, texts=None):
    """Run ``prompts`` with ``req``'s settings and answer in ``shape`` (whole or streamed); ``texts``: the
    prompts' texts an echo answers (None where the ids are decoded)."""
    call = await api_call(state, req, prompts, texts)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await respond(request, call, Reply(shape, state.name), req.stream, include_usage)


ROUTES = (("GET", "/health", health), ("HEAD", "/health", health), ("GET", "/ping", health), ("POST", "/ping", health),
          ("GET", "/metrics", prometheus), ("GET", "/v1/models", models), ("GET", "/v1/models/{name:path}", model),
          ("POST", "/v1/completions", completions), ("POST", "/v1/chat/completions", chat_completions),
          ("POST", "/tokenize", tokenize_endpoint), ("POST", "/detokenize", detokenize_endpoint),
          ("GET", "/version", version), ("GET", "/tokenizer_info", tokenizer_info),
          ("POST", "/v1/messages", anthropic_api.messages),
          ("POST", "/v1/messages/count_tokens", anthropic_api.count_tokens),
          ("POST", "/v1/responses", responses_api.create),
          ("GET", "/v1/responses/{response_id}", responses_api.not_stored),
          ("POST", "/v1/responses/{response_id}/cancel", responses_api.not_stored),
          ("POST", "/invocations", invocations))


def add_routes(app) -> None:
    for method, path, endpoint in ROUTES:
        app.add_api_route(path, endpoint, methods=[method])
