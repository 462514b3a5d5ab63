"""What running beyond one process costs on this machine: Ray Data actors and tensor parallelism.

    python -m bench distributed [--rounds 3] [--requests 32]

Two parts, each run side by side in interleaved rounds (min/median/max reported), threads set and
recorded on every side, results to bench/results/distributed-<timestamp>.{json,png}:

1. **Ray Data** (``hf_paged.integrations.ray_data``) on the real SmolLM2-135M, ShareGPT-shaped prompts
   (token ids, lengths scaled to 256 tokens, exact output lengths with EOS ignored): one actor with one
   CPU and one thread against two such actors, and the engine in this process with 1 and 2 threads. Wall
   time includes what a user waits for: actor start-up (imports, loading the model) and the run.
2. **Tensor parallelism** (transformers' ``tp_plan="auto"``, gloo) on a random Llama shaped like a
   small model with KV heads divisible by 2 (16 layers, hidden 512, 8 query / 4 KV heads): the engine on
   2 ranks (one thread each) against one process with 1 and with 2 threads; per step: forward time.

On 2 cores neither is expected to be faster than one process using both cores; the point is that both
work and what they cost (see the README's "Beyond one process").
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import RESULTS, machine, pyplot, spread, stamp

TP_SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=16, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=False)


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    from bench.workloads import sharegpt_mix

    w = sharegpt_mix(n, max_total=256, vocab=49152, seed=seed)
    return [(r.prompt, r.output_len) for r in w.requests]


def interleaved(sides: dict, rounds: int, tag: str) -> dict[str, list[dict]]:
    """Every side once per round, in order; each side's results per round."""
    runs = {name: [] for name in sides}
    for r in range(rounds):
        for name, run in sides.items():
            runs[name].append(run())
            print(f"[{tag} {r + 1}/{rounds}] {name}: {runs[name][-1]['tokens_per_s']:.1f} tok/s "
                  f"({runs[name][-1]['wall_s']:.1f} s)", flush=True)
    return runs


# ----------------------------------------------------------------------------- Ray Data
def ray_round(model_dir: str, requests, actors: int, batch_size: int) -> dict:
    import ray

    from hf_paged.integrations import ray_data

    ds = ray.data.from_items([{"prompt": p, "max_new_tokens": o, "i": i} for i, (p, o) in enumerate(requests)])
    start = time.perf_counter()
    out = ray_data.generate(ds, model_dir, concurrency=actors, num_cpus=1, row_settings=("max_new_tokens",),
                            batch_size=batch_size, ignore_eos=True).take_all()
    wall = time.perf_counter() - start
    tokens = sum(len(r["generated_token_ids"]) for r in out)
    assert tokens == sum(o for _, o in requests), "every request must generate exactly its length"
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "actors_used": len(ray_data.actor_summary(out))}


def in_process_round(model, requests, threads: int) -> dict:
    import torch

    import hf_paged

    torch.set_num_threads(threads)
    start = time.perf_counter()
    outs = hf_paged.LLM(model).generate([p for p, _ in requests], [dict(max_new_tokens=o) for _, o in requests],
                                        ignore_eos=True, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall}


def ray_part(rounds: int, n: int, batch_size: int) -> dict:
    import ray
    import torch

    from hf_paged.integrations.smollm2 import cache_dir, convert, is_converted, load_smollm2

    if not is_converted():
        convert()
    model_dir = str(cache_dir())
    model, _ = load_smollm2()
    requests = workload(n)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    sides = {"engine, 1 thread": lambda: in_process_round(model, requests, 1),
             "engine, 2 threads": lambda: in_process_round(model, requests, 2),
             "ray, 1 actor x 1 thread": lambda: ray_round(model_dir, requests, 1, batch_size),
             "ray, 2 actors x 1 thread": lambda: ray_round(model_dir, requests, 2, batch_size)}
    try:
        runs = interleaved(sides, rounds, "ray")
    finally:
        ray.shutdown()
        torch.set_num_threads(os.cpu_count() or 1)
    return {"model": "SmolLM2-135M fp32", "requests": n, "batch_size": batch_size,
            "generated_tokens": sum(o for _, o in requests),
            "runs": runs, "summary": {k: spread([x["tokens_per_s"] for x in v]) for k, v in runs.items()}}


