"""hf_paged: a paged KV cache (block tables, refcounts, copy-on-write) for transformers generate.

    import hf_paged
    hf_paged.patch(model)
    model.generate(**inputs, cache_implementation="paged")

Importing this package changes nothing in transformers.
"""
from .allocator import BlockAllocator, PoolExhaustedError
from .attention import ATTENTION_NAME
from .cache import PagedCache
from .patching import (disable, enable, enabled, is_enabled, is_patched, last_stats, patch, unpatch,
                       use_paged_attention)

__all__ = [
    "ATTENTION_NAME", "BlockAllocator", "PagedCache", "PoolExhaustedError", "disable", "enable", "enabled",
    "is_enabled", "is_patched", "last_stats", "patch", "unpatch", "use_paged_attention",
]
__version__ = "0.1.0"
