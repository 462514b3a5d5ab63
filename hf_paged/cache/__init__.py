"""Caches over the paged KV pools: ``pools`` (per-layer K/V tensors, writes, copy-on-write, the
per-layer answers transformers asks of a cache) → ``rows`` (generate's rows: tables, finished rows,
written columns) → ``paged_cache`` (``PagedCache``, what generate uses). The engine's cache is
``hf_paged.engine.runner.EngineCache`` on the same pools."""
from .paged_cache import PagedCache
from .pools import KVPools, kv_bytes_per_token

__all__ = ["KVPools", "PagedCache", "kv_bytes_per_token"]
