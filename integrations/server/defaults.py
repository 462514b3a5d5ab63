"""What a request leaves unset, as vLLM's server fills it in.

vLLM samples at temperature 1.0 with top_p 1, no top_k / min_p and no repetition penalty unless the
request says otherwise; with ``--generation-config auto`` (its default) the model's generation config
overrides those defaults where its file sets ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` (and ``max_new_tokens``: the max_tokens of a request that gives none). Nothing else of the
generation config applies (``do_sample``, ``no_repeat_ngram_size``, ...), except its EOS, BOS and pad ids.
``--generation-config vllm`` ignores the file. A temperature below ``GREEDY_BELOW`` decodes greedily.
"""
from __future__ import annotations

from dataclasses import dataclass

GREEDY_BELOW = 1e-5                 # vLLM's _SAMPLING_EPS
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
SOURCES = ("auto", "vllm")


@dataclass(frozen=True)
class SamplingDefaults:
    """vLLM's defaults, overridden by the model's generation config (``from_model``). top_k 0: off."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None    # the generation config's max_new_tokens: for requests that give none

    @classmethod
    def from_model(cls, generation_config, source: str = "auto") -> SamplingDefaults:
        """``source`` "auto": the values ``generation_config`` sets other than transformers' defaults (as
        vLLM reads ``to_diff_dict()``); "vllm": none."""
        if source not in SOURCES:
            raise ValueError(f"generation_config must be one of {SOURCES}, got {source!r}")
        if source == "vllm" or generation_config is None:
            return cls()
        diff = generation_config.to_diff_dict()
        found = {name: diff[name] for name in SAMPLING_FIELDS if diff.get(name) is not None}
        if found.get("top_k", 0) < 0:
            found["top_k"] = 0
        max_new = diff.get("max_new_tokens")
        return cls(**found, max_tokens=max_new if isinstance(max_new, int) and max_new > 0 else None)

    def overridden(self) -> dict:
        """The fields that differ from vLLM's own defaults (for the start-up log)."""
        plain = SamplingDefaults()
        return {name: getattr(self, name) for name in (*SAMPLING_FIELDS, "max_tokens")
                if getattr(self, name) != getattr(plain, name)}


def server_generation_config(generation_config):
    """The base every request resolves on: the model's EOS / BOS / pad ids, nothing else of its config."""
    from transformers import GenerationConfig  # noqa: PLC0415

    ids = {name: getattr(generation_config, name, None) for name in ("eos_token_id", "bos_token_id", "pad_token_id")}
    return GenerationConfig(**{k: v for k, v in ids.items() if v is not None})
