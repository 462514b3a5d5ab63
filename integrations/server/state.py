"""What the handlers of one app share: the engine, its thread, the metrics and the served model's facts.

One ``ServerState`` per app (``app.state.server``); nothing module-global. Its ``lifespan`` starts the
engine thread with the app and joins it when the app stops.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from hf_paged.engine import Engine

from .config import AppConfig
from .defaults import SamplingDefaults, server_generation_config
from .reasoning import Reasoning
from .metrics import Metrics
from .worker import EngineWorker

log = logging.getLogger("hf_paged.server")


@dataclass
class ServerState:
    """config: the app's settings. name: the model's name in the API. engine: the Engine (touched only by
    ``worker``'s thread). created: when the app was built (``/v1/models``' ``created``). defaults: what a
    request leaves unset (``defaults.SamplingDefaults``); base: the generation config requests resolve on.
    reasoning: the reasoning parser (``reasoning.Reasoning``, None without ``--reasoning-parser``)."""
    config: AppConfig
    name: str
    model: object
    tokenizer: object
    engine: Engine
    worker: EngineWorker
    metrics: Metrics
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    base: object = None
    reasoning: object = None
    created: int = field(default_factory=lambda: int(time.time()))
    # Whether the chat template takes a system message only first (anthropic_api.system_first): probed once
    system_first: bool | None = None
    # Tokenizing (chat templates, long prompts) off the event loop, one at a time as vLLM does: a 4 MB prompt
    # took 6-9 s on the loop, stalling every stream and /health meanwhile.
    tokenizing: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="hf_paged-tokenize"))

    @classmethod
    def build(cls, model, tokenizer, config: AppConfig, **engine_knobs) -> ServerState:
        """The engine is built now (``engine_knobs``: EngineConfig fields); its thread starts with the app."""
        if tokenizer is None:
            raise ValueError("the server needs a tokenizer (pass one to create_app)")
        name = config.served_model_name or getattr(model.config, "_name_or_path", None) or "model"
        reasoning = Reasoning.of(config.reasoning_parser, tokenizer) if config.reasoning_parser else None
        engine = Engine(model, tokenizer, **engine_knobs)
        fit_context(engine, asked=engine_knobs.get("max_model_len"))
        metrics = Metrics(name)
        worker = EngineWorker(engine, max_queue=config.max_queue, metrics=metrics)
        generation_config = getattr(model, "generation_config", None)
        defaults = SamplingDefaults.from_model(generation_config, config.generation_config)
        if defaults.overridden():
            log.info("unset sampling fields default to the model's generation config (--generation-config auto;"
                     " 'vllm' ignores it): %s", defaults.overridden())
        return cls(config, name, model, tokenizer, engine, worker, metrics, defaults,
                   server_generation_config(generation_config), reasoning)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().weight.shape[0]

    async def off_loop(self, function, *args):
        """``function(*args)`` in the tokenizing thread (tokenizer work: templates, encoding, decoding)."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, function, *args)

    @asynccontextmanager
    async def lifespan(self, app):
        self.worker.start()
        try:
            yield
        finally:
            self.tokenizing.shutdown(wait=False, cancel_futures=True)
            gone = await asyncio.to_thread(self.worker.shutdown, self.config.shutdown_timeout)
            if not gone:                                    # pragma: no cover
                log.error("the engine thread did not stop within %.1f s (shutdown_timeout) + 30 s",
                          self.config.shutdown_timeout)


def fit_context(engine: Engine, asked: int | None) -> None:
    """A server's requests default to the rest of the context (``max_tokens`` unset): a pool that cannot hold one
    whole context would fail every such request. An asked ``max_model_len`` the pool cannot hold is refused at
    start (as vLLM refuses); the model's own context is lowered to what the pool holds, with a warning."""
    tokens = engine.pool.num_blocks * engine.config.block_size
    if tokens >= engine.max_model_len:
        return
    pool = (f"the KV pool holds {engine.pool.num_blocks} blocks x {engine.config.block_size} tokens = {tokens} "
            f"tokens ({tokens * engine.bytes_per_token / 2**20:.1f} MiB)")
    if asked is not None:
        raise ValueError(f"--max-model-len {asked} needs room for {asked} tokens of one request, but {pool}. Raise "
                         f"--kv-cache-memory-bytes (or --gpu-memory-utilization on a GPU), or lower --max-model-len "
                         f"to at most {tokens}.")
    log.warning("max_model_len lowered from the model's %d to %d tokens: %s; raise --kv-cache-memory-bytes (or "
                "--gpu-memory-utilization on a GPU) to serve the whole context", engine.max_model_len, tokens, pool)
    engine.model_len, engine.max_model_len = engine.max_model_len, tokens
