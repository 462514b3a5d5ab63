"""Next-token choice, as ``model.generate`` makes it for one prompt.

Greedy: argmax of the float32 logits. Sampling: min-new-tokens EOS suppression, then transformers'
own temperature, top-k and top-p warpers (generate's order), softmax and ``torch.multinomial`` with
the sequence's own generator — so a request seeded with ``s`` draws what ``torch.manual_seed(s)``
followed by ``generate`` on that prompt alone draws.
"""
from __future__ import annotations

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


def warpers(params) -> list:
    """generate's sampling warpers for resolved settings, in generate's order (transformers' own classes,
    so they also refuse the values generate refuses)."""
    chain = []
    if params.temperature != 1.0:
        chain.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k is not None and params.top_k != 0:
        chain.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
    if params.top_p < 1.0:
        chain.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
    return chain


def sample(logits: torch.Tensor, seqs: list) -> list[int]:
    """logits: float32 [S, V], one row per sequence in ``seqs``. Returns the next token of each."""
    if not seqs:
        return []
    plain = [not s.request.params.do_sample and s.num_output >= s.request.min_new_tokens for s in seqs]
    tokens = logits.argmax(-1).tolist() if any(plain) else [0] * len(seqs)
    for row, seq in enumerate(seqs):
        if plain[row]:
            continue
        request, params = seq.request, seq.request.params
        scores = logits[row:row + 1]
        if seq.num_output < request.min_new_tokens and params.eos_token_ids:
            scores = scores.clone()
            scores[:, list(params.eos_token_ids)] = -float("inf")
        if not params.do_sample:
            tokens[row] = int(scores.argmax(-1))
            continue
        for warper in warpers(params):
            scores = warper(None, scores)
        probs = torch.softmax(scores, dim=-1).cpu()      # the sequence's generator lives on the CPU
        tokens[row] = int(torch.multinomial(probs, num_samples=1, generator=seq.generator))
    return tokens
