"""A whole-forward ``torch.compile`` of the engine's model with an on-disk compile cache, against the
fused CPU ops: first start (empty cache), warm start (the cache filled by the first), tokens/s.

    python -m bench compile-cache [--model smollm2] [--n 16] [--rounds 3] [--threads 1] [--cache-dir DIR]

Each start runs in a fresh process (``--phase`` cold / warm, spawned by the driver) with
``TORCHINDUCTOR_CACHE_DIR`` pointing at one directory (a fresh temporary one, or ``DIR/hf_paged_compile_cache``,
emptied before the cold start): the engine is built
with ``enforce_eager=True`` (inductor cannot lower the prepacked oneDNN weights, and fuses the pointwise ops itself), its runner's model replaced by
``torch.compile(model, dynamic=True)``, and the workload's first two requests run once — the start-up
(Dynamo tracing, and compilation when the cache is cold) is that run's wall time. The warm process then
runs the workload ``--rounds`` times interleaved with the engine as shipped (eager modules with the fused
ops), the ratio taken within each round. Figures under a shared machine's load skew both sides alike.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from .common import machine, spread


def _engines(model, knobs: dict, compiled: bool):
    from hf_paged.engine import LLM
    # compiled: enforce_eager, since inductor cannot take the prepacked oneDNN weights as graph inputs
    # (measured: a lowering error on mkldnn._linear_pointwise) and fuses the pointwise ops itself
    llm = LLM(model, **knobs, enforce_eager=compiled)
    if compiled:
        llm.engine.runner.model = torch.compile(model, dynamic=True)
    return llm


def _run(llm, wl) -> float:
    start = time.perf_counter()
    llm.generate([r.prompt for r in wl.requests], [dict(max_new_tokens=r.output_len) for r in wl.requests],
                 do_sample=False, ignore_eos=True, use_tqdm=False)
    return time.perf_counter() - start


def phase(args) -> dict:
    """One process: build the compiled engine and time its first run; warm phase: interleaved rounds."""
    from .engine_bench import load_model
    from .workloads import Workload, sharegpt_short
    torch.set_grad_enabled(False)
    model, described, _ = load_model(args.model, torch.float32)
    wl = sharegpt_short(args.n, 0, model.config.vocab_size, max_prompt=192, min_out=4, max_out=64)
    knobs = dict(max_num_seqs=32, max_num_batched_tokens=512, enable_prefix_caching=False)
    start = time.perf_counter()
    compiled = _engines(model, knobs, compiled=True)
    _run(compiled, Workload("warm", wl.requests[:2]))
    start_s = time.perf_counter() - start
    out = {"phase": args.phase, "model": described, "start_s": start_s}
    if args.phase == "warm":
        fused = _engines(model, knobs, compiled=False)
        _run(fused, Workload("warm", wl.requests[:2]))
        times = {"compiled": [], "fused": []}
        for rnd in range(args.rounds):
            for name in (["compiled", "fused"] if rnd % 2 == 0 else ["fused", "compiled"]):
                times[name].append(_run(compiled if name == "compiled" else fused, wl))
            print(f"round {rnd}: compiled {times['compiled'][-1]:.2f} s, fused {times['fused'][-1]:.2f} s", flush=True)
        out |= {"tokens_per_s": {k: spread([wl.generated_tokens / s for s in v]) for k, v in times.items()},
                "ratio_compiled_to_fused": spread([f / c for c, f in zip(times["compiled"], times["fused"])]),
                "workload": wl.note, "output_tokens": wl.generated_tokens}
    return out


def main(argv=None, prog: str = "python -m bench compile-cache") -> dict:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--n", type=int, default=16, help="requests of the ShareGPT-shaped workload")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-dir", default=None,
                    help="where the compile cache goes: DIR/hf_paged_compile_cache, emptied before the cold start "
                         "(default: a fresh temporary directory)")
    ap.add_argument("--phase", choices=["cold", "warm"], help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.phase:                  # a child: print one JSON line for the driver
        print("RESULT " + json.dumps(phase(args)), flush=True)
        return {}
    if args.cache_dir:              # a folder of its own inside DIR, emptied; nothing else in DIR is touched
        cache = os.path.join(args.cache_dir, "hf_paged_compile_cache")
        shutil.rmtree(cache, ignore_errors=True)
    else:
        cache = tempfile.mkdtemp(prefix="hf_paged_inductor_")
    os.makedirs(cache, exist_ok=True)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": str(args.threads)}
    results = {"machine": machine(), "threads": args.threads, "cache_dir": cache}
    for name in ("cold", "warm"):
        cmd = [sys.executable, "-m", "bench", "compile-cache", "--phase", name, "--model", args.model, "--n",
               str(args.n), "--rounds", str(args.rounds), "--threads", str(args.threads)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise RuntimeError(f"the {name} start failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        results[name] = json.loads(lines[-1].removeprefix("RESULT "))
        print(f"{name} start: {results[name]['start_s']:.1f} s", flush=True)
    print(json.dumps({k: v for k, v in results["warm"].items() if k != "phase"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return results
