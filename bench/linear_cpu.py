"""The engine's float32 linear kernel against oneDNN on a model's layer shapes (``python -m bench linear``).

One "step" is what a forward of T tokens asks of the linear layers: every decoder layer's projections (each
layer its own weights, so that, as in a real forward, the weights stream from memory rather than sit in
cache) and the LM head on min(T, --head-rows) rows (the engine computes logits only for the sampled rows).
Five ways, interleaved in every round: ``hf_paged`` (cuda/linear_cpu.cpp, q/k/v and gate/up packed as one
weight each, as the engine's fused forwards call them), ``onednn`` (torch's mkldnn ``_linear_pointwise`` over
weights reordered once, what the engine used before, siblings apart), ``onednn_grouped`` (the same with
the siblings concatenated), ``f_linear_apart`` (plain ``F.linear`` per module, MKL's sgemm packing the weight
on every call) and ``mkl_packed`` (MKL's packed copy made for T rows, siblings grouped: what the engine's
steps of exactly its token budget use). Reported per row count T: ms per step min / median / max over rounds, the
ratio to hf_paged within each round, and the weight bytes streamed per second.

    python -m bench linear --rows 1,8,14,32,64,128,512 --rounds 5 --threads 2 --json FILE
    python -m bench linear --dtype bfloat16 --rows 1,8,14,32,128,512 --rounds 5 --threads 2   # bf16 kernel vs oneDNN
    python -m bench linear --engine --rounds 4 --threads 2      # the engine with the kernel vs with oneDNN

``--engine``: SmolLM2 itself, the short ShareGPT workload of ``python -m bench engine`` (32 requests, prompts
<= 192), through two engines in one process: hf_paged's kernel (as shipped) and oneDNN's prepacked matmul for
every float32 linear (the kernel unavailable; siblings still grouped), interleaved rounds; the seconds spent
in forwards of prefill-sized steps (more than 32 tokens) and of decode-sized ones, and whether the greedy
tokens agree.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from .common import fmt_spread, int_at_least, ints_at_least, load_avg, machine, spread

SMOLLM2 = dict(hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, layers=30, vocab=49152)


def layer_shapes(m: dict, grouped: bool) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's projections, siblings concatenated when ``grouped``."""
    q, kv = m["heads"] * m["head_dim"], m["kv_heads"] * m["head_dim"]
    attn = [(q + 2 * kv, m["hidden"])] if grouped else [(q, m["hidden"]), (kv, m["hidden"]), (kv, m["hidden"])]
    mlp = [(2 * m["intermediate"], m["hidden"])] if grouped else [(m["intermediate"], m["hidden"])] * 2
    return attn + [(m["hidden"], q)] + mlp + [(m["hidden"], m["intermediate"])]


class Way:
    """One way of running a step: packed weights per layer and the call that runs one of them. ``ops``: hf_paged's
    kernel, None for oneDNN, "f_linear" for plain ``F.linear`` (MKL's sgemm, the weight packed per call) and
    ("mkl", T) for MKL's packed copy made for steps of T rows (what the engine uses for steps of its budget)."""

    def __init__(self, name: str, m: dict, grouped: bool, ops, gen: torch.Generator, dtype=torch.float32):
        self.name, self.ops = name, ops
        if ops == "f_linear":
            pack = lambda w: w                                                         # noqa: E731
        elif isinstance(ops, tuple):
            pack = lambda w: (torch.ops.mkl._mkl_reorder_linear_weight(w, ops[1]), w)  # noqa: E731
        elif ops is not None:
            pack = ops.pack_linear
        else:
            pack = lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None)          # noqa: E731
        size = torch.empty((), dtype=dtype).element_size()
        self.layers = [[(pack((torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)), n, k)
                        for n, k in layer_shapes(m, grouped)] for _ in range(m["layers"])]
        self.head = (pack((torch.randn(m["vocab"], m["hidden"], generator=gen) / m["hidden"] ** 0.5).to(dtype)),
                     m["vocab"], m["hidden"])
        self.bytes = size * (sum(n * k for layer in self.layers for _, n, k in layer) + m["vocab"] * m["hidden"])

    def call(self, packed, n, x):
        if self.ops == "f_linear":
            return torch.nn.functional.linear(x, packed)
        if isinstance(self.ops, tuple):
            return torch.ops.mkl._mkl_linear(x, packed[0], packed[1], None, self.ops[1])   # unpacked when rows differ
        if self.ops is not None:
            return self.ops.linear(x, packed, None, n)
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def step(self, inputs: dict[int, torch.Tensor], head_rows: int) -> None:
        for layer in self.layers:
            for packed, n, k in layer:
                self.call(packed, n, inputs[k])
        packed, n, k = self.head
        self.call(packed, n, inputs[k][:head_rows])


