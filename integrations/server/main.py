"""``serve(model, **options)``: load, build the app, run uvicorn until SIGTERM / SIGINT or the engine fails.

uvicorn handles the signals: it stops accepting and waits up to ``shutdown_timeout`` s for in-flight
requests; a second before that the engine aborts those still running (each answers, finish_reason "abort"),
and the app's lifespan joins the engine thread. Returns when everything is stopped. ``serving_app`` (load +
build) is shared with the Ray Serve deployment (``hf_paged.integrations.ray_serve``).
"""
from __future__ import annotations

import dataclasses
import logging
import signal
import threading

import uvicorn

from .config import AppConfig, ServeConfig, split_options

log = logging.getLogger("hf_paged.server")


def serving_app(model: str, config: ServeConfig, **engine_knobs):
    """The app for checkpoint ``model`` (see ``loading.load_model``), served as ``model`` unless
    ``config.served_model_name`` says otherwise; ``config``'s host, port and log level are not read."""
    from .app import create_app
    from .loading import load_model

    loaded, tokenizer = load_model(model, dtype=config.dtype, trust_remote_code=config.trust_remote_code,
                                   quantization=config.quantization)
    note = auto_dtype_note(config.dtype, loaded)
    if note:
        log.info(note)
    app_options = {f.name: getattr(config, f.name) for f in dataclasses.fields(AppConfig)}
    app_options["served_model_name"] = config.served_model_name or model
    return create_app(loaded, tokenizer, **app_options, **engine_knobs)


def auto_dtype_note(dtype: str, model) -> str | None:
    """What ``--dtype auto`` did differently from vLLM's ``auto``, or None: a float32 checkpoint stays float32
    here (the default path's tokens), where vLLM would run it in bfloat16 on a CPU with bf16 instructions."""
    import torch

    from hf_paged.engine.cpu_bf16 import native_bf16

    weight = next(model.parameters(), None)
    if dtype != "auto" or weight is None or weight.dtype != torch.float32 or weight.device.type != "cpu" \
            or not native_bf16():
        return None
    return ("--dtype auto keeps this float32 checkpoint in float32 (the transformers default path's tokens); "
            "vLLM's auto would run it in bfloat16 on this CPU, which has bf16 instructions: faster, not "
            "token-exact (README, 'bf16 on the CPU'); pass --dtype bfloat16 for that")


def checked_options(options: dict) -> None:
    """Raise ValueError naming the setting for what ``serve`` would refuse only after loading the model
    (the server's settings, the engine knobs the model's geometry does not decide)."""
    from hf_paged.engine import EngineConfig

    _, engine_knobs = split_options(options, ServeConfig)
    EngineConfig(**engine_knobs).validate()


def serve(model: str, **options) -> int:
    """Serve ``model`` until a signal stops it (exit status 0) or its engine fails (1: the requests running
    get a 500, and the server stops, as vLLM's does). ``options``: ``ServeConfig`` fields (host,
    port, api_key, served_model_name, dtype, max_queue, shutdown_timeout, max_body_bytes,
    trust_remote_code, log_level) and EngineConfig knobs."""
    config, engine_knobs = split_options(options, ServeConfig)
    logging.basicConfig(level=getattr(logging, config.log_level.upper(), logging.INFO),
                        format="%(levelname)s %(name)s: %(message)s")
    app = serving_app(model, config, **engine_knobs)
    worker = app.state.worker
    server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                    timeout_graceful_shutdown=config.shutdown_timeout, access_log=False),
                     on_exit=lambda: _abort_before(config.shutdown_timeout, worker))
    worker.on_failure = lambda: setattr(server, "should_exit", True)     # as vLLM: a dead engine stops the server
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
    if worker.error is not None:
        log.error("stopped: the engine failed (%s: %s)", type(worker.error).__name__, worker.error)
        return 1
    return 0


def _abort_before(timeout: float, worker) -> None:
    """uvicorn cancels the requests still running ``timeout`` s after a signal, cutting their connections (a
    plain-text 500, a stream without its end): the engine aborts them a little before, so that each answers."""
    timer = threading.Timer(max(0.0, timeout - min(1.0, timeout / 2)), worker.cancel_all)
    timer.daemon = True
    timer.start()


class _Server(uvicorn.Server):
    """uvicorn's server, telling ``on_exit`` when a signal first asks it to stop."""

    def __init__(self, config, on_exit):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first:
            self._on_exit()


def _stopped(signum, frame) -> None:
    log.info("stopped by signal %d", signum)
