"""Log-probabilities as vLLM hands them back (STUB: being built)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability under the model's raw next-token distribution (log_softmax of the
    logits, before any penalty, bias, mask or temperature: vLLM's ``logprobs_mode="raw_logprobs"``);
    ``rank``: 1 for the most likely token; ``decoded_token``: its text when the engine has a tokenizer."""
    logprob: float
    rank: int
    decoded_token: str | None = None
