"""The block layer (pure Python, no tensors), used by generate's PagedCache and by the engine alike.

``pool`` (refcounts, a free queue in reuse order, kept blocks, growth, budget → blocks) →
``table`` (one sequence's blocks: append with copy-on-write, fork, truncate, slots) →
``prefix_cache`` (optional: chained hashes of full blocks, verified on hit, evicted last-used-last).
"""
from .pool import BlockPool, PoolExhaustedError, blocks_for_budget
from .prefix_cache import PrefixCache, chain_hash
from .table import BlockTable

__all__ = ["BlockPool", "BlockTable", "PoolExhaustedError", "PrefixCache", "blocks_for_budget", "chain_hash"]
