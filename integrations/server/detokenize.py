"""Incremental detokenization for streaming: emit text only when it is final.

Byte-level BPE tokenizers split one multi-byte character (an emoji, most CJK) over several tokens;
decoding a prefix of them gives U+FFFD. As vLLM and TGI do, the text of the tokens since
``prefix_offset`` is decoded and compared with the text of the tokens before ``read_offset``; the
difference is emitted only when it grows and does not end in U+FFFD, so a client never sees a broken
character and the concatenation of the deltas is the whole text (checked again at the end:
``finish()`` emits whatever the full decode adds, but a character the last tokens only began).

``TextStream`` adds OpenAI's stop sequences: the text is cut before the first stop string (after it
with vLLM's ``include_stop_str_in_output``), and while
the sequence runs the last ``len(longest stop) - 1`` characters are held back, since they may begin one
(the rule lives in ``hf_paged.engine.stop_strings``, which the engine's stop strings use too); nothing is held
back where the stop string stays in the text (``include_stop_str_in_output``: vLLM's detokenizer too).

As vLLM's, the decoding starts from the prompt's last tokens (``context``), whose text is not emitted
(``hf_paged.engine.continuation``: decoded alone, a SentencePiece tokenizer's first new token would lose
its leading space). With vLLM's ``min_tokens``, a stop string counts
only where it ends in text after the first ``min_tokens`` tokens'; ``add(token, last_stop=True)`` (the
token that ended the sequence is EOS or a ``stop_token_ids`` token) leaves that token's text out unless
``include_stop_str_in_output``, as vLLM does.
"""
from __future__ import annotations

import logging

from hf_paged.engine.continuation import CONTEXT, REPLACEMENT, complete_characters, continuation
from hf_paged.engine.stop_strings import StopStrings

log = logging.getLogger("hf_paged.server")


class IncrementalDetokenizer:
    """Feed token ids one by one; ``add`` returns the new *final* text (possibly ""). ``context``: the ids
    before the first one (the prompt's last few), decoded with them but never emitted."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, context=()):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = [int(t) for t in context]
        self.context_text = self._decode(self.ids)
        if self.context_text.endswith(REPLACEMENT):     # the context ends inside a character: none
            self.ids, self.context_text = [], ""
        self.first = len(self.ids)                      # ids[first:] are the generated tokens
        self.prefix_offset, self.read_offset = 0, self.first
        self.text = ""

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def add(self, token: int) -> str:
        self.ids.append(int(token))
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new = self._decode(self.ids[self.prefix_offset:])
        if len(new) > len(prefix) and not new.endswith(REPLACEMENT) and new.startswith(prefix):
            delta = new[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def finish(self) -> str:
        """The rest of the text (what the full decode has beyond what was emitted), less a character the
        last tokens only began (vLLM's detokenizer never emits it)."""
        full = complete_characters(continuation(self.tokenizer, self.ids[:self.first], self.ids[self.first:],
                                                skip_special_tokens=self.skip))
        if full.startswith(self.text):
            delta = full[len(self.text):]
            self.text = full
            return delta
        log.warning("incremental decode diverged from the full decode; streamed text kept")  # pragma: no cover
        return ""                                                                             # pragma: no cover


class TextStream:
    """One sequence's streamed text with stop sequences cut off (OpenAI's ``stop``). ``context``: the
    prompt's last ids (see ``IncrementalDetokenizer``); ``min_tokens``: vLLM's, a stop string must end
    after the text of the first ``min_tokens`` tokens."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True,
                 include_stop: bool = False, context=(), min_tokens: int = 0):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, list(context)[-CONTEXT:])
        self.stop = StopStrings(s for s in stop if s)
        self.include_stop = include_stop       # vLLM's include_stop_str_in_output: the text keeps it
        self.min_tokens = min_tokens
        self.tokens = 0         # tokens added
        self.boundary = 0       # characters of the first min_tokens tokens: a stop string must end after them
        self.text = ""          # decoded so far (final characters)
        self.sent = 0           # characters of self.text already emitted
        self.stopped = False    # a stop string was found: the text ends before it
        self.stop_string: str | None = None     # which (vLLM's stop_reason)

    def _cut(self) -> None:
        if self.tokens <= self.min_tokens:
            self.boundary = len(self.text)
        found = self.stop.earliest(self.text, self.boundary) if self.stop and not self.stopped else None
        if found is not None:
            self.stop_string = found[1]
            self.text, self.stopped = self.stop.cut(self.text, keep=self.include_stop, after=self.boundary)

    def add(self, token: int, last_stop: bool = False) -> str:
        """The final text ``token`` adds; ``last_stop``: it ended the sequence as EOS or a stop token
        (its text stays out unless include_stop_str_in_output)."""
        if self.stopped:
            return ""
        self.tokens += 1
        if not last_stop or self.include_stop:
            self.text += self.detok.add(token)
        self._cut()
        hold = 0 if self.include_stop else self.stop.hold     # a stop string kept needs no retraction
        end = len(self.text) if self.stopped else max(self.sent, len(self.text) - hold)
        delta, self.sent = self.text[self.sent:end], end
        return delta

    def finish(self) -> str:
        if not self.stopped:
            self.text += self.detok.finish()
            self._cut()
        delta, self.sent = self.text[self.sent:], len(self.text)
        return delta
