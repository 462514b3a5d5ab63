"""Prometheus metrics under vLLM's names, in a registry of the app's own (no module-global state).

Gauges: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
(and its older name ``vllm:gpu_cache_usage_perc``), ``hf_paged:kv_blocks_used`` / ``_total``.
Counters: ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, ``vllm:num_preemptions_total``,
``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (tokens, as vLLM counts them),
``vllm:request_success_total{finished_reason}``. Histograms: ``vllm:time_to_first_token_seconds``,
``vllm:inter_token_latency_seconds`` and ``vllm:time_per_output_token_seconds`` (both per-token gaps),
``vllm:e2e_request_latency_seconds``. Every series carries ``model_name``.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)

from .protocol import finish_reason

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
# (series, help, EngineStats field): gauges set from the engine's stats after each step
STAT_GAUGES = (
    ("vllm:num_requests_running", "Requests running on the engine.", "requests_running"),
    ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", "requests_waiting"),
    ("vllm:kv_cache_usage_perc", "KV-cache usage: fraction of blocks in use (0-1).", "kv_utilization"),
    ("vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM's older name; 0-1).", "kv_utilization"),
    ("hf_paged:kv_blocks_used", "KV blocks in use.", "blocks_used"),
    ("hf_paged:kv_blocks_total", "KV blocks in the pool.", "blocks_total"),
    ("hf_paged:prefix_cache_hit_rate", "Prefix-cache hit tokens / queried tokens.", "prefix_hit_rate"),
)
# counters that mirror an EngineStats total (a Counter only goes up by increments)
STAT_COUNTERS = (
    ("vllm:num_preemptions", "Preemptions (sequences evicted and recomputed).", "preemptions"),
    ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_query_tokens"),
    ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_hit_tokens"),
)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class Metrics:
    """One app's series. ``tokens`` / ``finished`` / ``engine_stats`` are called by the engine thread
    (prometheus_client is thread-safe); ``render`` by the /metrics handler."""

    def __init__(self, model_name: str):
        self.registry = registry = CollectorRegistry(auto_describe=True)
        label = dict(labelnames=["model_name"], registry=registry)

        def gauge(name, doc):
            return Gauge(name, doc, **label).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, **label).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, buckets=buckets, **label).labels(model_name)

        self._gauges = [(gauge(name, doc), field) for name, doc, field in STAT_GAUGES]
        self._mirrors = {field: counter(name, doc) for name, doc, field in STAT_COUNTERS}
        self._seen = dict.fromkeys(self._mirrors, 0)          # the EngineStats values counted so far
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens of admitted requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self._success = Counter("vllm:request_success", "Finished requests by reason.",
                                labelnames=["model_name", "finished_reason"], registry=registry)
        self.model_name = model_name
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between two tokens of a sequence.",
                             ITL_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Time per output token (per-token gaps).",
                              ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             E2E_BUCKETS)

    def tokens(self, handle, events, now: float) -> None:
        self.generation_tokens.inc(len(events))
        if handle.first_token is None:
            handle.first_token = now
            self.ttft.observe(now - handle.arrival)
        for event in events:
            last = handle.last_token.get(event.index)
            if last is not None:
                self.itl.observe(now - last)
                self.tpot.observe(now - last)
            handle.last_token[event.index] = now

    def finished(self, handle, output, now: float) -> None:
        self.e2e.observe(now - handle.arrival)
        reason = output.finish_reason if output is not None else None
        self._success.labels(self.model_name, finish_reason(reason)).inc()

    def engine_stats(self, stats) -> None:
        for gauge, field in self._gauges:
            gauge.set(stats[field])
        for name, counter in self._mirrors.items():
            value = stats[name]
            if value > self._seen[name]:
                counter.inc(value - self._seen[name])
            self._seen[name] = value

    def render(self) -> bytes:
        return generate_latest(self.registry)
