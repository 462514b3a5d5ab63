"""Log-probabilities as vLLM hands them back, from the model's raw next-token distribution.

Which distribution: ``log_softmax`` of the float32 logits the model produced, before any penalty,
bias, temperature or top-k/top-p/min-p (vLLM's default ``logprobs_mode="raw_logprobs"``; the same as
``log_softmax`` of ``generate(output_logits=True)``'s logits); under a grammar, of those logits with the
grammar's mask (vLLM masks them before its sampler; ``sampler.sampled_logprobs``). A token's entry is a dict
``{token id: Logprob}`` holding the chosen (or prompt) token first, then the ``k`` most likely tokens
(the chosen one may be among them: then the dict has ``k`` entries, else ``k + 1``), as vLLM's.
"""
from __future__ import annotations

import json
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
    """A token's text as vLLM's log-probabilities show it: ``tokenizer.decode([id])`` (remembered, a
    vocabulary's worth at most), with the leading spaces a SentencePiece ("▁") token's decode drops put back;
    a token that ends inside a UTF-8 character (byte-level BPE, byte fallback: its decode ends in U+FFFD) is
    read after up to ``CONTEXT`` tokens before it (:meth:`in_context`): "" while the character is incomplete,
    the whole character on the token that completes it, so that the texts join into the text."""

    CONTEXT = 4

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.texts: dict[int, str] = {}
        self._marker = _space_marker(tokenizer) if tokenizer is not None else None

    def __call__(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self.texts.get(token)
        if text is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            if self._marker is not None:
                piece = self.tokenizer.convert_ids_to_tokens(token) or ""
                missing = (len(piece) - len(piece.lstrip(self._marker))) - (len(text) - len(text.lstrip(" ")))
                text = " " * missing + text if missing > 0 else text
            self.texts[token] = text
        return text

    def in_context(self, token: int, context: list[int]) -> str | None:
        """``token``'s text after the tokens ``context`` (the sequence's, oldest first), as vLLM's
        ``_correct_decoded_token``: its own text unless that ends in U+FFFD; then the text the shortest run
        of the last tokens completes with it, less what the complete tokens before that run wrote ("" when
        none completes it)."""
        text = self(token)
        if text is None or not text.endswith("\ufffd"):
            return text
        decode = self.tokenizer.decode
        for size in range(1, min(len(context), self.CONTEXT) + 1):
            run = list(context[-size:])
            whole = decode(run + [token])
            if whole.endswith("\ufffd"):
                continue
            clean = len(run)        # the run's last tokens that are themselves partial belong to this token
            while clean > 0 and self(run[clean - 1]).endswith("\ufffd"):
                clean -= 1
            prefix = decode(run[:clean]) if clean else ""
            if whole.startswith(prefix):
                return whole[len(prefix):]
            same = 0
            for a, b in zip(prefix, whole):
                if a != b:
                    break
                same += 1
            return whole[same:]
        return ""


def _space_marker(tokenizer) -> str | None:
    """The Metaspace replacement ("▁") of a SentencePiece-style fast tokenizer, whose decode of one token
    drops its leading space; None for byte-level and the others (vLLM's ``get_leading_space_marker``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        pre = json.loads(backend.to_str()).get("pre_tokenizer") or {} if backend is not None else {}
    except (ValueError, AttributeError, TypeError):
        return None
    for sub in [pre] + list(pre.get("pretokenizers") or []):
        if isinstance(sub, dict) and sub.get("type") == "Metaspace":
            return sub.get("replacement", "\u2581")
    return None


def logprob_entries(logits: torch.Tensor, chosen: list[int], ks: list[int], texts: TokenTexts,
                    contexts: list[list[int]] | None = None) -> list[dict]:
    """One entry per row: logits float32 [R, V] (raw), ``chosen[r]`` the row's token, ``ks[r]`` how many
    top tokens to add, ``contexts[r]``: the tokens before the row's position that its texts are read after
    (``TokenTexts.in_context``; None: each token's own text). Batched: one log_softmax, one top-k over the rows."""
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
        context = contexts[r] if contexts is not None else None
        text = texts if context is None else (lambda t: texts.in_context(t, context))
        entry = {token: Logprob(own[r], ranks[r], text(token))}
        for rank in range(min(ks[r], k)):
            tid = top_ids[r][rank]
            if tid not in entry:
                entry[tid] = Logprob(top_values[r][rank], rank + 1, text(tid))
        entries.append(entry)
    return entries


__all__ = ["Logprob", "TokenTexts", "logprob_entries"]
