"""``serve(model, **options)``: load, build the app, run uvicorn until SIGTERM / SIGINT.

uvicorn handles the signals: it stops accepting, waits up to ``shutdown_timeout`` s for in-flight
requests (then cancels them, which cancels their engine requests), and the app's lifespan joins the
engine thread. Returns when everything is stopped.
"""
from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger("hf_paged.server")


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, dtype: str = "auto", max_queue: int = 256,
          shutdown_timeout: float = 30.0, max_body_bytes: int | None = None, trust_remote_code: bool = False,
          log_level: str = "info", **engine_knobs) -> int:
    import uvicorn

    from .app import DEFAULT_MAX_BODY_BYTES, create_app
    from .loading import load_model

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(levelname)s %(name)s: %(message)s")
    loaded, tokenizer = load_model(model, dtype=dtype, trust_remote_code=trust_remote_code)
    app = create_app(loaded, tokenizer, served_model_name=served_model_name or model, api_key=api_key,
                     max_queue=max_queue, shutdown_timeout=shutdown_timeout,
                     max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES, **engine_knobs)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                            access_log=False)
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it is done, under the handler found at start;
    # a no-op one there makes a graceful SIGTERM / Ctrl-C end with exit status 0.
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _stopped(signum, frame) -> None:
    log.info("stopped by signal %d", signum)
