"""The text of new tokens as a continuation of their prompt: one rule for the engine's outputs, its stop
strings and the server's streams.

Decoded alone, new tokens can lose text that belongs to them: a SentencePiece tokenizer (Llama 2, Mistral)
drops the space that begins a decode's first token, and a word-level decoder joins words with spaces only
between them. As vLLM's detokenizer and transformers' text-generation pipeline do, the new tokens are decoded
after the prompt's last ``CONTEXT`` tokens and the context's own text is removed: prompt text + new text
reads as the whole sequence decoded.
"""
from __future__ import annotations

CONTEXT = 5          # prompt tokens decoded before the new ones (vLLM's initial detokenization offset)
REPLACEMENT = "\ufffd"


def complete_characters(text: str) -> str:
    """``text`` less a trailing U+FFFD: the decode of a character whose bytes the last tokens only began
    (a sequence cut by max_tokens inside an emoji). vLLM's detokenizer never emits one; neither do we."""
    return text.rstrip(REPLACEMENT)


def continuation(tokenizer, context, ids, **decode_kwargs) -> str:
    """The text ``ids`` add after ``context`` (a prompt's last tokens, or none): decode(context + ids) less
    decode(context); ``ids`` decoded alone where the first does not begin with the second (a context that
    ends inside a character)."""
    context, ids = list(context), list(ids)
    if not context:
        return tokenizer.decode(ids, **decode_kwargs)
    ahead = tokenizer.decode(context, **decode_kwargs)
    whole = tokenizer.decode(context + ids, **decode_kwargs)
    if whole.startswith(ahead):
        return whole[len(ahead):]
    return tokenizer.decode(ids, **decode_kwargs)
