"""Intake of a request: its prompt as token ids, and whether it can ever run.

Two kinds of bad input, two outcomes: a malformed call (an empty prompt, text without a tokenizer, an
unknown setting) raises ValueError at once; a well-formed request that can never fit (``never_fits``)
is accepted and fails alone — its output carries the message and the other requests run.
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping

import torch


def token_ids(prompt, tokenizer, vocab_size: int | None = None) -> list[int]:
    """``prompt`` (a str, a list of ids, a LongTensor [T] or [1, T], or vLLM's prompt dicts ``{"prompt": text}`` /
    ``{"prompt_token_ids": ids}``) as a non-empty list of ints, each in ``range(vocab_size)`` (the model's
    embedding rows) when given."""
    if isinstance(prompt, Mapping):
        prompt = _prompt_dict(prompt)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer: Engine(model, tokenizer=...) or pass token ids")
        prompt = tokenizer(prompt)["input_ids"]
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        prompt = prompt.tolist()
    ids = [t if type(t) is int else _token_id(t) for t in prompt]
    if not ids:
        raise ValueError("empty prompt: a request needs at least one token (add a BOS token or some text)")
    if vocab_size is not None and not 0 <= min(ids) <= max(ids) < vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise ValueError(f"prompt token id {bad} (position {ids.index(bad)}) is outside the model's vocabulary of "
                         f"{vocab_size} ids (0..{vocab_size - 1}): was the prompt tokenized for another model?")
    return ids


def _prompt_dict(prompt: Mapping):
    """The text or ids of vLLM's TextPrompt / TokensPrompt; any other mapping (a tokenizer's output with its
    attention_mask, multimodal data) refused by its keys."""
    keys = set(prompt)
    if keys == {"prompt"} or keys == {"prompt_token_ids"}:
        return prompt[keys.pop()]
    hint = (" (a tokenizer's output: pass its input_ids, one list of ids per prompt, without padding)"
            if "input_ids" in keys else "")
    raise ValueError(f"a prompt dict takes 'prompt' (a text) or 'prompt_token_ids' (ids), as vLLM's TextPrompt / "
                     f"TokensPrompt, and nothing else; got keys {sorted(map(str, keys))}{hint}")


def _token_id(t) -> int:
    """An integer token id (a NumPy or 0-d tensor integer too); a float or a bool is refused, not truncated."""
    if isinstance(t, torch.Tensor) and t.dim() == 0 and not t.is_floating_point() and t.dtype != torch.bool:
        return int(t)
    if isinstance(t, bool) or not isinstance(t, numbers.Integral):
        raise ValueError(f"token ids must be integers, got {t!r} ({type(t).__name__})")
    return int(t)


def never_fits(prompt_len: int, max_new_tokens: int, num_return_sequences: int, *, max_model_len: int,
               max_num_seqs: int, block_size: int, num_blocks: int, rope_limit: tuple[str, int] | None = None,
               model_len: int | None = None) -> str | None:
    """Why a request of ``prompt_len`` tokens, ``max_new_tokens`` new ones and ``num_return_sequences``
    sequences can never run on this engine (the message names the value, the limit and the knob), or None.
    rope_limit: (rope type, tokens) of a RoPE whose frequencies follow each forward's longest position
    (``hf_paged.introspect.length_dependent_rope``). model_len: the model's own context where the engine lowered
    max_model_len to what its KV pool holds (then the pool is the limit named, and its size the knob)."""
    if max_new_tokens < 1:       # generate raises "Input length of input_ids is ..." for these
        return (f"input length of {prompt_len} tokens is >= max_length={prompt_len + max_new_tokens} (prompt + "
                "new tokens, as model.generate counts it, which raises for this prompt): set max_new_tokens, "
                "or a larger max_length.")
    pool = (f"the {max_model_len} tokens the KV pool holds (max_model_len, lowered from the model's {model_len}; "
            "num_blocks, kv_cache_memory_bytes or, on a GPU, gpu_memory_utilization sets it)") if model_len else None
    if prompt_len > max_model_len:
        if pool:
            return f"prompt of {prompt_len} tokens exceeds {pool}. Shorten the prompt or enlarge the pool."
        return (f"prompt of {prompt_len} tokens exceeds the model's context of {max_model_len} tokens "
                "(max_model_len). Shorten the prompt or raise max_model_len.")
    total = prompt_len + max_new_tokens
    if prompt_len == max_model_len and max_new_tokens == 1:
        # A prompt that fills the context still gets one token, as in vLLM's engine (a request stops once it
        # holds max_model_len tokens): sampled from the prompt's last logits, it never enters the model, so
        # it needs no position and no KV slot. lm-eval's loglikelihood windows of exactly max_length tokens
        # ask it (echo, max_tokens=0).
        total = max_model_len
    if total > max_model_len:
        if pool:
            return (f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} = {total} tokens exceeds "
                    f"{pool}. Shorten the prompt, lower max_new_tokens or enlarge the pool.")
        return (f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} = {total} tokens exceeds the "
                f"model's context of {max_model_len} (max_model_len). Shorten the prompt or lower max_new_tokens.")
    if rope_limit is not None and total > rope_limit[1]:
        kind, limit = rope_limit
        return (f"prompt + max_new_tokens = {total} tokens, but this model's RoPE ({kind!r}) changes its frequencies "
                f"past {limit} tokens, and transformers computes them from the longest position of each forward: in "
                f"the engine's packed steps a request's positions would depend on its neighbours. Requests up to "
                f"{limit} tokens run exactly; generate longer ones with model.generate (its batch is its own).")
    if num_return_sequences > max_num_seqs:
        return (f"num_return_sequences={num_return_sequences} sequences must run together but max_num_seqs="
                f"{max_num_seqs}. Raise max_num_seqs or lower num_return_sequences.")
    blocks = -(-total // block_size)
    if blocks > num_blocks:
        return (f"prompt + max_new_tokens = {total} tokens need {blocks} blocks but the whole KV pool holds "
                f"{num_blocks}. Raise kv_cache_memory_bytes / num_blocks / gpu_memory_utilization, or lower "
                "max_new_tokens.")
    return None
