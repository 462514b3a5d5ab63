"""Continuous batching over the paged KV pool: request → scheduler/block manager → runner → sampler.

Module map: ``request`` (settings, requests, sequences, outputs) · ``block_manager`` (blocks, prefix
cache, copy-on-write; pure Python) · ``scheduler`` (token budget, admission, preemption) · ``runner``
(packed forward, EngineCache) · ``sampler`` · ``config`` (vLLM-named knobs, pool sizing) · ``engine``
(one step) · ``llm`` (lists of prompts, streams).
"""
from .config import EngineConfig
from .engine import Engine, RequestTooLongError, TokenEvent
from .llm import LLM, generate_many
from .request import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["CompletionOutput", "Engine", "EngineConfig", "LLM", "RequestOutput", "RequestTooLongError",
           "SamplingParams", "TokenEvent", "generate_many"]