def engine_ab(rounds: int) -> dict:
    """The --engine comparison (see the module doc)."""
    from hf_paged.engine import LLM, prepack

    from . import models
    from .workloads import sharegpt_short
    model = models.smollm2(torch.float32)
    wl = sharegpt_short(32, 0, model.config.vocab_size)
    knobs = dict(max_num_seqs=32, max_num_batched_tokens=512, enable_prefix_caching=False)
    engines = {"hf_paged": LLM(model, **knobs)}
    kernel = prepack._linear_ops
    prepack._linear_ops = lambda: None           # the fallback the engine takes when the kernel cannot be built
    try:
        engines["onednn"] = LLM(model, **knobs)
    finally:
        prepack._linear_ops = kernel
    steps = {name: [] for name in engines}
    for name, llm in engines.items():           # time each forward, by its size
        runner, forward = llm.engine.runner, llm.engine.runner.forward

        def timed(ids, positions, plan, keep, forward=forward, out=steps[name]):
            start = time.perf_counter()
            logits = forward(ids, positions, plan, keep)
            out.append((ids.shape[1], time.perf_counter() - start))
            return logits
        runner.forward = timed

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(
            [r.prompt for r in wl.requests], [dict(max_new_tokens=r.output_len) for r in wl.requests],
            do_sample=False, ignore_eos=True, use_tqdm=False)]
    tokens = {name: run(llm) for name, llm in engines.items()}          # warm-up
    figures = {name: {"wall": [], "prefill": [], "decode": []} for name in engines}
    for r in range(rounds):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            steps[name].clear()
            start = time.perf_counter()
            run(engines[name])
            figures[name]["wall"].append(time.perf_counter() - start)
            figures[name]["prefill"].append(sum(s for n, s in steps[name] if n > 32))
            figures[name]["decode"].append(sum(s for n, s in steps[name] if n <= 32))
    same = sum(a == b for a, b in zip(tokens["hf_paged"], tokens["onednn"]))
    out = {name: {k: spread(v) for k, v in f.items()} for name, f in figures.items()}
    out["tokens_equal"] = f"{same}/{len(wl.requests)}"
    for name in engines:
        print(f"{name:9s} " + "  ".join(f"{k} {fmt_spread(out[name][k], '{:.2f}')} s" for k in ("wall", "prefill", "decode")))
    print(f"greedy tokens equal: {out['tokens_equal']} requests")
    return out


def main(argv=None, prog: str = "python -m bench linear") -> dict:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=ints_at_least(1), default=[1, 8, 14, 32, 64, 128, 512], help="token counts T (comma list)")
    ap.add_argument("--rounds", type=int_at_least(1), default=5)
    ap.add_argument("--threads", type=int_at_least(1), default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--head-rows", type=int_at_least(1), default=32, help="rows the LM head computes at most (sampled rows)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="weights and inputs (bfloat16: the kernel's bf16 form where built, oneDNN, F.linear; no MKL)")
    ap.add_argument("--engine", action="store_true", help="the engine with the kernel vs with oneDNN (module doc)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.engine:
        result = {"machine": machine(), "threads": torch.get_num_threads(), "rounds": args.rounds,
                  "engine": engine_ab(args.rounds)}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1, default=str)
        return result
    from hf_paged.engine.cpu_ops import load_fused_ops
    ops = load_fused_ops()
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    if dtype == torch.bfloat16 and not ops.linear_bf16_available():
        raise SystemExit("the extension has no bf16 kernel here (built for a CPU without AVX-512 BF16)")
    ways = [Way("hf_paged", SMOLLM2, True, ops, gen, dtype), Way("onednn", SMOLLM2, False, None, gen, dtype),
            Way("onednn_grouped", SMOLLM2, True, None, gen, dtype)]
    start_load = load_avg()
    print(f"SmolLM2-135M shapes, {SMOLLM2['layers']} layers + LM head ({ways[0].bytes / 2**20:.0f} MiB of {args.dtype} weights "
          f"per step), {torch.get_num_threads()} threads, {args.rounds} interleaved rounds", flush=True)
    result = {"machine": machine(), "threads": torch.get_num_threads(), "rounds": args.rounds, "shapes": SMOLLM2,
              "head_rows": args.head_rows, "dtype": args.dtype, "rows": {}}
    mkl = hasattr(torch.ops.mkl, "_mkl_linear") and torch.backends.mkl.is_available() and dtype == torch.float32
    ways.append(Way("f_linear_apart", SMOLLM2, False, "f_linear", gen, dtype))     # the engine's large steps before MKL's copy
    for rows in args.rows:
        if mkl:                                  # MKL's copy is made for one row count: remade per T
            ways = [w for w in ways if w.name != "mkl_packed"] + [Way("mkl_packed", SMOLLM2, True, ("mkl", rows), gen)]
        inputs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in {k for w in ways for layer in w.layers for _, _, k in layer}}
        head_rows = min(rows, args.head_rows)
        for w in ways:
            w.step(inputs, head_rows)                       # warm-up
        times = {w.name: [] for w in ways}
        for r in range(args.rounds):
            for w in ways[r % len(ways):] + ways[:r % len(ways)]:   # rotated order
                t = time.perf_counter()
                w.step(inputs, head_rows)
                times[w.name].append(time.perf_counter() - t)
        entry = {name: {"ms": spread([1000 * s for s in secs]),
                        "ratio_to_hf_paged": spread([s / h for s, h in zip(secs, times["hf_paged"])]),
                        "weight_gb_per_s": spread([ways[0].bytes / s / 1e9 for s in secs])}
                 for name, secs in times.items()}
        result["rows"][rows] = entry
        print(f"T={rows:4d}  " + "   ".join(f"{name} {fmt_spread(e['ms'])} ms (x{e['ratio_to_hf_paged']['median']:.2f})"
                                           for name, e in entry.items()), flush=True)
    result["load_avg"] = {"start": start_load, "end": load_avg()}
    print(f"load average {start_load} -> {result['load_avg']['end']}; (xN: that way's time / hf_paged's, per round)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return result
