"""Generation settings resolved as ``model.generate`` resolves them — one function for every route.

``resolve_generation(model.generation_config, **kwargs)`` runs the steps of transformers'
``GenerationMixin._prepare_generation_config`` (identical in 5.17 and 5.24): start from the passed
``generation_config`` (or a blank ``GenerationConfig``), fill what is unset from the model's generation
config, then from transformers' global defaults (``top_k=50``, ``max_length=20``, ``temperature=1.0``,
...), then apply the keyword arguments through ``GenerationConfig.update`` (which validates them).
It records, as ``generate`` does before merging, whether ``max_length`` is transformers' default:
then ``generate`` makes 20 *new* tokens whatever the prompt length (capped by the model's
``max_position_embeddings``); an explicit ``max_length`` counts the prompt (see
``SamplingParams.new_tokens_for``). The engine, the pipeline route and the server all call this.
"""
from __future__ import annotations

import copy
import numbers

import torch
from transformers import GenerationConfig

from .request import SamplingParams
from .processors import generate_processors
from .sampler import warpers

# Settings generate knows that the engine does not implement (non-default values are refused).
UNSUPPORTED = dict(num_beams=1, num_beam_groups=1, no_repeat_ngram_size=0,
                   penalty_alpha=None, typical_p=1.0, top_h=None, epsilon_cutoff=0.0, eta_cutoff=0.0,
                   force_words_ids=None, suppress_tokens=None, begin_suppress_tokens=None,
                   forced_bos_token_id=None, forced_eos_token_id=None, guidance_scale=None,
                   prompt_lookup_num_tokens=None, encoder_repetition_penalty=1.0,
                   exponential_decay_length_penalty=None, watermarking_config=None, dola_layers=None,
                   token_healing=False)
# vLLM's settings that GenerationConfig does not have (hf_paged.engine.processors, .logprobs, .structured).
# vLLM's SamplingParams names that generate spells otherwise (named in the refusal of an unknown setting)
VLLM_RENAMES = {"max_tokens": "max_new_tokens", "n": "num_return_sequences", "stop": "stop_strings"}
ENGINE_ONLY = ("seed", "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty", "logit_bias",
               "allowed_token_ids", "stop_token_ids", "logprobs", "prompt_logprobs", "structured_output",
               "thinking_budget")


