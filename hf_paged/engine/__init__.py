"""Continuous batching over the paged KV pool: request → scheduler → runner → sampler.

Module map: ``request`` (settings, requests, sequences, outputs) · ``scheduler`` (token budget,
admission, preemption, over ``hf_paged.blocks``: pool, tables, prefix cache) · ``runner`` (packed
forward, EngineCache) · ``sampler`` · ``config`` (vLLM-named knobs, pool sizing) · ``stats``
(counters and the read-only snapshot) · ``engine`` (one step) · ``llm`` (lists of prompts, streams).
"""
from .config import EngineConfig
from .engine import Engine, RequestTooLongError, TokenEvent
from .llm import LLM, generate_many
from .request import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["CompletionOutput", "Engine", "EngineConfig", "LLM", "RequestOutput", "RequestTooLongError",
           "SamplingParams", "TokenEvent", "generate_many"]
