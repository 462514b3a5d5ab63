"""The engine's counters (mutated only by the engine) and the read-only snapshot ``Engine.stats()`` returns."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineCounters:
    """Running totals, written by the engine and its scheduler only."""
    steps: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    forward_s: float = 0.0      # model forwards, plan building excluded
    host_s: float = 0.0         # scheduling, plan building, sampling, bookkeeping
    wall_s: float = 0.0         # inside Engine.session() (run, LLM.generate / stream)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine. ``stats["name"]`` reads a field too; ``as_dict()`` gives them all."""
    requests_running: int
    requests_waiting: int
    requests_finished: int
    requests_failed: int
    requests_cancelled: int
    blocks_total: int
    blocks_used: int
    blocks_free: int
    blocks_cached: int            # blocks holding a prefix-cache hash, in use or kept free
    kv_utilization: float         # blocks_used / blocks_total
    block_size: int
    bytes_per_token: int          # KV bytes per stored token over all layers, keys and values, scales included
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    prefix_evictions: int
    preemptions: int
    recomputed_tokens: int
    steps: int
    computed_tokens: int
    generated_tokens: int
    forward_s: float
    host_s: float
    wall_s: float
    tokens_per_s: float           # generated tokens / wall_s

    def __getitem__(self, name: str):
        return getattr(self, name)

    def as_dict(self) -> dict:
        return asdict(self)
