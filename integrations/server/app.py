"""The FastAPI app: OpenAI-compatible endpoints over one background engine thread.

``create_app(model, tokenizer, **options)`` builds the Engine (options: ``AppConfig`` fields and
EngineConfig knobs) and the app; the engine thread starts and stops with the app's lifespan.
Endpoints (``routes``): ``GET /v1/models`` (and ``/v1/models/{name}``), ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream`` as server-sent events ending in ``data: [DONE]``), ``GET`` /
``HEAD /health`` and vLLM's ``/ping`` (both open even with an API key), ``GET /metrics`` (Prometheus),
vLLM's ``POST /tokenize``, ``POST /detokenize``, ``GET /version`` and ``GET /tokenizer_info`` (``tokenization``);
answered through chat completions: Anthropic's ``POST /v1/messages`` and ``/v1/messages/count_tokens``
(``anthropic_api``, Anthropic's error bodies), OpenAI's ``POST /v1/responses`` (``responses_api``; nothing stored:
``GET /v1/responses/{id}`` answers 404, as vLLM's without its store) and SageMaker's ``POST /invocations``.
Every error answers an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}`` (``errors``); no
traceback reaches a client.

The pieces: ``state`` (what the handlers share), ``body`` (size-limited, strict JSON), ``protocol`` /
``vllm_fields`` / ``request_parts`` (the request schemas: OpenAI's and vLLM's fields), ``intake``
(request → token ids, engine settings and CallOptions; ``token_settings`` and ``guided`` for the
token-naming fields and structured output), ``call`` (one API call's engine requests and text
streams), ``responses`` (whole or streamed answers), ``middleware`` (the API key).
"""
from __future__ import annotations

from fastapi import FastAPI

from .config import AppConfig, split_options
from .errors import install_error_handlers
from .middleware import ApiKeyMiddleware
from .routes import add_routes
from .state import ServerState


def create_app(model, tokenizer, **options) -> FastAPI:
    """The app (engine built now, its thread started by the lifespan). ``options``: ``AppConfig`` fields
    (served_model_name, api_key, max_queue, shutdown_timeout, max_body_bytes) and EngineConfig knobs.
    ``app.state.server`` holds the ServerState; ``app.state.worker`` / ``.engine`` / ``.metrics`` its parts."""
    config, engine_knobs = split_options(options, AppConfig)
    state = ServerState.build(model, tokenizer, config, **engine_knobs)
    app = FastAPI(title="hf_paged", lifespan=state.lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.state.worker, app.state.engine, app.state.metrics = state.worker, state.engine, state.metrics
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    install_error_handlers(app)
    add_routes(app)
    return app
