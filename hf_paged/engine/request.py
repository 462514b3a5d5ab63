"""Requests, their sequences and their settings (their outputs: ``outputs``).

A request is one prompt with its generation settings; it runs as ``num_return_sequences`` sequences
(the first prefills the prompt, the others fork its blocks when it samples its first token). Each
sequence owns its token ids, its block table and its own ``torch.Generator``, so seeded sampling
gives the same tokens whatever else runs beside it, and after preemption.

Who writes what: the scheduler owns a sequence's status, block table, ``block_hashes``,
``num_computed`` and ``high_water``, and a request's ``forked`` and ``cancelled``; the engine appends
tokens and decides when a sequence finishes (the scheduler carries it out).
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch

from ..blocks import BlockTable
from .outputs import RequestOutput
from .processors import generate_processors


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
    # generate's logits processors (transformers' own classes apply them, in generate's order)
    repetition_penalty: float = 1.0
    min_p: float | None = None
    bad_words_ids: tuple | None = None          # tuple of token-id tuples
    sequence_bias: object = None                # generate's sequence_bias, as passed
    # vLLM's settings that generate does not have (see hf_paged.engine.processors)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple = ()                      # (token id, bias) pairs
    allowed_token_ids: frozenset | None = None
    stop_token_ids: frozenset = frozenset()     # end the sequence like EOS ("stop"), token kept
    stop_strings_wait: bool = False             # vLLM's min_tokens: a stop string must end after the first
                                                # min_new_tokens tokens' text (generate's stop strings do not wait)
    logprobs: int | None = None                 # top-k log-probabilities per new token (0: the chosen one only)
    prompt_logprobs: int | None = None          # the same for every prompt token (the first has none)
    structured_output: object = None            # a compiled hf_paged.engine.structured.Grammar
    thinking_budget: tuple | None = None        # (start id, end id, n): vLLM's thinking_token_budget, at most n
                                                # tokens after the last start with no end since; then end is forced

    # cached: read per new token / per sampling row (the dataclass is frozen, so they never go stale)
    @functools.cached_property
    def stops_on(self) -> frozenset:
        """Token ids that end a sequence ("stop"): EOS and ``stop_token_ids``."""
        return self.eos_token_ids | self.stop_token_ids

    @functools.cached_property
    def processes_logits(self) -> bool:
        """Whether anything but temperature / top-k / top-p / min-new-tokens changes the logits."""
        return (self.repetition_penalty != 1.0 or bool(self.bad_words_ids) or bool(self.sequence_bias)
                or bool(self.presence_penalty) or bool(self.frequency_penalty) or bool(self.logit_bias)
                or self.allowed_token_ids is not None or self.structured_output is not None
                or self.thinking_budget is not None)

    def new_tokens_for(self, prompt_len: int, max_position_embeddings: int | None = None,
                       max_model_len: int | None = None) -> tuple[int, int]:
        """(max, min) new tokens for a prompt of ``prompt_len`` tokens, as generate's
        ``_prepare_generated_length`` computes them. max < 1 when an explicit ``max_length`` leaves no
        room (generate raises for it; the engine fails that request alone). With ``max_model_len`` (an
        engine's context), max stops there, as vLLM's engine stops a sequence (finish_reason "length"); a
        prompt that fills the context still samples one token (``intake.never_fits``)."""
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
        if max_model_len is not None and most >= 1:
            most = min(most, max(1, max_model_len - prompt_len))
        return most, least


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One prompt: its settings, its sequences and its output record."""

    def __init__(self, request_id: int, prompt_index: int, prompt: list[int], params: SamplingParams, on_token=None,
                 max_position_embeddings: int | None = None, max_model_len: int | None = None):
        self.request_id, self.prompt_index, self.prompt, self.params = request_id, prompt_index, prompt, params
        self.max_new_tokens, self.min_new_tokens = params.new_tokens_for(len(prompt), max_position_embeddings,
                                                                         max_model_len)
        self.on_token = on_token
        self.processors = generate_processors(params)      # transformers' own, built once
        allowed = params.allowed_token_ids
        self.allowed_ids = None if allowed is None else torch.tensor(sorted(allowed), dtype=torch.long)
        # logit_bias as one index and one value tensor, added in one op per row and step (a request may
        # bias tens of thousands of tokens: a Python loop per entry slowed every request in the batch)
        bias = params.logit_bias
        self.bias_ids = torch.tensor([t for t, _ in bias], dtype=torch.long) if bias else None
        self.bias_values = torch.tensor([b for _, b in bias], dtype=torch.float32) if bias else None
        self.output = RequestOutput(prompt_index, list(prompt), pad_token_id=params.pad_token_id or 0)
        self.sequences: list[Sequence] = []      # index order; all num_return_sequences once forked or cancelled
        self.forked = False         # its extra sequences (num_return_sequences > 1) were forked from sequence 0
        self.cancelled = False      # Engine.cancel: every sequence ended with finish_reason "cancelled"
        self.recorded = False       # the output record is written once (finish or cancel)
        # prompt log-probabilities, filled by the engine as the prompt's chunks are computed: entry p
        # belongs to prompt token p (entry 0 is None); complete when len == len(prompt)
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt log-probabilities are asked and not all computed yet (prefix hits would skip them)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.output.error is not None or (
            len(self.sequences) == self.params.num_return_sequences
            and all(s.status is Status.FINISHED for s in self.sequences))


class Sequence:
    """One sequence being generated. ``token_ids`` = prompt + new tokens; the first ``num_computed``
    have their KV stored in the blocks of ``block_table``; ``block_hashes`` are the chain hashes of
    its full computed blocks. Invariants: ``num_computed <= block_table.num_tokens <= num_tokens``
    (the table reserves the slots of a scheduled chunk before the forward fills them) and
    ``num_computed <= high_water``; a WAITING or FINISHED sequence holds no block."""

    __slots__ = ("seq_id", "request", "index", "token_ids", "num_computed", "block_table", "block_hashes",
                 "status", "generator", "high_water", "finish_reason", "stop_reason", "logprobs", "cumulative_logprob",
                 "matcher")

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
        self.stop_reason: str | int | None = None   # vLLM's: the stop string or stop_token_ids entry it ended on
        self.logprobs: list | None = [] if request.params.logprobs is not None else None   # one dict per new token
        self.cumulative_logprob = 0.0
        grammar = request.params.structured_output
        self.matcher = grammar.matcher() if grammar is not None else None    # its own grammar state

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.request.prompt)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.request.prompt):]
