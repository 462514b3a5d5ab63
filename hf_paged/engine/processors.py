"""The logits processors of one request: generate's (transformers' own classes, in generate's order)
then vLLM's that generate lacks, then the grammar mask.

Order, as ``GenerationMixin._get_logits_processor`` builds it and vLLM's sampler extends it:

    sequence_bias, repetition_penalty, bad_words_ids, min-new-tokens (EOS and stop_token_ids masked)
    logit_bias (OpenAI: added to the logit), presence_penalty / frequency_penalty (OpenAI's
    definition over the tokens generated so far: logit -= count * frequency + (count > 0) * presence),
    allowed_token_ids (every other token masked), a spent thinking budget (only its end token left), the
    structured-output grammar's token mask,
    then, when sampling, the warpers: temperature, top_k, top_p, min_p (``sampler.warpers``).

transformers' processors read ``input_ids`` = prompt + generated tokens of the sequence (generate's
``input_ids`` for that prompt alone), so the repetition penalty counts prompt tokens as generate does.
"""
from __future__ import annotations

import torch
from transformers.generation.logits_process import (NoBadWordsLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor)


def generate_processors(params) -> list:
    """transformers' processors for ``params`` (built once per request; they also refuse bad values)."""
    chain = []
    if params.sequence_bias:
        chain.append(SequenceBiasLogitsProcessor(sequence_bias=params.sequence_bias))
    if params.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(penalty=params.repetition_penalty))
    if params.bad_words_ids:
        eos = sorted(params.eos_token_ids) or None
        chain.append(NoBadWordsLogitsProcessor([list(w) for w in params.bad_words_ids], eos_token_id=eos))
    return chain


def openai_penalties(scores: torch.Tensor, output_ids: list[int], presence: float, frequency: float) -> None:
    """OpenAI's presence and frequency penalties on ``scores`` [1, V], in place, over ``output_ids``."""
    if not output_ids or not (presence or frequency):
        return
    ids = torch.tensor(output_ids, dtype=torch.long, device=scores.device)
    counts = torch.zeros(scores.shape[-1], dtype=scores.dtype, device=scores.device)
    counts.index_add_(0, ids, torch.ones_like(ids, dtype=scores.dtype))
    scores[0] -= counts * frequency + (counts > 0).to(scores.dtype) * presence


def process_row(scores: torch.Tensor, seq, chain: list) -> torch.Tensor:
    """``scores`` [1, V] (float32) of ``seq`` through its request's processors; returns the result
    (in place where the processor allows). ``chain``: ``generate_processors(params)``."""
    request, params = seq.request, seq.request.params
    if chain:
        input_ids = torch.tensor([seq.token_ids], dtype=torch.long, device=scores.device)
        for processor in chain:
            scores = processor(input_ids, scores)
    if seq.num_output < request.min_new_tokens and params.stops_on:
        scores[:, list(params.stops_on)] = -float("inf")
    if request.bias_ids is not None:       # one op; a token id given twice adds both, as a loop would
        scores[0].index_add_(0, request.bias_ids.to(scores.device), request.bias_values.to(scores.device, scores.dtype))
    openai_penalties(scores, seq.output_ids, params.presence_penalty, params.frequency_penalty)
    if request.allowed_ids is not None:
        keep = request.allowed_ids.to(scores.device)
        masked = torch.full_like(scores, -float("inf"))
        masked[:, keep] = scores[:, keep]
        scores = masked
    if params.thinking_budget is not None and thinking_spent(seq.token_ids, *params.thinking_budget):
        end = params.thinking_budget[1]
        forced = torch.full_like(scores, -float("inf"))
        forced[:, end] = scores[:, end] if torch.isfinite(scores[0, end]) else 0.0
        scores = forced
    return scores


def thinking_spent(token_ids: list[int], start: int, end: int, budget: int) -> bool:
    """Whether ``token_ids`` (prompt and output) are thinking with ``budget`` tokens spent: ``budget`` tokens or
    more follow the last ``start``, with no ``end`` after it (vLLM's thinking_token_budget; the prompt's tokens
    after an opened ``<think>`` count too)."""
    last = _last(token_ids, start)
    return last >= 0 and _last(token_ids, end) < last and len(token_ids) - last - 1 >= budget


def _last(ids: list[int], token: int) -> int:
    try:
        return len(ids) - 1 - ids[::-1].index(token)
    except ValueError:
        return -1


__all__ = ["generate_processors", "openai_penalties", "process_row", "thinking_spent"]
