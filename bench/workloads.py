"""Request mixes for the benchmarks. A request is prompt token ids plus the exact number of tokens to generate.

Output lengths are enforced, not left to the model: padded-batch ``generate`` gets a logits
processor that forbids EOS before a row's length and forces it at that step (see ``engines``);
continuous-batching peers get a per-request ``max_new_tokens`` with EOS disabled. So every approach
generates the same tokens count per request, and rows finish at different steps as with real EOS.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent / "data" / "sharegpt_lengths.npz"
SHAREGPT_MAX_TOTAL = 2048  # the dataset's filter: prompt + output <= 2048
FIRST_PLAIN_TOKEN = 100    # random prompt ids start here, clear of special tokens


@dataclass
class Request:
    prompt: list[int]
    output_len: int


@dataclass
class Workload:
    """``num_return_sequences`` / ``do_sample`` go straight to ``generate``."""
    name: str
    requests: list[Request]
    num_return_sequences: int = 1
    do_sample: bool = False
    note: str = ""
    meta: dict = field(default_factory=dict)

    @property
    def prompt_lens(self) -> list[int]:
        return [len(r.prompt) for r in self.requests]

    @property
    def output_lens(self) -> list[int]:
        return [r.output_len for r in self.requests]

    @property
    def generated_tokens(self) -> int:
        return sum(self.output_lens) * self.num_return_sequences


def sharegpt_lengths() -> tuple[np.ndarray, np.ndarray]:
    """(prompt, output) int64 arrays of 15,417 ShareGPT first exchanges (SmolLM2 token counts)."""
    data = np.load(DATA)
    return data["prompt"], data["output"]


def sharegpt_pick(rng: np.random.Generator, n: int, max_prompt: int, min_output: int = 1, max_output: int = 2048,
                  min_prompt: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``n`` distinct ShareGPT (prompt, output) length pairs drawn with ``rng`` among those with
    min_prompt <= prompt <= max_prompt and min_output <= output <= max_output (lengths not scaled)."""
    prompts, outputs = sharegpt_lengths()
    keep = np.flatnonzero((prompts >= min_prompt) & (prompts <= max_prompt) & (outputs >= min_output)
                          & (outputs <= max_output))
    if len(keep) < n:
        raise SystemExit(f"only {len(keep)} ShareGPT pairs have prompt {min_prompt}-{max_prompt} and output "
                         f"{min_output}-{max_output}; asked for {n}: raise --max-prompt / --max-output or ask for fewer")
    idx = rng.choice(keep, size=n, replace=False)
    return prompts[idx], outputs[idx]


def sharegpt_short(n: int, seed: int, vocab: int, max_prompt: int = 192, min_out: int = 4,
                   max_out: int = 64) -> Workload:
    """``n`` unscaled ShareGPT pairs with prompt <= max_prompt and min_out <= output <= max_out, random prompt ids."""
    rng = np.random.default_rng(seed)
    prompts, outputs = sharegpt_pick(rng, n, max_prompt, min_out, max_out)
    reqs = [Request(_random_prompt(rng, int(p), vocab), int(o)) for p, o in zip(prompts, outputs)]
    return Workload("sharegpt-short", reqs, note=f"{n} ShareGPT pairs, prompt<={max_prompt}, output {min_out}-{max_out}")


def _random_prompt(rng: np.random.Generator, length: int, vocab: int) -> list[int]:
    return rng.integers(FIRST_PLAIN_TOKEN, vocab, size=length).tolist()


def sharegpt_mix(n: int, max_total: int, vocab: int, seed: int = 0) -> Workload:
    """``n`` ShareGPT length pairs drawn with ``seed``, both lengths scaled by max_total / 2048 so that
    the longest possible request fits ``max_total`` tokens (the model context or a CPU-sized cap)."""
    prompts, outputs = sharegpt_lengths()
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(prompts), size=n, replace=False)
    scale = min(1.0, max_total / SHAREGPT_MAX_TOTAL)
    reqs = []
    for i in idx:
        p = max(2, round(int(prompts[i]) * scale))
        o = max(2, round(int(outputs[i]) * scale))
        reqs.append(Request(_random_prompt(rng, p, vocab), o))
    return Workload("sharegpt", reqs, note=f"{n} ShareGPT pairs (seed {seed}), lengths x{scale:.3g}",
                    meta={"scale": scale, "seed": seed, "max_total": max_total})


def uniform_synthetic(n: int, input_len: int, output_len: int, range_ratio: float, vocab: int,
                      seed: int = 0) -> Workload:
    """vLLM's random dataset: each length uniform in L*(1-r) .. L*(1+r) (inclusive), EOS ignored."""
    rng = np.random.default_rng(seed)

    def draw(length):
        return int(rng.integers(max(1, int(length * (1 - range_ratio))), int(length * (1 + range_ratio)) + 1))

    reqs = [Request(_random_prompt(rng, draw(input_len), vocab), max(1, draw(output_len))) for _ in range(n)]
    return Workload("uniform", reqs, note=f"{n} requests, input {input_len}, output {output_len}, r={range_ratio}")


def shared_prefix(n: int, prefix_len: int, suffix_lens: tuple[int, int], output_len: int, vocab: int,
                  seed: int = 0) -> Workload:
    """One system prompt of ``prefix_len`` tokens in front of ``n`` short requests."""
    rng = np.random.default_rng(seed)
    prefix = _random_prompt(rng, prefix_len, vocab)
    reqs = [Request(prefix + _random_prompt(rng, int(rng.integers(suffix_lens[0], suffix_lens[1] + 1)), vocab),
                    output_len) for _ in range(n)]
    return Workload("shared_prefix", reqs, note=f"{prefix_len}-token system prompt + {n} requests of "
                    f"{suffix_lens[0]}-{suffix_lens[1]} tokens, {output_len} new each")


def parallel_sampling(n: int, prompt_len: int, output_len: int, num_seqs: int, vocab: int, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    reqs = [Request(_random_prompt(rng, prompt_len, vocab), output_len) for _ in range(n)]
    return Workload(f"parallel{num_seqs}", reqs, num_return_sequences=num_seqs, do_sample=True,
                    note=f"{n} prompts of {prompt_len} tokens, num_return_sequences={num_seqs}, sampling")
