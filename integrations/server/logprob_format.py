"""Log-probability entries ({token id: Logprob}, from the engine) in the shapes OpenAI's and vLLM's clients read.

- completions ``logprobs``: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, one item per
  token; a prompt's first token (echo) has ``None`` for its logprob and its top dict; a top dict maps
  each token's text to its logprob: the token itself and the ``k`` most likely (``k + 1`` entries, or
  ``k`` when it is among them), as vLLM's; ``text_offset`` counts characters from the start of the
  choice's text (lm-eval reads ``token_logprobs`` and ``top_logprobs``);
- chat ``logprobs.content[]``: ``{"token", "logprob", "bytes", "top_logprobs": [k: the chosen token, then the
  most likely by rank]}`` (vLLM's order: the same as by rank wherever the chosen token is the most likely);
- vLLM's ``prompt_logprobs``: ``[None, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]``.

``-inf`` (a token the model gives no chance) is written -9999.0, as vLLM writes it: JSON has no infinity.
"""
from __future__ import annotations

import math

FLOOR = -9999.0


def clamp(logprob: float) -> float:
    return FLOOR if math.isnan(logprob) or logprob < FLOOR else logprob


class LogprobFormat:
    """Renders one call's entries. ``k``: the top tokens asked per entry (None: no logprobs asked)."""

    def __init__(self, tokenizer, k: int | None, as_token_ids: bool = False):
        self.tokenizer, self.k, self.as_ids = tokenizer, k, as_token_ids

    def text(self, token: int, logprob=None) -> str:
        """A token's text: ``token_id:N`` with vLLM's return_tokens_as_token_ids, else its own decode."""
        if self.as_ids:
            return f"token_id:{token}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def text_length(self, tokens: list[int], entries: list) -> int:
        """The characters of ``tokens``' texts (as ``completion`` writes them), one after the other."""
        return sum(len(self.text(t, None if e is None else e[t])) for t, e in zip(tokens, entries))

    def _top(self, token: int, entry: dict) -> list[tuple[int, object]]:
        """(id, Logprob) of the token and of the k most likely, the token first."""
        others = sorted(((t, lp) for t, lp in entry.items() if t != token), key=lambda x: x[1].rank)
        return [(token, entry[token])] + [(t, lp) for t, lp in others if lp.rank <= (self.k or 0)]

    def completion(self, tokens: list[int], entries: list, offset: int = 0, end: int | None = None) -> dict:
        """The completions ``logprobs`` object for ``tokens``: ``offset`` is where the first one's text
        starts in the choice's text, each next one's is the previous plus its token's text length, at most
        ``end`` when given (a tokenizer's text need not be the concatenation of its tokens' texts, and a stop
        string cuts it)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in zip(tokens, entries):
            own = None if entry is None else entry[token]
            text = self.text(token, own)
            out["tokens"].append(text)
            out["text_offset"].append(offset if end is None else min(offset, end))
            offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(clamp(own.logprob))
            out["top_logprobs"].append({self.text(t, lp): clamp(lp.logprob) for t, lp in self._top(token, entry)})
        return out

    def _chat_item(self, token: int, logprob, chosen: bool = False) -> dict:
        """One chat item; the chosen token's ``bytes`` are its own text's even as ``token_id:N`` (vLLM's)."""
        text = self.text(token, logprob)
        own = logprob.decoded_token if chosen and self.as_ids and logprob.decoded_token is not None else text
        return {"token": text, "logprob": clamp(logprob.logprob), "bytes": list(own.encode("utf-8"))}

    @staticmethod
    def merged(pieces: list[dict]) -> dict:
        """One completions ``logprobs`` object from those of consecutive deltas."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for piece in pieces:
            for key in out:
                out[key] += piece[key]
        return out

    def chat(self, tokens: list[int], entries: list) -> list[dict]:
        """Chat's ``logprobs.content`` items for ``tokens``; ``top_logprobs``: the first k of the chosen token and
        then the others by rank (vLLM's: a sampled token outside the top k comes first and the k-th goes)."""
        items = []
        for token, entry in zip(tokens, entries):
            item = self._chat_item(token, entry[token], chosen=True)
            item["top_logprobs"] = [self._chat_item(t, lp) for t, lp in self._top(token, entry)[:self.k or 0]]
            items.append(item)
        return items


def prompt_logprobs(entries: list | None, k: int) -> list | None:
    """vLLM's ``prompt_logprobs`` list: None for the first token, then {"<id>": {logprob, rank,
    decoded_token}} with the prompt token and its ``k`` most likely alternatives."""
    if entries is None:
        return None
    out = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        first = next(iter(entry))
        out.append({str(t): {"logprob": clamp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
                    for t, lp in entry.items() if t == first or lp.rank <= k})
    return out
