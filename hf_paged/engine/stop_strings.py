"""Stop strings: text that ends a sequence — one definition for the engine and the server.

Two readers, one rule (a stop string is found as a plain substring of the decoded text):
- the engine ends a sequence (``finish_reason == "stop_string"``) as soon as the decoded tail of its
  new tokens contains one (``StopStrings.in_tail``); the text keeps the stop string, as generate's does;
- the server's ``TextStream`` cuts the text before the first one (``StopStrings.cut``, OpenAI's
  ``stop``) and, while the sequence runs, holds back the last ``hold`` characters, which may be the
  beginning of one.
"""
from __future__ import annotations

from .continuation import continuation


class StopStrings:
    """A tuple of stop strings (as given: the caller drops empty ones if it must)."""

    __slots__ = ("strings", "hold", "window")

    def __init__(self, strings=()):
        self.strings: tuple[str, ...] = tuple(strings)
        longest = max((len(s) for s in self.strings), default=1)
        self.hold = longest - 1           # characters that may begin a stop string not seen whole yet
        # new tokens the engine decodes: a token is at least one byte of text, not one character (byte-level
        # BPE spends up to 4 tokens on a character: "終わり" is 7 of SmolLM2's), plus 2 for the token before
        self.window = max((len(s.encode("utf-8")) for s in self.strings), default=1) + 2

    def __bool__(self) -> bool:
        return bool(self.strings)

    def first(self, text: str, after: int = 0) -> int | None:
        """Index in ``text`` of the earliest stop string that ends after its first ``after`` characters, or None."""
        found = self.earliest(text, after)
        return None if found is None else found[0]

    def earliest(self, text: str, after: int = 0) -> tuple[int, str] | None:
        """(index, stop string) of the earliest stop string in ``text`` that ends after its first ``after``
        characters (of those starting there, the first given), or None."""
        best = None
        for stop in self.strings:
            at = text.find(stop, max(0, after - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        return best

    def cut(self, text: str, keep: bool = False, after: int = 0) -> tuple[str, bool]:
        """(``text`` up to the first stop string — through it when ``keep`` —, whether one was found);
        ``after``: only stop strings ending after that many characters count (vLLM's ``min_tokens``)."""
        at = self.first(text, after) if self.strings else None
        if at is None:
            return text, False
        if keep:
            at += max(len(s) for s in self.strings if text.startswith(s, at) and at + len(s) > after)
        return text[:at], True

    def in_tail(self, tokenizer, token_ids: list[int], num_output: int, min_tokens: int = 0) -> str | None:
        """The stop string the text of a sequence's new tokens (the last ``num_output`` of ``token_ids``)
        holds in its last ``window`` tokens' text (the earliest), or None; the text is decoded as the
        continuation of the token before them (``hf_paged.engine.continuation``); with ``min_tokens``
        (vLLM's), only stop strings ending after the first ``min_tokens`` new tokens' text count."""
        if num_output <= min_tokens:
            return None
        first = len(token_ids) - min(num_output, self.window)      # the first new token decoded
        context = token_ids[max(0, first - 1):first]
        held = len(token_ids) - num_output + min_tokens             # token_ids[:held]: the prompt and min_tokens
        after = len(continuation(tokenizer, context, token_ids[first:held])) if held > first else 0
        found = self.earliest(continuation(tokenizer, context, token_ids[first:]), after)
        return None if found is None else found[1]
