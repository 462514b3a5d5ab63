"""The OpenAI-compatible server (``hf-paged serve``) as a Ray Serve deployment: replicas on a cluster.

    from ray import serve
    from hf_paged.integrations import ray_serve

    serve.run(ray_serve.application("/models/SmolLM2-135M", num_replicas=2, num_cpus=1, max_num_seqs=32))
    # POST http://<head>:8000/v1/completions, /v1/chat/completions; GET /v1/models, /metrics

Each replica loads the model once and builds the same FastAPI app as ``hf-paged serve``
(``integrations.server.main.serving_app``: checkpoint directories, ChatGLM, ``"smollm2"``) — its own
engine, queue and metrics; Ray Serve routes requests between replicas and restarts a replica that
dies. The app's lifespan starts and stops the replica's engine thread. Nothing imports ray until
``application`` runs.
"""
from __future__ import annotations

from .server.config import ServeConfig, split_options

# ServeConfig fields that are Ray Serve's business here.
RAY_OWNS = {"host": "serve.start(http_options=...)", "port": "serve.start(http_options=...)",
            "log_level": "Ray's logging configuration"}


def application(model: str, *, num_replicas: int = 1, num_cpus: float = 1, num_gpus: float = 0,
                threads: int | None = None, max_ongoing_requests: int = 256, **server_options):
    """A bound Ray Serve application (pass it to ``serve.run``).

    model: what ``hf-paged serve`` takes (a checkpoint directory or ``"smollm2"``); it must be reachable at
    the same path on every node. num_cpus / num_gpus: per replica (``threads``: its torch threads, default
    ``num_cpus``). server_options: ``ServeConfig``'s (served_model_name, api_key, dtype, max_queue, ...;
    not host, port or log_level, which Ray Serve owns) and EngineConfig knobs.
    """
    from ray import serve

    from .server.main import checked_options

    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    owned = sorted(RAY_OWNS.keys() & server_options.keys())
    if owned:
        raise ValueError(f"{owned[0]}={server_options[owned[0]]!r}: on Ray Serve, set it with {RAY_OWNS[owned[0]]}")
    checked_options(server_options)          # a bad knob named now, not as a failed deployment a minute later
    config, engine_knobs = split_options(server_options, ServeConfig)

    @serve.deployment(name="hf_paged", num_replicas=num_replicas, max_ongoing_requests=max_ongoing_requests,
                      ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus})
    @serve.ingress()
    class PagedServer:
        def __init__(self):
            import torch

            from .server.main import serving_app

            torch.set_num_threads(threads or max(1, int(num_cpus)))
            self.paged_app = serving_app(model, config, **engine_knobs)

        def __serve_build_asgi_app__(self):
            return self.paged_app

    return PagedServer.bind()
