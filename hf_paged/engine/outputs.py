"""What the engine hands back: a ``TokenEvent`` per new token, a ``RequestOutput`` per request.

A request's record is written once, when its last sequence finishes or it is cancelled
(``write_record``); before that ``RequestOutput.outputs`` is empty and ``finished`` is False. A
request that failed at intake carries only its ``error``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .continuation import CONTEXT, complete_characters, continuation

import torch


@dataclass(frozen=True)
class TokenEvent:
    """A new token of sequence ``index`` of request ``request_id``; ``finished`` names why it ended, if it did."""
    request_id: int
    index: int
    token: int
    finished: str | None
    logprobs: dict | None = None         # {token id: Logprob}, when the request asks (see engine.logprobs)


@dataclass
class CompletionOutput:
    """One returned sequence: new token ids (EOS included when it ended there) and their text."""
    index: int
    token_ids: list[int]
    text: str | None = None
    finish_reason: str | None = None     # "stop" (EOS), "stop_string", "length", "cancelled", "error"
    logprobs: list | None = None         # one {token id: Logprob} per token, when asked (vLLM's shape)
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop_token_ids entry it ended on, else None


class FailedOutputs(list):
    """``RequestOutput.outputs`` of a failed request: empty (iterating it yields nothing, ``len`` is 0), but
    indexing it raises a RuntimeError that carries the failure instead of a bare IndexError."""

    def __init__(self, index: int, error: str):
        super().__init__()
        self.message = f"request {index} failed: {error}"

    def __getitem__(self, item):
        raise RuntimeError(f"{self.message} (it has no outputs; see RequestOutput.error)")


@dataclass
class RequestOutput:
    """What one request produced, in input order. ``sequences``: LongTensor [n, prompt + longest output]
    (prompt then new tokens, right-padded with ``pad_token_id``), the shape ``model.generate`` returns
    for one prompt with ``num_return_sequences=n``. A request that could not run has ``error`` set
    (the message) and ``finish_reason == "error"``; its ``outputs`` is empty and ``outputs[0]`` /
    ``sequences`` raise RuntimeError with that message. ``prompt_index``: the prompt's position in the
    input list (``index`` names a sequence within a request: CompletionOutput, TokenEvent)."""
    prompt_index: int
    prompt_token_ids: list[int]
    completions: list[CompletionOutput] = field(default_factory=list)
    error: str | None = None
    num_cached_tokens: int = 0
    pad_token_id: int = 0
    prompt_logprobs: list | None = None  # None, then {token id: Logprob} per prompt token, when asked
    prompt: str | None = None            # the prompt's text where it was given as one (vLLM's), else None
    request_id: str | None = None        # the engine's id of the request, as text (vLLM's field)

    @property
    def outputs(self) -> list[CompletionOutput]:
        """One CompletionOutput per returned sequence (set when the request finishes)."""
        if self.error is not None:
            return FailedOutputs(self.prompt_index, self.error)
        return self.completions

    @outputs.setter
    def outputs(self, value: list[CompletionOutput]) -> None:
        self.completions = value

    @property
    def finished(self) -> bool:
        return self.error is not None or (bool(self.completions) and all(o.finish_reason for o in self.completions))

    @property
    def finish_reason(self) -> str | None:
        """"error" when the request failed; else the first sequence's reason ("stop", "stop_string",
        "length", "cancelled"; each sequence's own is in ``outputs[i].finish_reason``); None while running."""
        if self.error is not None:
            return "error"
        return self.completions[0].finish_reason if self.finished else None

    @property
    def sequences(self) -> torch.Tensor:
        if self.error is not None:
            raise RuntimeError(f"request {self.prompt_index} failed: {self.error}")
        width = max(len(o.token_ids) for o in self.completions)
        rows = [self.prompt_token_ids + o.token_ids + [self.pad_token_id] * (width - len(o.token_ids))
                for o in self.completions]
        return torch.tensor(rows, dtype=torch.long)


def write_record(request, tokenizer) -> bool:
    """Write ``request``'s output record (one CompletionOutput per sequence, in index order, with its
    text when there is a tokenizer: the continuation of the prompt's text, ``hf_paged.engine.continuation``)
    unless it was written already; True when written now."""
    if request.recorded:
        return False
    request.recorded = True
    completions = []
    for seq in sorted(request.sequences, key=lambda s: s.index):
        text = (complete_characters(continuation(tokenizer, request.prompt[-CONTEXT:], seq.output_ids,
                                                 skip_special_tokens=True)) if tokenizer else None)
        cumulative = seq.cumulative_logprob if seq.logprobs is not None else None
        completions.append(CompletionOutput(seq.index, seq.output_ids, text, seq.finish_reason, seq.logprobs,
                                            cumulative, seq.stop_reason))
    request.output.completions = completions
    request.output.prompt_logprobs = request.prompt_logprobs
    return True
