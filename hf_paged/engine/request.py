"""Requests, their sequences, their settings and their outputs.

A request is one prompt with its generation settings; it runs as ``num_return_sequences`` sequences
(the first prefills the prompt, the others fork its blocks when it samples its first token). Each
sequence owns its token ids, its block table and its own ``torch.Generator``, so seeded sampling
gives the same tokens whatever else runs beside it, and after preemption.
"""
from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field

import torch

# Settings generate knows that the engine does not implement (non-default values are refused).
_UNSUPPORTED = dict(num_beams=1, num_beam_groups=1, repetition_penalty=1.0, no_repeat_ngram_size=0,
                    penalty_alpha=None, typical_p=1.0, min_p=None, epsilon_cutoff=0.0, eta_cutoff=0.0,
                    bad_words_ids=None, force_words_ids=None, suppress_tokens=None, begin_suppress_tokens=None,
                    forced_bos_token_id=None, forced_eos_token_id=None, sequence_bias=None, guidance_scale=None,
                    prompt_lookup_num_tokens=None, encoder_repetition_penalty=1.0)
_ENGINE_ONLY = ("seed", "ignore_eos")


@dataclass(frozen=True)
class SamplingParams:
    """Resolved settings of one request (generate's meaning; unset values come from the model's
    generation config, as in ``model.generate``). ``seed``: sequence i samples with seed + i."""
    max_new_tokens: int | None
    max_length: int | None
    min_new_tokens: int
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

    @classmethod
    def resolve(cls, generation_config, **kwargs) -> "SamplingParams":
        """Merge ``kwargs`` into a copy of ``generation_config``; unknown names raise ValueError."""
        engine_only = {k: kwargs.pop(k) for k in _ENGINE_ONLY if k in kwargs}
        config = copy.deepcopy(generation_config)
        unknown = config.update(**kwargs)
        if unknown:
            raise ValueError(f"unknown generation argument(s) {sorted(unknown)}: the engine accepts "
                             "GenerationConfig fields (max_new_tokens, do_sample, temperature, top_k, top_p, "
                             "stop_strings, num_return_sequences, ...) plus seed and ignore_eos")
        for name, default in _UNSUPPORTED.items():
            value = getattr(config, name, default)
            if value is not None and value != default:
                raise ValueError(f"{name}={value!r} is not supported by the hf_paged engine (supported: greedy "
                                 "and sampling with temperature/top_k/top_p); use model.generate for it")
        eos = None if engine_only.get("ignore_eos") else config.eos_token_id
        eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        stops = config.stop_strings
        stops = () if not stops else (stops,) if isinstance(stops, str) else tuple(stops)
        n = config.num_return_sequences or 1
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"num_return_sequences must be a positive int, got {n!r}")
        seed = engine_only.get("seed")
        if config.do_sample and seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())      # from the global RNG: manual_seed reproduces it
        return cls(max_new_tokens=config.max_new_tokens, max_length=config.max_length,
                   min_new_tokens=config.min_new_tokens or 0, min_length=config.min_length or 0,
                   do_sample=bool(config.do_sample), temperature=float(config.temperature or 1.0),
                   top_k=config.top_k, top_p=float(config.top_p if config.top_p is not None else 1.0),
                   eos_token_ids=eos_ids, pad_token_id=config.pad_token_id, stop_strings=stops,
                   num_return_sequences=n, seed=seed)

    def new_tokens_for(self, prompt_len: int) -> tuple[int, int]:
        """(max, min) new tokens for a prompt of ``prompt_len`` tokens, as generate computes them."""
        most = self.max_new_tokens if self.max_new_tokens is not None else (self.max_length or 20) - prompt_len
        least = max(self.min_new_tokens, self.min_length - prompt_len if self.min_length else 0)
        return max(0, most), least

    @property
    def greedy(self) -> bool:
        return not self.do_sample


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


@dataclass
class RequestOutput:
    """What one request produced, in input order. ``sequences``: LongTensor [n, prompt + longest output]
    (prompt then new tokens, right-padded with ``pad_token_id``), the shape ``model.generate`` returns
    for one prompt with ``num_return_sequences=n``. ``error`` is set (and outputs empty) when the
    request could not run."""
    index: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    error: str | None = None
    num_cached_tokens: int = 0
    pad_token_id: int = 0

    @property
    def finished(self) -> bool:
        return self.error is not None or (bool(self.outputs) and all(o.finish_reason for o in self.outputs))

    @property
    def sequences(self) -> torch.Tensor:
        if self.error is not None:
            raise RuntimeError(f"request {self.index} failed: {self.error}")
        width = max(len(o.token_ids) for o in self.outputs)
        rows = [self.prompt_token_ids + o.token_ids + [self.pad_token_id] * (width - len(o.token_ids))
                for o in self.outputs]
        return torch.tensor(rows, dtype=torch.long)


class Request:
    """One prompt: its settings, its sequences and its output record."""

    def __init__(self, request_id: int, index: int, prompt: list[int], params: SamplingParams, on_token=None):
        self.request_id, self.index, self.prompt, self.params = request_id, index, prompt, params
        self.max_new_tokens, self.min_new_tokens = params.new_tokens_for(len(prompt))
        self.on_token = on_token
        self.output = RequestOutput(index, list(prompt), pad_token_id=params.pad_token_id or 0)
        self.sequences: list[Sequence] = []
        self.forked = False

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
                 "status", "generator", "high_water", "finish_reason", "arrival")

    def __init__(self, seq_id: int, request: Request, index: int, token_ids: list[int], arrival: int):
        self.seq_id, self.request, self.index, self.token_ids = seq_id, request, index, token_ids
        self.num_computed = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.status = Status.WAITING
        seed = request.params.seed
        self.generator = None if seed is None else torch.Generator().manual_seed(seed + index)
        self.high_water = 0                  # most tokens ever computed (recomputation after preemption)
        self.finish_reason: str | None = None
        self.arrival = arrival

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.request.prompt)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.request.prompt):]