def merged_generation_config(model_generation_config, generation_config=None, **kwargs):
    """(GenerationConfig as generate uses it, unused kwargs, whether max_length is transformers' default).

    The steps of ``GenerationMixin._prepare_generation_config`` plus generate's ``has_default_max_length``."""
    model_config = model_generation_config if model_generation_config is not None else GenerationConfig()
    default_max_length = (kwargs.get("max_length") is None
                          and (generation_config is None or generation_config.max_length is None)
                          and model_config.max_length is None)
    config = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    config.update(**model_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    config.update(**model_config._get_default_generation_params(), defaults_only=True)
    unused = config.update(**kwargs)
    return config, unused, default_max_length


def resolve_generation(model_generation_config, **kwargs) -> SamplingParams:
    """The settings of one request, as ``model.generate(**kwargs)`` would resolve them on this model.

    kwargs: GenerationConfig fields (and ``generation_config=``, as generate takes it) plus the engine's
    ``seed`` and ``ignore_eos``. Unknown names and settings the engine does not implement raise
    ValueError; so do values transformers refuses (e.g. ``temperature=0`` with sampling)."""
    engine_only = {k: kwargs.pop(k) for k in ENGINE_ONLY if k in kwargs}
    min_tokens = engine_only.pop("min_tokens", None)
    if min_tokens is not None:        # vLLM's: min_new_tokens that stop strings wait for too
        if kwargs.get("min_new_tokens") is not None:
            raise ValueError("pass min_tokens (vLLM's: stop strings wait for it too) or min_new_tokens, not both")
        if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {min_tokens!r}")
        kwargs["min_new_tokens"] = min_tokens
    passed = kwargs.pop("generation_config", None)
    config, unknown, default_max_length = merged_generation_config(model_generation_config, passed, **kwargs)
    if unknown:
        renamed = [f"{name} -> {VLLM_RENAMES[name]}" for name in sorted(unknown) if name in VLLM_RENAMES]
        raise ValueError(f"unknown generation argument(s) {sorted(unknown)}: the engine accepts "
                         "GenerationConfig fields (max_new_tokens, do_sample, temperature, top_k, top_p, min_p, "
                         "repetition_penalty, bad_words_ids, sequence_bias, stop_strings, num_return_sequences, ...) "
                         f"plus {', '.join(ENGINE_ONLY)}"
                         + (f" (vLLM's names here: {', '.join(renamed)})" if renamed else ""))
    for name, default in UNSUPPORTED.items():
        value = getattr(config, name, default)
        if value is not None and value != default:
            raise ValueError(f"{name}={value!r} is not supported by the hf_paged engine (supported: greedy "
                             "and sampling with temperature/top_k/top_p); use model.generate for it")
    for name in ("max_new_tokens", "max_length", "min_new_tokens", "min_length"):
        value = getattr(config, name, None)       # a float (NaN: a null of a Ray Data int column) never stops
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if config.max_new_tokens is not None and config.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {config.max_new_tokens}")
    eos = None if engine_only.get("ignore_eos") else config.eos_token_id
    eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
    stops = config.stop_strings
    stops = () if not stops else (stops,) if isinstance(stops, str) else tuple(stops)
    n = config.num_return_sequences
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"num_return_sequences must be a positive int, got {n!r}")
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        value = getattr(config, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise ValueError(f"{name} must be a number, got {value!r}")
    if any(not isinstance(stop, str) or not stop for stop in stops):
        raise ValueError("stop_strings must be non-empty strings (an empty one would stop at once), "
                         f"got {list(stops)!r}")
    seed = engine_only.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
                             or not -2**63 <= seed <= 2**64 - n):
        # sequence j samples with its own generator seeded seed + j: torch takes seeds in [-2**63, 2**64)
        raise ValueError(f"seed must be an int in [-2**63, 2**64 - num_return_sequences], got {seed!r}")
    if config.do_sample and seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())      # from the global RNG: manual_seed reproduces it
    params = SamplingParams(
        max_new_tokens=config.max_new_tokens, max_length=config.max_length,
        min_new_tokens=config.min_new_tokens, min_length=config.min_length or 0,
        do_sample=bool(config.do_sample), temperature=float(config.temperature), top_k=config.top_k,
        top_p=float(config.top_p), eos_token_ids=eos_ids, pad_token_id=config.pad_token_id, stop_strings=stops,
        num_return_sequences=n, seed=seed, default_max_length=default_max_length,
        repetition_penalty=float(config.repetition_penalty if config.repetition_penalty is not None else 1.0),
        min_p=None if config.min_p is None else float(config.min_p),
        bad_words_ids=tuple(tuple(w) for w in config.bad_words_ids) if config.bad_words_ids else None,
        sequence_bias=config.sequence_bias or None, stop_strings_wait=min_tokens is not None,
        **vllm_settings(engine_only))
    if params.do_sample:
        warpers(params)            # transformers' own warpers refuse bad temperature / top_k / top_p now
    if params.bad_words_ids and any(not w or any(not isinstance(t, int) or t < 0 for t in w)
                                    for w in params.bad_words_ids):
        raise ValueError(f"bad_words_ids must be non-empty lists of token ids >= 0, got {config.bad_words_ids!r}")
    generate_processors(params)    # and its processors bad penalties / bad words
    return params


def _token_set(name: str, ids) -> frozenset | None:
    if ids is None:
        return None
    ids = [ids] if isinstance(ids, int) else list(ids)
    if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
        raise ValueError(f"{name} must be non-negative token ids, got {ids!r}")
    return frozenset(ids)


def _count(name: str, value) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"{name} must be an int >= 0 (the number of top tokens to return), got {value!r}")
    return value


def vllm_settings(given: dict) -> dict:
    """SamplingParams fields of vLLM's settings (``ENGINE_ONLY`` but seed / ignore_eos / min_tokens), checked."""
    out = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = float(given.get(name) or 0.0)
        if not -2.0 <= value <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2] (OpenAI's range), got {value!r}")
        out[name] = value
    bias = given.get("logit_bias") or {}
    out["logit_bias"] = tuple(sorted((int(t), float(b)) for t, b in dict(bias).items()))
    if any(t < 0 for t, _ in out["logit_bias"]):
        raise ValueError(f"logit_bias keys must be token ids >= 0, got {dict(bias)!r}")
    allowed = _token_set("allowed_token_ids", given.get("allowed_token_ids"))
    if allowed is not None and not allowed:
        raise ValueError("allowed_token_ids is empty: no token could be generated")
    out["allowed_token_ids"] = allowed
    out["stop_token_ids"] = _token_set("stop_token_ids", given.get("stop_token_ids")) or frozenset()
    out["logprobs"] = _count("logprobs", given.get("logprobs"))
    out["prompt_logprobs"] = _count("prompt_logprobs", given.get("prompt_logprobs"))
    out["structured_output"] = given.get("structured_output")
    budget = given.get("thinking_budget")
    if budget is not None and not (isinstance(budget, tuple) and len(budget) == 3
                                   and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in budget)):
        raise ValueError(f"thinking_budget must be (start token id, end token id, tokens >= 0), got {budget!r}")
    out["thinking_budget"] = budget
    return out


__all__ = ["merged_generation_config", "resolve_generation"]
