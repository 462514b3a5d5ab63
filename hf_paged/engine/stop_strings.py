"""Stop strings: text that ends a sequence — one definition for the engine and the server.

Two readers, one rule (a stop string is found as a plain substring of the decoded text):
- the engine ends a sequence (``finish_reason == "stop_string"``) as soon as the decoded tail of its
  new tokens contains one (``StopStrings.in_tail``); the text keeps the stop string, as generate's does;
- the server's ``TextStream`` cuts the text before the first one (``StopStrings.cut``, OpenAI's
  ``stop``) and, while the sequence runs, holds back the last ``hold`` characters, which may be the
  beginning of one.
"""
from __future__ import annotations


class StopStrings:
    """A tuple of stop strings (as given: the caller drops empty ones if it must)."""

    __slots__ = ("strings", "hold", "window")

    def __init__(self, strings=()):
        self.strings: tuple[str, ...] = tuple(strings)
        longest = max((len(s) for s in self.strings), default=1)
        self.hold = longest - 1           # characters that may begin a stop string not seen whole yet
        self.window = longest + 2         # new tokens the engine decodes: each token is >= 1 character

    def __bool__(self) -> bool:
        return bool(self.strings)

    def first(self, text: str) -> int | None:
        """Index in ``text`` of the earliest stop string, or None."""
        hits = [i for i in (text.find(s) for s in self.strings) if i >= 0]
        return min(hits) if hits else None

    def cut(self, text: str, keep: bool = False) -> tuple[str, bool]:
        """(``text`` up to the first stop string — through it when ``keep`` —, whether one was found)."""
        at = self.first(text) if self.strings else None
        if at is None:
            return text, False
        if keep:
            at += max(len(s) for s in self.strings if text.startswith(s, at))
        return text[:at], True

    def in_tail(self, tokenizer, output_ids: list[int]) -> bool:
        """Whether the decoded last ``window`` of ``output_ids`` (a sequence's new tokens) contains one."""
        text = tokenizer.decode(output_ids[-self.window:])
        return any(s in text for s in self.strings)
