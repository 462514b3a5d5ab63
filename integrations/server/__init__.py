"""``hf-paged serve``: an OpenAI-compatible HTTP server on the continuous-batching engine.

    from hf_paged.integrations.server import create_app
    app = create_app(model, tokenizer, served_model_name="m", api_key=None, max_num_seqs=32)
    # uvicorn.run(app, host="127.0.0.1", port=8000)

Modules: ``config`` (AppConfig, ServeConfig: the defaults),
``loading`` (checkpoints; also used by the Ray integrations), ``app`` (``create_app``), ``middleware``
(the API key), ``routes`` (the endpoints), ``state`` (what the handlers share), ``intake`` (request →
token ids and sampling settings), ``call`` (one API call's engine requests), ``worker`` (the background
engine thread; no web imports), ``detokenize`` (incremental text that never emits a broken character;
no web imports), ``responses`` (whole or streamed answers), ``errors`` (OpenAI-style error bodies),
``protocol`` (the request schemas), ``tool_choice`` (what a request's tools ask: the grammar of calls, the
answer's message) and ``tool_parsers`` (calls read out of text, whole or streamed; no web imports),
``reasoning`` (a reasoning model's thinking split off its answer, whole or streamed; no web imports), ``metrics`` (Prometheus, one registry per app), ``main``
(``serve``: load, build, run uvicorn). FastAPI, uvicorn and prometheus_client (the ``serve`` extra) are
imported only by the modules that need them, and only when this package is asked for.
"""
from __future__ import annotations

__all__ = ["create_app", "serve"]


def __getattr__(name):
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "serve":
        from .main import serve

        return serve
    raise AttributeError(name)
