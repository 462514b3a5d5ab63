"""hf_paged: a paged KV cache (block tables, refcounts, copy-on-write) for transformers generate.

    import hf_paged
    hf_paged.patch(model)
    model.generate(**inputs, cache_implementation="paged")

Importing this package changes nothing in transformers. This module is the public face: it
re-exports the core (``blocks`` → ``plan`` → ``cache`` → ``backends`` → ``attention_interface`` →
``engine``) and the transformers integrations (``hf_paged.integrations``) built on it.
"""
from .attention_interface import ATTENTION_NAME, use_paged_attention
from .blocks import PoolExhaustedError
from .cache import PagedCache
from .introspect import model_geometry
from .engine import Engine, EngineConfig, RequestOutput, generate_many
from .integrations.offline import LLM
from .integrations.vllm_params import SamplingParams
from .integrations.patching import (disable, enable, enabled, is_enabled, is_patched, last_stats, patch, unpatch,
                                   weights_changed)


def pipeline(task: str = "text-generation", model=None, **kwargs):
    """``transformers.pipeline`` whose lists of prompts run through the continuous-batching engine
    (see ``hf_paged.integrations.pipeline``; imported on first use)."""
    from .integrations.pipeline import pipeline as paged_pipeline

    return paged_pipeline(task, model, **kwargs)


__all__ = [
    "ATTENTION_NAME", "Engine", "EngineConfig", "LLM", "PagedCache", "PoolExhaustedError", "RequestOutput",
    "SamplingParams",
    "disable", "enable", "enabled", "generate_many", "is_enabled", "is_patched", "last_stats", "model_geometry", "patch",
    "pipeline", "unpatch", "use_paged_attention", "weights_changed",
]
__version__ = "0.1.0"
