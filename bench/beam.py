"""Beam search at 4 and 8 beams: KV bytes (probed run) and time per decoding step (unprobed runs).

DynamicCache answers every ``reorder_cache`` with an ``index_select`` copy of the whole KV (a
transient second copy of one layer at a time, not in the figures); PagedCache forks block tables
and copies only partly filled last blocks (copy-on-write).
"""
from __future__ import annotations

import statistics

from tqdm import tqdm

from . import engines
from .workloads import beam_search

APPROACHES = ("dynamic", "paged")


def measure(model, beams: list[int], n_prompts: int, prompt_len: int, output_len: int, repeats: int,
            block_size: int = 16) -> dict:
    """{"beam4": {approach: {memory..., "ms_per_step": {median,min,max}}}, ...}."""
    vocab = model.config.vocab_size
    out = {}
    with tqdm(total=len(beams) * len(APPROACHES) * (1 + repeats), desc="beam search", leave=False) as bar:
        for num_beams in beams:
            wl = beam_search(n_prompts, prompt_len, output_len, num_beams, vocab)
            entry = {"workload": wl.note}
            for approach in APPROACHES:
                try:
                    probed = engines.run_generate(model, wl, approach, block_size=block_size)
                    bar.update(1)
                    times = []
                    for _ in range(repeats):
                        run = engines.run_generate(model, wl, approach, block_size=block_size, probe=False)
                        times.append(1000 * run.seconds / max(run.steps, 1))
                        bar.update(1)
                except Exception as exc:
                    entry[approach] = {"error": f"{type(exc).__name__}: {exc}"}
                    continue
                entry[approach] = probed.memory | {
                    "ms_per_step": {"median": statistics.median(times), "min": min(times), "max": max(times)},
                    "steps": probed.steps}
            if "dynamic" in entry and "paged" in entry and "reserved_peak" in entry.get("paged", {}):
                # allocated KV tensors on both sides (the pool's size, not only its blocks in use)
                entry["paged_saving"] = 1 - entry["paged"]["reserved_peak"] / entry["dynamic"]["reserved_peak"]
            out[f"beam{num_beams}"] = entry
    return out
