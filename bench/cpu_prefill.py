"""Prefill attention on the CPU: the C++ kernel (``torch.ops.hf_paged_cpu.paged_attention``) against torch's
SDPA on the same keys (``python -m bench cpu-prefill``).

One fresh prompt of T tokens per case (causal, no window), fp32, SmolLM2's attention shape (9 query heads,
3 KV heads, D = 64) and a GQA-8 shape with D = 128 (8 query heads over 1 KV head), T in 256..4096. The
kernel reads K/V through an identity block table over a pool of 16-token blocks whose storage *is* the
contiguous [Hkv, T, D] keys SDPA gets (expanded to the query heads beforehand, outside the timing, so that
SDPA takes its fused causal path). ``--baseline REF`` also builds the kernel's sources as of git commit REF
(under the op namespace ``hf_paged_cpu_base``, so both load in one process) and times it in the same rounds:
the before / after comparison without keeping the old code in the tree.

Rounds are interleaved: every round times each approach once per case, in a rotated order; min / median /
max over the rounds of GFLOPS = 4 * D * Hq * T (T + 1) / 2 (QK^T and PV over the visible pairs) / seconds,
and the ratios within a round. Each case also records the largest difference from SDPA's output.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from .common import ROOT, fmt_spread, int_at_least, ints_at_least, load_avg, machine, spread, stamp, versions

SHAPES = {"smollm2": (9, 3, 64), "gqa8-d128": (8, 1, 128)}       # (query heads, KV heads, head dim)
LENGTHS = (256, 512, 1024, 2048, 4096)
BLOCK = 16
MIN_SECONDS = 0.05          # a timed sample repeats the call until it lasts at least this long
BASE_NAMESPACE = "hf_paged_cpu_base"


def make_case(shape: str, tokens: int, seed: int = 0) -> dict:
    """The query, the pools (views of the contiguous keys), the step's metadata and SDPA's expanded K/V."""
    num_q, num_kv, head_dim = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(tokens, num_q, head_dim, generator=gen)
    keys, values = (torch.randn(num_kv, tokens, head_dim, generator=gen) for _ in range(2))
    blocks = -(-tokens // BLOCK)
    pad = blocks * BLOCK - tokens
    k_pool, v_pool = (torch.nn.functional.pad(x, (0, 0, 0, pad)).view(num_kv, blocks, BLOCK, head_dim)
                      for x in (keys, values))
    group = num_q // num_kv
    return {"shape": shape, "tokens": tokens, "query": query, "k_pool": k_pool, "v_pool": v_pool,
            "tables": torch.arange(blocks, dtype=torch.int32)[None], "rows": torch.zeros(tokens, dtype=torch.int32),
            "pos": torch.arange(tokens, dtype=torch.int32), "scale": head_dim ** -0.5,
            "sdpa_q": query.transpose(0, 1)[None].contiguous(),
            "sdpa_k": keys.repeat_interleave(group, 0)[None], "sdpa_v": values.repeat_interleave(group, 0)[None],
            "flops": 4 * head_dim * num_q * tokens * (tokens + 1) / 2}


def kernel_call(op, c: dict):
    return lambda: op(c["query"], c["k_pool"], c["v_pool"], c["tables"], c["rows"], c["pos"], c["scale"], 0)


def sdpa_call(c: dict):
    return lambda: torch.nn.functional.scaled_dot_product_attention(c["sdpa_q"], c["sdpa_k"], c["sdpa_v"],
                                                                    is_causal=True, scale=c["scale"])


def build_baseline(ref: str):
    """``paged_attention`` built from the kernel's sources as of git commit ``ref``, in its own namespace."""
    from torch.utils import cpp_extension  # noqa: PLC0415  (setuptools, only when building)

    from hf_paged.backends import cpu_backend  # noqa: PLC0415

    from hf_paged.backends import cpp_build
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", ref, "cuda/"], capture_output=True,
                            text=True)
    if listed.returncode != 0:
        raise SystemExit(f"--baseline {ref}: git ls-tree failed: {listed.stderr.strip()}")
    texts = {}
    for path in listed.stdout.split():            # every C++ source and header of the kernel as of ref
        if path.endswith((".cpp", ".h")):
            shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:{path}"], capture_output=True, text=True)
            texts[Path(path).name] = shown.stdout.replace("hf_paged_cpu", BASE_NAMESPACE)
    missing = [n for n in cpu_backend.SOURCES if n not in texts]
    if missing:
        raise SystemExit(f"--baseline {ref}: no {', '.join(missing)} in cuda/ at that commit")
    flags = cpp_build.cflags()
    digest = hashlib.sha1("\0".join([ref, *texts.values(), *flags]).encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"hf_paged_cpu_base_{digest}"
    folder.mkdir(exist_ok=True)
    for name, text in texts.items():
        (folder / name).write_text(text)
    cpp_extension.load(name=f"hf_paged_cpu_base_{digest}", sources=[str(folder / n) for n in cpu_backend.SOURCES],
                       extra_cflags=list(flags), extra_ldflags=list(cpp_build.LDFLAGS), is_python_module=False)
    return getattr(torch.ops, BASE_NAMESPACE).paged_attention


def timed(fn) -> float:
    """Seconds per call: the call repeated until MIN_SECONDS have passed, the mean of those calls."""
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= MIN_SECONDS:
            return elapsed / calls


def measure(approaches: dict, cases: list[dict], threads: list[int], rounds: int, progress=print) -> list[dict]:
    """Per (threads, case): GFLOPS per approach (min / median / max over interleaved rounds), the ratios
    kernel / each other approach within a round, and each approach's largest difference from SDPA."""
    results = []
    for n in threads:
        torch.set_num_threads(n)
        for c in cases:
            calls = {name: make(c) for name, make in approaches.items()}
            ref = calls["sdpa"]()[0].transpose(0, 1)
            diff = {name: float((fn() - ref).abs().max()) for name, fn in calls.items() if name != "sdpa"}
            per_round = []
            for r in range(rounds):
                order = list(calls)[r % len(calls):] + list(calls)[:r % len(calls)]
                per_round.append({name: c["flops"] / timed(calls[name]) / 1e9 for name in order})
            row = {"threads": n, "shape": c["shape"], "tokens": c["tokens"], "max_abs_diff_vs_sdpa": diff,
                   "gflops": {name: spread([p[name] for p in per_round]) for name in calls},
                   "ratio_kernel_to": {name: spread([p["kernel"] / p[name] for p in per_round])
                                       for name in calls if name != "kernel"}}
            results.append(row)
            progress(f"  threads {n} {c['shape']:9s} T={c['tokens']:5d}  " + "  ".join(
                f"{name} {fmt_spread(row['gflops'][name])}" for name in calls) + " GFLOPS  kernel/" + " ".join(
                f"{name} {row['ratio_kernel_to'][name]['median']:.2f}x" for name in row["ratio_kernel_to"]))
    return results


def parse_args(argv, prog: str):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {','.join(SHAPES)}")
    ap.add_argument("--lengths", type=ints_at_least(1), default=list(LENGTHS), help="comma list of prompt lengths")
    ap.add_argument("--threads", type=ints_at_least(1), default=[1, 2],
                    help="comma list of torch thread counts, each measured in turn")
    ap.add_argument("--rounds", type=int_at_least(1), default=3)
    ap.add_argument("--baseline", metavar="REF", help="also time the kernel as of this git commit")
    ap.add_argument("--json", help="write the figures here (default: bench/results/cpu-prefill-<timestamp>.json)")
    args = ap.parse_args(argv)
    unknown = set(args.shapes.split(",")) - set(SHAPES)
    if unknown:
        ap.error(f"--shapes: unknown {sorted(unknown)}; choose from {','.join(SHAPES)}")
    return args


def main(argv=None, prog: str = "python -m bench cpu-prefill") -> dict:
    args = parse_args(argv, prog)
    from hf_paged.backends import cpu_backend  # noqa: PLC0415
    approaches = {"kernel": lambda c, op=cpu_backend.load_kernel(): kernel_call(op, c), "sdpa": sdpa_call}
    if args.baseline:
        approaches["baseline"] = lambda c, op=build_baseline(args.baseline): kernel_call(op, c)
    cases = [make_case(s, t) for t in args.lengths for s in args.shapes.split(",")]
    record = {"command": f"{prog} " + " ".join(argv or []), "date": stamp(), "machine": machine(),
              "versions": versions("torch"), "baseline": args.baseline, "block_size": BLOCK}
    print(f"[cpu-prefill] {record['machine']['cpu']} flags {record['machine']['cpu_flags']} load {load_avg()}")
    record["results"] = measure(approaches, cases, args.threads, args.rounds)
    record["load_avg_end"] = load_avg()
    out = Path(args.json) if args.json else ROOT / "bench" / "results" / f"cpu-prefill-{record['date']}.json"
    out.write_text(json.dumps(record, indent=1))
    print(f"[cpu-prefill] load at the end {record['load_avg_end']}; figures -> {out}")
    return record
