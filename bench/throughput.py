"""Generated tokens/s per approach, measured interleaved so that every ratio compares runs of one moment.

Each repeat runs every approach once, in a rotated order (so that no approach always runs first
after a noisy neighbour); ratios to DynamicCache are taken within a repeat, then summarised as
median with min/max. A warm-up run of each approach on a small workload comes first.
"""
from __future__ import annotations

import statistics

from tqdm import tqdm

from . import engines, vllm_peer
from .workloads import Workload


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _run(model, wl: Workload, approach: str, block_size: int, cb_page_size: int) -> engines.RunResult:
    if approach == "generate_batch":
        return engines.run_generate_batch(model, wl, page_size=cb_page_size)
    if approach == "engine":
        return engines.run_engine(model, wl, block_size=block_size)
    return engines.run_generate(model, wl, approach, block_size=block_size, probe=False)


def measure(model, wl: Workload, warmup: Workload, approaches: list[str], repeats: int, block_size: int = 16,
            cb_page_size: int = 32, vllm_model_dir: str | None = None, desc: str = "") -> dict:
    """{approach: {"tokens_per_s": summary, "ratio_to_dynamic": summary, "seconds": [...]}} (+ "errors")."""
    runs: dict[str, list[engines.RunResult]] = {a: [] for a in approaches}
    errors = {}
    for approach in approaches:
        try:
            _run(model, warmup, approach, block_size, cb_page_size)
        except Exception as exc:  # a broken peer is reported, not fatal
            errors[approach] = f"{type(exc).__name__}: {exc}"
    live = [a for a in approaches if a not in errors]
    with tqdm(total=repeats * len(live), desc=desc or f"tokens/s {wl.name}", leave=False) as bar:
        for rep in range(repeats):
            for approach in live[rep % len(live):] + live[:rep % len(live)]:
                try:
                    runs[approach].append(_run(model, wl, approach, block_size, cb_page_size))
                except Exception as exc:
                    errors[approach] = f"{type(exc).__name__}: {exc}"
                bar.update(1)
    out = {}
    for approach, rs in runs.items():
        if not rs:
            continue
        entry = {"tokens_per_s": _summary([r.tokens_per_s for r in rs]), "seconds": [r.seconds for r in rs],
                 "generated_tokens": rs[0].generated_tokens}
        if runs.get("dynamic") and len(runs["dynamic"]) == len(rs):
            entry["ratio_to_dynamic"] = _summary([r.tokens_per_s / d.tokens_per_s for r, d in zip(rs, runs["dynamic"])])
        out[approach] = entry
    if vllm_model_dir is not None:
        out["vllm"] = vllm_peer.run(vllm_model_dir, wl, repeats)
        if "tokens_per_s" in out["vllm"] and "dynamic" in out:
            med = out["dynamic"]["tokens_per_s"]["median"]
            out["vllm"]["ratio_to_dynamic"] = {"median": out["vllm"]["tokens_per_s"]["median"] / med,
                                               "note": "vllm ran in its own process, after the others"}
    if errors:
        out["errors"] = errors
    return out
