"""The settings that name tokens (logit_bias, bad_words, allowed_token_ids, stop_token_ids) and the
log-probability counts, checked against the served model: every id in its vocabulary, every count
within ``max_logprobs``. Each returns None for a neutral value, so the key stays out of the settings.
"""
from __future__ import annotations

from typing import Optional

from ..vllm_params import bad_word_spellings
from .errors import ApiError

LOGIT_BIAS_RANGE = 100.0        # OpenAI: "values between -100 and 100"; beyond them clamped
MAX_BAD_WORDS = 128             # words per request (vLLM's VLLM_MAX_NUM_BAD_WORDS default)

def in_vocab(state, ids: list[int], param: str) -> list[int]:
    vocab = state.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is outside the vocabulary: token ids must be in [0, {vocab})",
                       param=param)
    return ids


def token_list(state, ids: Optional[list[int]], param: str) -> Optional[list[int]]:
    """allowed_token_ids / stop_token_ids: None when absent or empty (vLLM's default ``[]``)."""
    return in_vocab(state, list(ids), param) if ids else None


def logit_bias(state, bias: Optional[dict[str, float]]) -> Optional[dict[int, float]]:
    """OpenAI's ``{"token id": bias}`` as ``{int: float}``, each bias clamped to [-100, 100]."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not key.isascii() or not key.isdigit():
            raise ApiError(400, f"logit_bias key {key!r:.40} is not a token id (a decimal integer >= 0)",
                           param="logit_bias")
        out[in_vocab(state, [int(key)], "logit_bias")[0]] = max(-LOGIT_BIAS_RANGE, min(LOGIT_BIAS_RANGE, value))
    return out


def bad_words_ids(state, words: Optional[list[str]]) -> Optional[list[list[int]]]:
    """vLLM's rule (SamplingParams.update_from_tokenizer): each word, left-stripped, tokenized without
    special tokens; then with a leading space, kept when that gives a different first token and as many
    tokens (the word in the middle of a text), so both spellings are banned."""
    if not words:
        return None
    if len(words) > MAX_BAD_WORDS:
        raise ApiError(400, f"{len(words)} bad_words: at most {MAX_BAD_WORDS}", param="bad_words")
    out: list[list[int]] = []
    for word in words:
        spellings = bad_word_spellings(lambda text: _encode(state, text), word)
        if not spellings:
            raise ApiError(400, f"bad_words entry {word!r:.40} tokenizes to no token", param="bad_words")
        out += [in_vocab(state, ids, "bad_words") for ids in spellings]
    return out


def _encode(state, text: str) -> list[int]:
    return list(state.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _count(value: Optional[int], param: str, limit: int) -> Optional[int]:
    if value is None:
        return None
    if value == -1:
        raise ApiError(400, f"{param}=-1 (the whole vocabulary) is not supported: at most {limit} "
                            "(max_logprobs, --max-logprobs)", param=param, code="logprobs_too_many")
    if not 0 <= value <= limit:
        raise ApiError(400, f"{param}={value}: at most {limit} (max_logprobs, --max-logprobs)", param=param,
                       code="logprobs_too_many")
    return value


def generated_logprobs(req, chat: bool) -> tuple[Optional[int], str]:
    """(top-k per generated token, or None for none; the field that asked): completions' ``logprobs``,
    chat's ``top_logprobs`` (0 when unset) when ``logprobs`` is true."""
    if chat:
        return ((req.top_logprobs or 0) if req.logprobs else None), "top_logprobs"
    return req.logprobs, "logprobs"


def asked_prompt_logprobs(req, chat: bool) -> Optional[int]:
    """vLLM's ``prompt_logprobs`` of ``req``; a chat ``echo`` (not streamed) asks them with ``top_logprobs``
    (0 unset), as vLLM's chat request does."""
    if chat and req.echo and req.prompt_logprobs is None and not req.stream:
        return req.top_logprobs or 0
    return req.prompt_logprobs


def logprob_counts(state, req, chat: bool) -> tuple[Optional[int], Optional[int]]:
    """(logprobs, prompt_logprobs) for the engine. Completions with ``echo`` and ``logprobs`` need the
    prompt's log-probabilities too (lm-eval's loglikelihood: echo, logprobs=1, max_tokens=1): the
    engine's prompt_logprobs is then the larger of the two counts."""
    limit = state.engine.config.max_logprobs
    k, param = generated_logprobs(req, chat)
    k = _count(k, param, limit)
    prompt_k = _count(asked_prompt_logprobs(req, chat), "prompt_logprobs", limit)
    if not chat and req.echo and k is not None:
        prompt_k = k if prompt_k is None else max(prompt_k, k)
    return k, prompt_k
