"""Log-probabilities as vLLM hands them back, from the model's raw next-token distribution.

Which distribution: ``log_softmax`` of the float32 logits the model produced, before any penalty,
bias, temperature or top-k/top-p/min-p (vLLM's default ``logprobs_mode="raw_logprobs"``; the same as
``log_softmax`` of ``generate(output_logits=True)``'s logits); under a grammar, of those logits with the
grammar's mask (vLLM masks them before its sampler; ``sampler.sampled_logprobs``). A token's entry is a dict
``{token id: Logprob}`` holding the chosen (or prompt) token first, then the ``k`` most likely tokens
(the chosen one may be among them: then the dict has ``k`` entries, else ``k + 1``), as vLLM's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability under the raw distribution; ``rank``: 1 for the most likely token
    (ties share the better rank); ``decoded_token``: ``tokenizer.decode([id])`` when the engine has a
    tokenizer (special tokens kept), as vLLM's."""
    logprob: float
    rank: int
    decoded_token: str | None = None


class TokenTexts:
    """``tokenizer.decode([id])`` per token id, remembered (a vocabulary's worth at most)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.texts: dict[int, str] = {}

    def __call__(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self.texts.get(token)
        if text is None:
            text = self.texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text


def logprob_entries(logits: torch.Tensor, chosen: list[int], ks: list[int], texts: TokenTexts) -> list[dict]:
    """One entry per row: logits float32 [R, V] (raw), ``chosen[r]`` the row's token, ``ks[r]`` how many
    top tokens to add. Batched: one log_softmax, one top-k over the rows."""
    if not chosen:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = torch.tensor(chosen, dtype=torch.long, device=logprobs.device)
    own = logprobs.gather(1, picked.view(-1, 1))
    ranks = ((logprobs > own).sum(-1) + 1).tolist()
    own = own.view(-1).tolist()
    k = min(max(ks), logprobs.shape[-1])
    top_values, top_ids = (logprobs.topk(k, dim=-1) if k else (None, None))
    top_values = top_values.tolist() if k else None
    top_ids = top_ids.tolist() if k else None
    entries = []
    for r, token in enumerate(chosen):
        entry = {token: Logprob(own[r], ranks[r], texts(token))}
        for rank in range(min(ks[r], k)):
            tid = top_ids[r][rank]
            if tid not in entry:
                entry[tid] = Logprob(top_values[r][rank], rank + 1, texts(tid))
        entries.append(entry)
    return entries


__all__ = ["Logprob", "TokenTexts", "logprob_entries"]
