"""The FastAPI app: OpenAI-compatible endpoints over one background engine thread.

``create_app(model, tokenizer, **options)`` builds the Engine (options: EngineConfig knobs) and the
app; the engine thread starts and stops with the app's lifespan. Endpoints: ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` as server-sent events ending in
``data: [DONE]``), ``GET /health`` (open even with an API key), ``GET /metrics`` (Prometheus).
Every error answers an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``; no
traceback reaches a client.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hf_paged.engine import Engine
from hf_paged.engine.settings import resolve_generation

from .detokenize import TextStream
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .protocol import ChatCompletionRequest, CompletionRequest
from .worker import EngineWorker, Handle, QueueFull, ShuttingDown

log = logging.getLogger("hf_paged.server")
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
RETRY_AFTER_S = 1
FINISH = {"stop": "stop", "stop_string": "stop", "length": "length", "cancelled": "abort"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable",
               500: "internal_server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code if code is not None else status}}


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code), status_code=exc.status,
                        headers=exc.headers)


class ApiKeyMiddleware:
    """Pure ASGI: every path but /health needs ``Authorization: Bearer <key>`` (constant-time compare)."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path") != "/health":
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                response = JSONResponse(error_body(401, "invalid or missing API key (Authorization: Bearer ...)",
                                                   code="invalid_api_key"), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Run:
    """The requests of one API call (one per prompt, ``n`` sequences each) seen from the asyncio side."""

    def __init__(self, worker: EngineWorker, tokenizer, prompts: list[list[int]], params, stops, n: int):
        self.worker, self.n = worker, n
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.streams = {(i, j): TextStream(tokenizer, stops) for i in range(len(prompts)) for j in range(n)}
        self.done: dict[int, bool] = {}
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.completion_tokens = 0
        self.handles = [Handle(ids, params, partial(self._deliver, i)) for i, ids in enumerate(prompts)]

    def _deliver(self, i: int, item) -> None:           # engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (i, item))

    def submit(self) -> None:
        submitted = []
        try:
            for handle in self.handles:
                submitted.append(self.worker.submit(handle))
        except QueueFull as exc:
            self.cancel()
            raise ApiError(503, str(exc), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        except ShuttingDown as exc:
            self.cancel()
            raise ApiError(503, str(exc), code="shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})

    def cancel(self) -> None:
        for handle in self.handles:
            self.worker.cancel(handle)

    async def deltas(self):
        """Yield (choice index, text delta, finish reason or None) until every sequence is done."""
        pending = len(self.handles)
        while pending:
            i, item = await self.queue.get()
            if isinstance(item, tuple):
                kind, value = item
                if kind == "error":
                    raise ApiError(400, value, param="prompt")
                pending -= 1
                for j in range(self.n):          # sequences that ended without an event (cancelled)
                    if (i, j) not in self.done:
                        self.done[i, j] = True
                        yield i * self.n + j, self.streams[i, j].finish(), "abort"
                continue
            for event in item:
                key = (i, event.index)
                if key in self.done:
                    continue
                stream = self.streams[key]
                self.completion_tokens += 1
                delta = stream.add(event.token)
                if event.finished or stream.stopped:
                    delta += stream.finish()
                    self.done[key] = True
                    reason = "stop" if stream.stopped else FINISH.get(event.finished, event.finished)
                    yield i * self.n + event.index, delta, reason
                elif delta:
                    yield i * self.n + event.index, delta, None

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def create_app(model, tokenizer, *, served_model_name: str | None = None, api_key: str | None = None,
               max_queue: int = 256, shutdown_timeout: float = 30.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               **engine_knobs) -> FastAPI:
    """The app (engine built now, its thread started by the lifespan). ``engine_knobs``: EngineConfig
    fields. ``app.state.worker`` / ``app.state.engine`` / ``app.state.metrics`` expose the parts."""
    if tokenizer is None:
        raise ValueError("the server needs a tokenizer")
    name = served_model_name or getattr(model.config, "_name_or_path", None) or "model"
    engine = Engine(model, tokenizer, **engine_knobs)
    metrics = Metrics(name)
    worker = EngineWorker(engine, max_queue=max_queue, metrics=metrics)
    max_model_len = engine.max_model_len
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            gone = await asyncio.to_thread(worker.shutdown, shutdown_timeout)
            if not gone:                                    # pragma: no cover
                log.error("the engine thread did not stop")

    app = FastAPI(title="hf_paged", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker, app.state.engine, app.state.metrics = worker, engine, metrics
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request, exc):
        log.error("internal error on %s", request.url.path, exc_info=exc)
        return JSONResponse(error_body(500, "internal server error"), status_code=500)

    async def read_json(request: Request, schema):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            raise ApiError(413, f"request body over {max_body_bytes} bytes", code="body_too_large")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > max_body_bytes:
                raise ApiError(413, f"request body over {max_body_bytes} bytes", code="body_too_large")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"malformed JSON body: {exc}", code="invalid_json")
        if not isinstance(body, dict):
            raise ApiError(400, "the JSON body must be an object", code="invalid_json")
        try:
            req = schema.model_validate(body)
        except ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(p) for p in err.get("loc", ())) or None
            kind = "unknown field" if err.get("type") == "extra_forbidden" else "invalid value"
            raise ApiError(400, f"{kind} {param!r}: {err.get('msg')}", param=param, code="invalid_request")
        if req.model is not None and req.model != name:
            raise ApiError(404, f"the model {req.model!r} does not exist (this server serves {name!r})",
                           param="model", code="model_not_found")
        refused = req.unsupported()
        if refused:
            raise ApiError(400, refused[1], param=refused[0], code="unsupported")
        return req

    def params_for(req, prompts: list[list[int]], max_tokens: int | None):
        longest = max(len(p) for p in prompts)
        if max_tokens is None:                        # chat without max_tokens: up to the context
            max_tokens = max_model_len - longest
        if longest + max_tokens > max_model_len:
            raise ApiError(400, f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                                f"context of {max_model_len} tokens (max_model_len)",
                           param="max_tokens" if longest < max_model_len else "prompt", code="context_too_long")
        settings = dict(max_new_tokens=max_tokens, num_return_sequences=req.n)
        if req.temperature is not None:
            settings["do_sample"] = req.temperature > 0
            if req.temperature > 0:
                settings["temperature"] = req.temperature
        if req.top_p is not None:
            settings["top_p"] = req.top_p
        if req.top_k is not None:
            settings["top_k"] = max(req.top_k, 0)
        if req.seed is not None:
            settings["seed"] = req.seed
        if req.stops():
            settings["stop_strings"] = list(req.stops())
        if req.ignore_eos:
            settings["ignore_eos"] = True
        if settings.get("do_sample") is False:        # greedy: sampling knobs would only warn
            settings.pop("top_p", None), settings.pop("top_k", None)
        try:
            return resolve_generation(model.generation_config, **settings)
        except ValueError as exc:
            raise ApiError(400, str(exc), code="invalid_sampling")

    def tokenize(text: str, special: bool = True) -> list[int]:
        return list(tokenizer(text, add_special_tokens=special)["input_ids"])

    def check_ids(ids: list[int], param: str) -> list[int]:
        if not ids:
            raise ApiError(400, "empty prompt", param=param)
        vocab = model.get_input_embeddings().weight.shape[0]
        if any(t < 0 or t >= vocab for t in ids):
            raise ApiError(400, f"token ids must be in [0, {vocab})", param=param)
        return ids

    async def respond(request: Request, req, prompts, kind: str, max_tokens):
        params = params_for(req, prompts, max_tokens)
        run = Run(worker, tokenizer, prompts, params, req.stops(), req.n)
        run.submit()
        rid = ("cmpl-" if kind == "text_completion" else "chatcmpl-") + uuid.uuid4().hex
        now = int(time.time())
        chat = kind == "chat.completion"
        choices = len(prompts) * req.n
        if not req.stream:
            texts, reasons = [""] * choices, [None] * choices

            async def collect():
                async for index, delta, reason in run.deltas():
                    texts[index] += delta
                    if reason:
                        reasons[index] = reason

            collecting = asyncio.ensure_future(collect())
            watching = asyncio.ensure_future(disconnected(request))
            try:
                await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                watching.cancel()
                if not collecting.done():          # the client left (or this task was cancelled)
                    collecting.cancel()
                run.cancel()                       # no-op for finished requests; frees a disconnected one's
            if not collecting.done() or collecting.cancelled():
                return Response(status_code=499)   # nobody reads it
            collecting.result()                    # re-raises an ApiError from the engine side
            if chat:
                out = [{"index": k, "message": {"role": "assistant", "content": texts[k]}, "logprobs": None,
                        "finish_reason": reasons[k]} for k in range(choices)]
            else:
                out = [{"index": k, "text": texts[k], "logprobs": None, "finish_reason": reasons[k]}
                       for k in range(choices)]
            return JSONResponse({"id": rid, "object": kind, "created": now, "model": name, "choices": out,
                                 "usage": run.usage()})

        chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choice_list, usage=None):
            body = {"id": rid, "object": chunk_kind, "created": now, "model": name, "choices": choice_list}
            if include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        def choice(k, delta, reason):
            if chat:
                return {"index": k, "delta": {"content": delta} if delta or not reason else {}, "logprobs": None,
                        "finish_reason": reason}
            return {"index": k, "text": delta, "logprobs": None, "finish_reason": reason}

        async def events():
            try:
                if chat:
                    yield chunk([{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None} for k in range(choices)])
                async for index, delta, reason in run.deltas():
                    yield chunk([choice(index, delta, reason)])
                if include_usage:
                    body = {"id": rid, "object": chunk_kind, "created": now, "model": name, "choices": [],
                            "usage": run.usage()}
                    yield f"data: {json.dumps(body)}\n\n"
            except ApiError as exc:
                yield f"data: {json.dumps(error_body(exc.status, exc.message, exc.param, exc.code))}\n\n"
            except Exception:
                log.exception("internal error while streaming")
                yield f"data: {json.dumps(error_body(500, 'internal server error'))}\n\n"
            finally:
                run.cancel()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/health")
    async def health():
        if not worker.alive:
            return JSONResponse(error_body(503, "the engine is not running"), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "hf_paged", "root": name, "parent": None,
                                            "max_model_len": max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await read_json(request, CompletionRequest)
        p = req.prompt
        if isinstance(p, str):
            prompts = [check_ids(tokenize(p), "prompt")]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [check_ids(tokenize(x), "prompt") for x in p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [check_ids(list(p), "prompt")]
        elif p:
            prompts = [check_ids(list(x), "prompt") for x in p]
        else:
            raise ApiError(400, "empty prompt", param="prompt")
        return await respond(request, req, prompts, "text_completion", req.max_tokens)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await read_json(request, ChatCompletionRequest)
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions",
                           param="messages", code="no_chat_template")
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in req.messages]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:              # jinja's TemplateError (e.g. roles must alternate)
            raise ApiError(400, f"the chat template refused the messages: {exc}", param="messages")
        prompt = check_ids(tokenize(text, special=False), "messages")
        max_tokens = req.max_completion_tokens or req.max_tokens
        return await respond(request, req, [prompt], "chat.completion", max_tokens)

    return app
