"""Requests, their sequences, their settings and their outputs.

A request is one prompt with its generation settings; it runs as ``num_return_sequences`` sequences
(the first prefills the prompt, the others fork its blocks when it samples its first token). Each
sequence owns its token ids, its block table and its own ``torch.Generator``, so seeded sampling
gives the same tokens whatever else runs beside it, and after preemption.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ..blocks import BlockTable


@dataclass(frozen=True)
class SamplingParams:
    """Resolved settings of one request, in generate's meaning: built by
    ``settings.resolve_generation`` (unset values come from the model's generation config, then from
    transformers' defaults, as in ``model.generate``). ``seed``: sequence i samples with seed + i.
    ``default_max_length``: max_length is transformers' default (generate then makes ``max_length`` new
    tokens whatever the prompt length, capped by the model's ``max_position_embeddings``)."""
    max_new_tokens: int | None
    max_length: int | None
    min_new_tokens: int | None
    min_length: int
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float
    eos_token_ids: frozenset
    pad_token_id: int | None
    stop_strings: tuple
    num_return_sequences: int
    seed: int | None
    default_max_length: bool = False

    def new_tokens_for(self, prompt_len: int, max_position_embeddings: int | None = None) -> tuple[int, int]:
        """(max, min) new tokens for a prompt of ``prompt_len`` tokens, as generate's
        ``_prepare_generated_length`` computes them. max < 1 when an explicit ``max_length`` leaves no
        room (generate raises for it; the engine fails that request alone)."""
        if self.max_new_tokens is not None:
            most = self.max_new_tokens
        elif self.default_max_length:          # "by default let's always generate 20 new tokens"
            total = (self.max_length if self.max_length is not None else 20) + prompt_len
            if max_position_embeddings is not None:
                total = min(total, max_position_embeddings)
            most = total - prompt_len
        else:
            most = (self.max_length if self.max_length is not None else 20) - prompt_len
        if self.min_new_tokens is not None:    # min_new_tokens takes precedence over min_length
            least = self.min_new_tokens
        else:
            least = max(0, (self.min_length or 0) - prompt_len)
        return most, least


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class CompletionOutput:
    """One returned sequence: new token ids (EOS included when it ended there) and their text."""
    index: int
    token_ids: list[int]
    text: str | None = None
    finish_reason: str | None = None     # "stop" (EOS), "stop_string", "length", "cancelled", "error"


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


class Request:
    """One prompt: its settings, its sequences and its output record."""

    def __init__(self, request_id: int, prompt_index: int, prompt: list[int], params: SamplingParams, on_token=None,
                 max_position_embeddings: int | None = None):
        self.request_id, self.prompt_index, self.prompt, self.params = request_id, prompt_index, prompt, params
        self.max_new_tokens, self.min_new_tokens = params.new_tokens_for(len(prompt), max_position_embeddings)
        self.on_token = on_token
        self.output = RequestOutput(prompt_index, list(prompt), pad_token_id=params.pad_token_id or 0)
        self.sequences: list[Sequence] = []
        self.forked = False
        self.recorded = False       # the output record is written once (finish or cancel)

    @property
    def finished(self) -> bool:
        return self.output.error is not None or (
            len(self.sequences) == self.params.num_return_sequences
            and all(s.status is Status.FINISHED for s in self.sequences))


class Sequence:
    """One sequence being generated. ``token_ids`` = prompt + new tokens; the first ``num_computed``
    have their KV stored in the blocks of ``block_table``; ``block_hashes`` are the chain hashes of
    its full computed blocks."""

    __slots__ = ("seq_id", "request", "index", "token_ids", "num_computed", "block_table", "block_hashes",
                 "status", "generator", "high_water", "finish_reason")

    def __init__(self, seq_id: int, request: Request, index: int, token_ids: list[int]):
        self.seq_id, self.request, self.index, self.token_ids = seq_id, request, index, token_ids
        self.num_computed = 0
        self.block_table = BlockTable()
        self.block_hashes: list[int] = []
        self.status = Status.WAITING
        seed = request.params.seed
        self.generator = None if seed is None else torch.Generator().manual_seed(seed + index)
        self.high_water = 0                  # most tokens ever computed (recomputation after preemption)
        self.finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.request.prompt)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.request.prompt):]
