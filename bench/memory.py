"""KV memory of each approach, measured: one probed run per workload (bytes reserved, in use, real tokens
at the peak step) and whether the tokens equal DynamicCache's. Requests held at a fixed budget come from
the allocator replay (bench/replay.py), at full ShareGPT lengths."""
from __future__ import annotations

from hf_paged.cache.pools import kv_bytes_per_token

from . import engines
from .workloads import Workload


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
