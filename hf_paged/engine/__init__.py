"""Continuous batching over the paged KV pool: request → scheduler → runner → sampler.

Module map, in the order of a step: ``intake`` (prompt → token ids; requests that can never fit) ·
``settings`` (generation settings resolved as ``generate`` resolves them) · ``request`` (settings,
requests, sequences) · ``scheduler`` (token budget, admission, prefix matching and commits,
preemption, forks, cancels: every sequence's lifecycle, over ``hf_paged.blocks``) · ``runner`` (packed
forward, EngineCache) · ``sampler`` · ``stop_strings`` (shared with the server's text streams) ·
``outputs`` (token events, output records) · ``config`` (vLLM-named knobs, pool sizing) · ``stats``
(counters and the read-only snapshot) · ``engine`` (one step) · ``llm`` (lists of prompts, streams).
"""
from .config import EngineConfig
from .engine import Engine
from .llm import LLM, generate_many
from .outputs import CompletionOutput, RequestOutput, TokenEvent
from .request import SamplingParams

__all__ = ["CompletionOutput", "Engine", "EngineConfig", "LLM", "RequestOutput", "SamplingParams", "TokenEvent",
           "generate_many"]