# ----------------------------------------------------------------------------- tensor parallelism
TP_WORKER = r'''
import json, os, sys, time, torch
from transformers import AutoModelForCausalLM
import hf_paged
threads, tp = int(sys.argv[2]), sys.argv[3] == "tp"
torch.set_num_threads(threads)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], **({"tp_plan": "auto"} if tp else {})).eval()
requests = json.loads(open(sys.argv[4]).read())
engine = hf_paged.Engine(model, max_num_seqs=16)
for prompt, n in requests:
    engine.add_request(prompt, max_new_tokens=n, ignore_eos=True)
start = time.perf_counter()
engine.run()
wall = time.perf_counter() - start
s = engine.stats()
if int(os.environ.get("RANK", 0)) == 0:
    print("RESULT " + json.dumps({"wall_s": wall, "steps": s["steps"], "step_ms": 1e3 * s["forward_s"] / s["steps"],
                                  "tokens_per_s": s["generated_tokens"] / wall, "threads": threads,
                                  "processes": 2 if tp else 1}), flush=True)
'''


def tp_round(model_dir: str, requests_file: str, kind: str) -> dict:
    worker = Path(tempfile.gettempdir()) / "hf_paged_tp_bench_worker.py"
    worker.write_text(TP_WORKER)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if kind == "tp":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(worker), model_dir, "1", "tp", requests_file]
    else:
        cmd = [sys.executable, str(worker), model_dir, kind, "solo", requests_file]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode or not lines:
        raise RuntimeError(f"{cmd} failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def tp_part(rounds: int, n: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**TP_SHAPE)).save_pretrained(tmp)
        requests_file = os.path.join(tmp, "requests.json")
        Path(requests_file).write_text(json.dumps(workload(n, seed=1)))
        sides = {name: functools.partial(tp_round, tmp, requests_file, kind) for name, kind in
                 (("1 process, 1 thread", "1"), ("1 process, 2 threads", "2"), ("tp 2 ranks x 1 thread", "tp"))}
        runs = interleaved(sides, rounds, "tp")
    return {"model": f"random Llama {TP_SHAPE}", "requests": n, "runs": runs,
            "summary": {k: {"step_ms": spread([x["step_ms"] for x in v]),
                            "tokens_per_s": spread([x["tokens_per_s"] for x in v])} for k, v in runs.items()}}


# ----------------------------------------------------------------------------- report
def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    panels = []
    if "ray" in result:
        panels.append(("Ray Data, SmolLM2-135M", result["ray"]["summary"]))
    if "tp" in result:
        panels.append(("Tensor parallel engine, random Llama",
                       {k: v["tokens_per_s"] for k, v in result["tp"]["summary"].items()}))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), squeeze=False)
    for ax, (title, summary) in zip(axes[0], panels):
        names = list(summary)
        med = [summary[k]["median"] for k in names]
        err = [[m - summary[k]["min"] for k, m in zip(names, med)], [summary[k]["max"] - m for k, m in zip(names, med)]]
        ax.barh(names, med, xerr=err, color="#4c72b0")
        ax.set_xlabel("generated tokens/s (median, min-max)")
        ax.set_title(title)
    fig.suptitle(f"{result['date']}, {result['machine']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None, prog: str = "python -m bench distributed") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32, help="ShareGPT-shaped requests per run")
    parser.add_argument("--parts", default="ray,tp", help="comma-separated: ray, tp")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="rows per Ray batch, the same for 1 and 2 actors (an actor runs a batch to its end)")
    args = parser.parse_args(argv)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{os.cpu_count()} CPUs, no GPU",
              "rounds": args.rounds, "host": machine()}
    parts = args.parts.split(",")
    if "ray" in parts:
        result["ray"] = ray_part(args.rounds, args.requests, args.batch_size)
    if "tp" in parts:
        result["tp"] = tp_part(args.rounds, args.requests // 2)
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"distributed-{stamp()}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, stem.with_suffix(".png"))
    print(json.dumps({k: result[k]["summary"] for k in ("ray", "tp") if k in result}, indent=1))
    print(f"wrote {stem}.json")
