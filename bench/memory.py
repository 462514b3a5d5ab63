"""KV memory: measured runs per workload, and concurrency at a fixed KV budget from allocation policies.

Concurrency is computed, not measured: each approach's allocation policy gives the KV bytes a request
holds at its full length (prompt + output), and requests are admitted in arrival order until the
next one no longer fits the budget. The per-token bytes are those the runs measured (and equal
2 · layers · kv_heads · head_dim · dtype size). Policies:
- static (StaticCache, any preallocated per-slot cache): every row reserves the maximum sequence
  length (2048 for ShareGPT), since output lengths are unknown in advance;
- dynamic (DynamicCache, padded batch): every row is as wide as the longest prompt plus the longest
  output of its batch (an oracle choice of max_new_tokens: the most favourable case);
- paged policies (hf_paged, generate_batch, vLLM): ceil((prompt + output) / block) blocks per request.
"""
from __future__ import annotations

import numpy as np

from hf_paged.cache.pools import kv_bytes_per_token

from . import engines
from .workloads import SHAREGPT_MAX_TOTAL, Workload, sharegpt_lengths


def measure(model, wl: Workload, approaches: list[str], block_size: int = 16, cb_page_size: int = 32) -> dict:
    """One probed run per approach; returns {approach: memory dict (bytes)} plus output equality."""
    results, sequences = {}, {}
    for approach in approaches:
        try:
            if approach == "generate_batch":
                run = engines.run_generate_batch(model, wl, page_size=cb_page_size)
                bpt = kv_bytes_per_token(model.config, model.dtype)
                policy = sum(-(-(p + o) // cb_page_size) * cb_page_size for p, o in zip(wl.prompt_lens, wl.output_lens))
                real = sum(p + o for p, o in zip(wl.prompt_lens, wl.output_lens)) * wl.num_return_sequences
                run.memory.update(in_use_peak=policy * bpt * wl.num_return_sequences, real_at_peak=real * bpt,
                                  utilisation=real / (policy * wl.num_return_sequences), in_use_is_analytic=True)
            else:
                run = engines.run_generate(model, wl, approach, block_size=block_size)
        except Exception as exc:  # a peer failing must not sink the whole benchmark
            results[approach] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        results[approach] = run.memory | {"seconds": run.seconds}
        sequences[approach] = run.sequences
    if "dynamic" in sequences:
        for approach, seqs in sequences.items():
            if approach != "dynamic" and approach in results and not wl.do_sample:
                results[approach]["same_tokens_as_dynamic"] = _same_rows(sequences["dynamic"], seqs, wl)
    return results


def _same_rows(ref: list[list[int]], other: list[list[int]], wl: Workload) -> str:
    """'k/n' rows whose first output_len tokens agree (the EOS forced at the end is not compared)."""
    lens = [o for o in wl.output_lens for _ in range(len(ref) // len(wl.requests))]
    same = sum(a[:n - 1] == b[:n - 1] for a, b, n in zip(ref, other, lens))
    return f"{same}/{len(ref)}"


def _fit_count(costs: np.ndarray, budget_tokens: float) -> int:
    """How many leading requests fit when request i costs costs[i] tokens."""
    return int(np.searchsorted(np.cumsum(costs), budget_tokens, side="right"))


def concurrency_at_budget(budget_bytes: int, bytes_per_token: int, policies: dict[str, int],
                          draws: int = 20, seed: int = 0, max_len: int = SHAREGPT_MAX_TOTAL) -> dict:
    """Requests held at once within ``budget_bytes``, median/min/max over ``draws`` ShareGPT arrival orders.

    ``policies``: name -> block size (0 = dynamic padded batch, -1 = static max-length rows,
    1 = ideal: exactly the real tokens).
    """
    prompts, outputs = sharegpt_lengths()
    budget_tokens = budget_bytes / bytes_per_token
    rng = np.random.default_rng(seed)
    counts = {name: [] for name in policies}
    for _ in range(draws):
        order = rng.permutation(len(prompts))[:4096]
        p, o = prompts[order], outputs[order]
        for name, block in policies.items():
            if block == -1:
                n = int(budget_tokens // max_len)
            elif block == 0:
                width = np.maximum.accumulate(p) + np.maximum.accumulate(o)
                n = int(np.sum(np.arange(1, len(p) + 1) * width <= budget_tokens))
            else:
                n = _fit_count(-(-(p + o) // block) * block, budget_tokens)
            counts[name].append(n)
    return {name: {"median": float(np.median(c)), "min": int(min(c)), "max": int(max(c)), "block": policies[name]}
            for name, c in counts.items()} | {"_budget_bytes": budget_bytes, "_bytes_per_token": bytes_per_token,
                                              "_draws": draws, "_max_len": max_len}
