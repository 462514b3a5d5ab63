"""The engine's counters (written by the engine and its scheduler only) and the read-only snapshot
``Engine.stats()`` returns (``snapshot``), with its one-line log form (``stats_line``)."""
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

    def add_step(self, num_tokens: int, host_s: float, forward_s: float) -> None:
        """One step that computed ``num_tokens`` tokens (seconds: host work, model forward)."""
        self.steps += 1
        self.computed_tokens += num_tokens
        self.forward_s += forward_s
        self.host_s += host_s


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

    def since(self, earlier: EngineStats) -> EngineStats:
        """The counters over the interval from ``earlier`` (a snapshot of the same engine) to this one: running
        totals subtracted, the rates taken over the interval; the state fields (requests running / waiting,
        blocks, utilisation) are this snapshot's."""
        d = {k: v - getattr(earlier, k) if k in RUNNING_TOTALS else v for k, v in self.as_dict().items()}
        return EngineStats(**d | _rates(d))


def _rates(d: dict) -> dict:
    """The rates of totals ``d``: prefix hit rate, generated tokens per second of wall time."""
    return {"prefix_hit_rate": d["prefix_hit_tokens"] / d["prefix_query_tokens"] if d["prefix_query_tokens"] else 0.0,
            "tokens_per_s": d["generated_tokens"] / d["wall_s"] if d["wall_s"] else 0.0}


# EngineStats' fields that count from the engine's start (EngineStats.since subtracts them).
RUNNING_TOTALS = frozenset({
    "requests_finished", "requests_failed", "requests_cancelled", "prefix_query_tokens", "prefix_hit_tokens",
    "prefix_evictions", "preemptions", "recomputed_tokens", "steps", "computed_tokens", "generated_tokens",
    "forward_s", "host_s", "wall_s"})


def snapshot(c: EngineCounters, pool, blocks_cached: int, requests_running: int, requests_waiting: int,
             bytes_per_token: int) -> EngineStats:
    """The EngineStats of counters ``c`` over the block pool ``pool`` (``blocks_cached``: its hashed blocks)."""
    return EngineStats(
        requests_running=requests_running, requests_waiting=requests_waiting,
        requests_finished=c.finished, requests_failed=c.failed, requests_cancelled=c.cancelled,
        blocks_total=pool.num_blocks, blocks_used=pool.num_used, blocks_free=pool.num_free,
        blocks_cached=blocks_cached, kv_utilization=pool.num_used / pool.num_blocks, block_size=pool.block_size,
        bytes_per_token=bytes_per_token,
        prefix_query_tokens=c.prefix_query_tokens, prefix_hit_tokens=c.prefix_hit_tokens,
        prefix_evictions=pool.evictions, preemptions=c.preemptions, recomputed_tokens=c.recomputed_tokens,
        steps=c.steps, computed_tokens=c.computed_tokens, generated_tokens=c.generated_tokens,
        forward_s=c.forward_s, host_s=c.host_s, wall_s=c.wall_s,
        **_rates(asdict(c)),
    )


def stats_line(stats: EngineStats) -> str:
    """``name=value, ...`` for every field (floats to 3 significant digits)."""
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.as_dict().items())
