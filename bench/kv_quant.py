"""Quantised KV blocks on the real SmolLM2-135M: quality, memory, requests held, speed.

``python -m bench kv-quant [--sections quality,held-out,capacity,speed,quantized-cache] [--out DIR]``

quality  fp32 and bf16 model: teacher-forced perplexity of real text (the Python reference manual's
         topics, which CPython ships as ``pydoc_data.topics``) through a PagedCache of each format
         against the model-dtype KV; the mean KL divergence of next-token distributions; greedy agreement
         (new tokens until the first that differs from the model-dtype run, 64 at most). One forward per
         passage reads every position's keys from the quantised pool, as decoding token by token would
         (scales are per token, so the stored codes do not depend on the order of writes; kivi's reads depend
         only on positions: hf_paged.kivi). (The study of
         int4 groups of 32/64 and of no rotation that chose the defaults is in results/kv-quant-20261201-*.)
held-out fp32 model: 24 passages of stdlib docstrings, stdlib source comments and the stdlib's license
         (``kv_quant_texts``), decoded token by token (``kv_quant_decode``): perplexity change and KL per kind.
         ``--prompt N`` (not 32): 18 passages of the license, comments and stdlib code with N-token prompts.
capacity bf16 model, the engine with a fixed 24 MiB KV budget and 96 requests of 64 + 16 tokens (more than
         any format holds): blocks, bytes per token (scales included), requests that fit whole, and the
         most requests running at once, per format.
speed    fp32 model, 1 thread: the engine's useful tokens/s per format on 32 ShareGPT-shaped requests,
         3 interleaved rounds (min/median/max), prefix caching off. ``--speed-prompt N --speed-output M
         [--speed-requests R]``: instead, R (16) requests of N random prompt tokens and M generated ones,
         where a decode step reads more KV bytes than weights (the regime KV quantisation is for). Each run's
         steps are also timed by kind (prefill: steps with a prompt chunk; decode: one token per sequence), and
         reported as auto's seconds over the format's, per round. A second auto engine ("auto (control)",
         ``--no-speed-control`` leaves it out) runs beside them: its ratio to auto is this run's noise floor
         (identical engines in one process differed by 0.92-1.02x round to round on a 2-core EPYC).
quantized-cache  transformers' QuantizedCache (optimum-quanto, 4 and 2 bits, residual 128) where installed,
         decoding token by token on two passages, beside our int4 on the same tokens: perplexity,
         KV bytes, seconds.
Writes ``kv-quant-<stamp>.json`` and ``.md`` (and a plot, matplotlib installed) under bench/results.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import time
from pathlib import Path

import torch

import hf_paged

from .common import RESULTS, machine, pyplot, spread, stamp
from .kv_quant_decode import held_out, held_out_table
from .kv_quant_texts import PROMPT

NAMES = ["auto", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "kivi", "nvfp4"]
SECTIONS = ["quality", "held-out", "capacity", "speed", "quantized-cache"]

def passages(tokenizer, count: int = 8, tokens: int = 512) -> list[torch.Tensor]:
    """The first ``count`` reference-manual topics (sorted by name) with at least ``tokens`` tokens."""
    from pydoc_data.topics import topics  # noqa: PLC0415  (CPython's own documentation text)
    out = []
    for name in sorted(topics):
        ids = tokenizer(topics[name], return_tensors="pt").input_ids[0]
        if len(ids) >= tokens:
            out.append(ids[:tokens])
        if len(out) == count:
            break
    return out


def paged_cache(model, name: str) -> hf_paged.PagedCache:
    return hf_paged.PagedCache(model.config, kv_cache_dtype=name, dtype=model.dtype)    # (kivi: its 32-token blocks)


def _log_probs(model, ids: torch.Tensor, cache=None) -> torch.Tensor:
    with torch.no_grad():
        if cache is None:
            logits = model(input_ids=ids.unsqueeze(0), use_cache=False).logits[0]
        else:
            with hf_paged.use_paged_attention(model):
                logits = model(input_ids=ids.unsqueeze(0), past_key_values=cache).logits[0]
    return logits[:-1].float().log_softmax(-1)


def quality(model, tokenizer, names: list[str], progress) -> dict:
    texts = passages(tokenizer)
    refs = [_log_probs(model, ids) for ids in texts]
    nll_ref = torch.cat([-r.gather(-1, ids[1:, None])[:, 0] for r, ids in zip(refs, texts)])
    prompts = torch.stack([ids[:32] for ids in texts])
    with torch.no_grad():
        greedy_ref = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=64,
                                    min_new_tokens=64, do_sample=False)[:, 32:]
    out = {"tokens": int(nll_ref.numel()), "ppl_model_dtype_kv": float(nll_ref.mean().exp())}
    for name in names:
        t0 = time.perf_counter()
        nll, kl = [], []
        for ref, ids in zip(refs, texts):
            got = _log_probs(model, ids, paged_cache(model, name))
            nll.append(-got.gather(-1, ids[1:, None])[:, 0])
            kl.append((ref.exp() * (ref - got)).sum(-1))
        nll, kl = torch.cat(nll), torch.cat(kl)
        with torch.no_grad():
            greedy = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=64,
                                    min_new_tokens=64, do_sample=False, past_key_values=paged_cache(model, name))[:, 32:]
        differ = (greedy != greedy_ref).int()
        agree = torch.where(differ.any(1), differ.argmax(1), torch.full_like(differ[:, 0], 64)).float()
        ppl = float(nll.mean().exp())
        out[name] = {"ppl": ppl, "ppl_delta_pct": 100 * (ppl / out["ppl_model_dtype_kv"] - 1),
                     "kl_mean": float(kl.mean()), "kl_p99": float(kl.quantile(0.99)),
                     "greedy_agree_mean": float(agree.mean()), "greedy_agree_min": int(agree.min()),
                     "bytes_per_token": paged_cache(model, name).bytes_per_token}
        progress(f"  {name:9s} ppl {ppl:.4f} ({out[name]['ppl_delta_pct']:+.2f}%)  KL {out[name]['kl_mean']:.2e}  "
                 f"greedy agree {out[name]['greedy_agree_mean']:.1f}/64  ({time.perf_counter() - t0:.0f} s)")
    return out


def _requests(n: int, seed: int, vocab: int, max_total: int = 384):
    from .workloads import sharegpt_mix  # noqa: PLC0415
    work = sharegpt_mix(n, max_total, vocab, seed=seed)
    return [r.prompt for r in work.requests], work.output_lens


def capacity(model, names: list[str], progress, budget: int = 24 * 2**20, requests: int = 96,
             prompt: int = 64, output: int = 16) -> dict:
    """More requests than any format's pool holds, all of one shape (prompt + output = 5 blocks of 16),
    so that the pool, not the workload, bounds how many run at once."""
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(100, model.config.vocab_size, (requests, prompt), generator=gen).tolist()
    out = {"budget_bytes": budget, "requests": requests, "prompt": prompt, "output": output}
    for name in names:
        llm = hf_paged.LLM(model, kv_cache_memory_bytes=budget, kv_cache_dtype=name, max_num_seqs=requests)
        peak = 0
        t0 = time.perf_counter()
        for _ in llm.stream(prompts, max_new_tokens=output, ignore_eos=True, do_sample=False, use_tqdm=False):
            peak = max(peak, llm.engine.stats().requests_running)
        s = llm.stats()
        per_request = -(-(prompt + output) // s["block_size"])
        out[name] = {"blocks": s["blocks_total"], "bytes_per_token": s["bytes_per_token"], "peak_running": peak,
                     "fit_without_preemption": s["blocks_total"] // per_request, "preemptions": s["preemptions"],
                     "seconds": time.perf_counter() - t0}
        progress(f"  {name:9s} {s['blocks_total']} blocks, {s['bytes_per_token']} B/token, "
                 f"{out[name]['fit_without_preemption']} requests fit, peak {peak} running, "
                 f"{s['preemptions']} preemptions")
    return out


CONTROL = "auto (control)"


def speed(model, names: list[str], progress, rounds: int = 3, prompt: int = 0, output: int = 0,
          requests: int = 16, control: bool = False) -> dict:
    """``prompt``/``output`` (both > 0): ``requests`` requests of that shape instead of the ShareGPT-shaped
    ones. Every format gets the engine's default KV budget on the CPU (512 MiB), so where auto's pool cannot
    hold every request at once the smaller formats also run more of them per step. ``control``: one more
    engine of the first format (``CONTROL``), timed as the others: how far an identical engine strays."""
    if prompt > 0 and output > 0:
        gen = torch.Generator().manual_seed(2)
        prompts = torch.randint(100, model.config.vocab_size, (requests, prompt), generator=gen).tolist()
        outputs = [output] * requests
        workload = f"{requests} requests of {prompt} random prompt tokens + {output} generated"
    else:
        prompts, outputs = _requests(32, seed=2, vocab=model.config.vocab_size, max_total=256)
        workload = "32 ShareGPT-shaped requests, prompt + output <= 256 tokens"
    settings = [{"max_new_tokens": n, "ignore_eos": True, "do_sample": False} for n in outputs]
    useful = sum(outputs)
    # prefix caching off: every round prefills its prompts (with it, a format whose pool keeps the previous
    # round's blocks would skip its prefill, and the smaller formats keep more)
    formats = {name: name for name in names} | ({CONTROL: names[0]} if control else {})
    names = list(formats)
    engines = {name: hf_paged.LLM(model, kv_cache_dtype=fmt, max_num_seqs=32, enable_prefix_caching=False)
               for name, fmt in formats.items()}
    phases = {name: _time_phases(llm.engine.runner) for name, llm in engines.items()}
    for llm in engines.values():                              # warm-up
        llm.generate(prompts[:2], settings[:2], use_tqdm=False)
    rates: dict[str, list[float]] = {name: [] for name in names}
    seconds: dict[str, dict[str, list[float]]] = {name: {"prefill": [], "decode": []} for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):   # interleaved, alternating order
            phases[name].update(prefill=0.0, decode=0.0)
            t0 = time.perf_counter()
            engines[name].generate(prompts, settings, use_tqdm=False)
            rates[name].append(useful / (time.perf_counter() - t0))
            for phase in ("prefill", "decode"):
                seconds[name][phase].append(phases[name][phase])
        progress(f"  round {r + 1}: " + ", ".join(f"{n} {rates[n][-1]:.1f}" for n in names))
    # each format's rate over the first format's ("auto"), per round: the ratio the noise of a round hits least;
    # per phase, the first format's seconds over this one's (> 1: this format's steps were faster)
    first = names[0]
    return {"threads": torch.get_num_threads(), "useful_tokens": useful, "requests": len(prompts), "rounds": rounds,
            "workload": workload,
            **{n: {**spread(v), "ratio": spread([a / b for a, b in zip(v, rates[first])]),
                   **{f"{phase}_ratio": spread([a / b for a, b in zip(seconds[first][phase], seconds[n][phase])])
                      for phase in ("prefill", "decode")},
                   **{f"{phase}_s": spread(seconds[n][phase]) for phase in ("prefill", "decode")}}
               for n, v in rates.items()}}


def _time_phases(runner) -> dict:
    """Seconds of the engine's steps by kind, accumulated into the returned dict (reset by the caller): "decode"
    for steps whose every scheduled sequence computes one token, "prefill" for the rest (prompt chunks, mixed
    steps). Wraps this runner's ``execute`` on the instance (the bench's own engines only)."""
    totals = {"prefill": 0.0, "decode": 0.0}
    execute = runner.execute

    def timed(batch, *args, **kwargs):
        start = time.perf_counter()
        try:
            return execute(batch, *args, **kwargs)
        finally:
            kind = "decode" if all(count == 1 for _, count in batch) else "prefill"
            totals[kind] += time.perf_counter() - start
    runner.execute = timed
    return totals


def quantized_cache(model, tokenizer, progress, count: int = 2, tokens: int = 256, prefill: int = 32) -> dict:
    """Token-by-token teacher forcing: QuantizedCache quantises only what it stores after the prefill
    (the prefill itself attends in full precision), so a single forward would not measure it."""
    if importlib.util.find_spec("optimum.quanto") is None:
        return {"skipped": "optimum-quanto is not installed (pip install optimum-quanto)"}
    from transformers import DynamicCache, QuantizedCache  # noqa: PLC0415
    texts = passages(tokenizer, count, tokens)
    rows = {}
    makers = {"DynamicCache": lambda: DynamicCache(config=model.config),
              "QuantizedCache quanto int4": lambda: QuantizedCache("quanto", model.config, nbits=4),
              "QuantizedCache quanto int2": lambda: QuantizedCache("quanto", model.config, nbits=2),
              "hf_paged auto": lambda: hf_paged.PagedCache(model.config, dtype=model.dtype),
              "hf_paged int4": lambda: hf_paged.PagedCache(model.config, kv_cache_dtype="int4", dtype=model.dtype),
              "hf_paged int8": lambda: hf_paged.PagedCache(model.config, kv_cache_dtype="int8", dtype=model.dtype)}
    for label, make in makers.items():
        nll, seconds, kv_bytes = [], 0.0, 0
        for ids in texts:
            cache = make()
            paged = isinstance(cache, hf_paged.PagedCache)
            t0 = time.perf_counter()
            with torch.no_grad(), (hf_paged.use_paged_attention(model) if paged else contextlib.nullcontext()):
                logits = [model(input_ids=ids[None, :prefill], past_key_values=cache).logits[0, -1]]
                for t in range(prefill, len(ids) - 1):
                    logits.append(model(input_ids=ids[None, t:t + 1], past_key_values=cache).logits[0, -1])
            seconds += time.perf_counter() - t0
            log_probs = torch.stack(logits).float().log_softmax(-1)
            nll.append(-log_probs.gather(-1, ids[prefill:, None])[:, 0])
            kv_bytes = cache.stats()["kv_bytes_used"] if paged else _quantized_cache_bytes(cache)
        rows[label] = {"ppl": float(torch.cat(nll).mean().exp()), "seconds": seconds, "kv_bytes_last": kv_bytes}
        progress(f"  {label:28s} ppl {rows[label]['ppl']:.4f}  {seconds:.1f} s  KV {kv_bytes / 2**20:.2f} MiB")
    return {"passages": count, "tokens": tokens, "prefill": prefill, **rows}


def _quantized_cache_bytes(cache) -> int:
    """Bytes a transformers cache holds: every tensor attribute of its layers (quantised tensors by
    their packed data and scales, which quanto exposes as tensor attributes too)."""
    seen, total = set(), 0

    def visit(obj, depth=0):
        nonlocal total
        if depth > 4 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor) and type(obj) is torch.Tensor:
            total += obj.nbytes
        elif isinstance(obj, torch.Tensor) or hasattr(obj, "__dict__"):
            for value in vars(obj).values() if hasattr(obj, "__dict__") else ():
                visit(value, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                visit(value, depth + 1)

    for layer in cache.layers:
        visit(layer)
    return total


def _ratio(spread_of: dict | None) -> str:
    """A per-round ratio's "median (min–max)", or "-" where the run did not record it."""
    if not spread_of:
        return "-"
    return f"{spread_of['median']:.2f}x ({spread_of['min']:.2f}–{spread_of['max']:.2f})"


def _table(title: str, header: list[str], section: dict, row) -> list[str]:
    """A markdown table: one row per format (the dict entries of ``section``), cells from ``row(entry)``."""
    names = [n for n in section if isinstance(section[n], dict)]
    return [title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *(f"| {n} | " + " | ".join(row(section[n])) + " |" for n in names), ""]


def report(result: dict) -> str:
    lines = [f"# Quantised KV on SmolLM2-135M ({result['date']}, {result['machine']})", ""]
    for dtype in ("fp32", "bf16"):
        q = result.get(f"quality_{dtype}")
        if q:
            lines += _table(
                f"## Quality, {dtype} model ({q['tokens']} teacher-forced tokens of the Python reference manual; "
                f"perplexity {q['ppl_model_dtype_kv']:.4f} with model-dtype KV)",
                ["kv_cache_dtype", "bytes/token", "vs model dtype", "perplexity", "change", "KL mean", "KL p99",
                 "greedy agreement (of 64) mean / min"], q,
                lambda r, q=q: [str(r["bytes_per_token"]), f"{r['bytes_per_token'] / q['auto']['bytes_per_token']:.3f}",
                                f"{r['ppl']:.4f}", f"{r['ppl_delta_pct']:+.2f}%", f"{r['kl_mean']:.2e}",
                                f"{r['kl_p99']:.2e}", f"{r['greedy_agree_mean']:.1f} / {r['greedy_agree_min']}"])
    if result.get("held_out"):
        lines += held_out_table(result["held_out"])
    c = result.get("capacity")
    if c:
        lines += _table(
            f"## Requests held, bf16 model, {c['budget_bytes'] / 2**20:.0f} MiB KV budget, {c['requests']} "
            f"requests of {c['prompt']} + {c['output']} tokens",
            ["kv_cache_dtype", "blocks", "bytes/token", "requests that fit", "vs auto", "peak running", "preemptions"], c,
            lambda r: [str(r["blocks"]), str(r["bytes_per_token"]), str(r["fit_without_preemption"]),
                       f"{r['fit_without_preemption'] / c['auto']['fit_without_preemption']:.2f}x",
                       str(r["peak_running"]), str(r["preemptions"])])
    sp = result.get("speed")
    if sp:
        lines += _table(
            f"## Engine speed, fp32 model, {sp['threads']} thread(s), "
            f"{sp.get('workload', str(sp['requests']) + ' requests')} ({sp['useful_tokens']} useful tokens), "
            "useful tokens/s min / median / max",
            ["kv_cache_dtype", "tokens/s", "vs auto, per round: median (min–max)", "prefill steps vs auto",
             "decode steps vs auto"], sp,
            lambda r: [f"{r['min']:.1f} / {r['median']:.1f} / {r['max']:.1f}",
                       _ratio(r.get("ratio")) if "ratio" in r else f"{r['median'] / sp['auto']['median']:.2f}x",
                       _ratio(r.get("prefill_ratio")), _ratio(r.get("decode_ratio"))])
    qc = result.get("quantized_cache")
    if qc and "skipped" in qc:
        lines += ["## Beside transformers' QuantizedCache", "", qc["skipped"], ""]
    elif qc:
        lines += _table(
            "## Beside transformers' QuantizedCache (token-by-token teacher forcing, fp32 model): "
            f"{qc['passages']} passages x {qc['tokens']} tokens, prefill {qc['prefill']}",
            ["cache", "perplexity", "seconds", "KV bytes at the end of a passage"], qc,
            lambda r: [f"{r['ppl']:.4f}", f"{r['seconds']:.1f}", f"{r['kv_bytes_last'] / 2**10:.0f} KiB"])
    return "\n".join(lines)


def plot(result: dict, path: Path) -> bool:
    """Perplexity change against KV bytes (quality sections) and each format's speed ratio to auto with its
    per-round range, the noise control beside them (speed section), side by side; False when there is
    nothing to draw or no matplotlib."""
    plt = pyplot()
    quality_runs = [(dtype, marker, result[f"quality_{dtype}"]) for dtype, marker in (("fp32", "o"), ("bf16", "s"))
                    if result.get(f"quality_{dtype}")]
    sp = result.get("speed")
    panels = bool(quality_runs) + bool(sp)
    if plt is None or not panels:
        return False
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    axes = list(axes[0])
    if quality_runs:
        ax = axes.pop(0)
        for dtype, marker, q in quality_runs:
            names = [n for n in q if isinstance(q[n], dict)]
            x = [q[n]["bytes_per_token"] / q["auto"]["bytes_per_token"] for n in names]
            y = [q[n]["ppl_delta_pct"] for n in names]
            ax.scatter(x, y, marker=marker, label=f"{dtype} model")
            for n, xi, yi in zip(names, x, y):
                ax.annotate(n, (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_xlabel("KV bytes per token vs the model's dtype (scales included)")
        ax.set_ylabel("perplexity change, %")
        ax.set_title("SmolLM2-135M: quantised KV blocks")
        ax.legend()
    if sp:
        ax = axes.pop(0)
        names = [n for n in sp if isinstance(sp[n], dict) and "ratio" in sp[n]]
        med = [sp[n]["ratio"]["median"] for n in names]
        low = [m - sp[n]["ratio"]["min"] for n, m in zip(names, med)]
        high = [sp[n]["ratio"]["max"] - m for n, m in zip(names, med)]
        for i, n in enumerate(names):
            ax.errorbar([i], [med[i]], yerr=[[low[i]], [high[i]]], fmt="o", capsize=4,
                        color="grey" if n == CONTROL else "tab:blue")
        ax.axhline(1.0, color="black", lw=0.5)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("tokens/s vs auto per round (median, min–max)")
        ax.set_title(f"speed: {sp.get('workload', '')}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None, prog: str = "python -m bench kv-quant") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {','.join(SECTIONS)}")
    parser.add_argument("--formats", default=",".join(NAMES), help="kv_cache_dtype values to measure ('auto' first)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (recorded)")
    parser.add_argument("--rounds", type=int, default=3, help="speed: interleaved rounds")
    parser.add_argument("--prompt", type=int, default=PROMPT,
                        help="held-out: prompt tokens per passage (other than 32: the long set of license, comment "
                             "and code passages, 6 each)")
    parser.add_argument("--speed-prompt", type=int, default=0, help="speed: prompt tokens of each long request")
    parser.add_argument("--speed-requests", type=int, default=16, help="speed: how many long requests")
    parser.add_argument("--speed-output", type=int, default=0, help="speed: tokens each long request generates")
    parser.add_argument("--no-speed-control", dest="speed_control", action="store_false",
                        help="speed: no second engine of the first format (the noise control)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    names = [n for n in args.formats.split(",") if n]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        parser.error(f"--sections: unknown {unknown or 'none given'}; choose from {','.join(SECTIONS)}")
    from hf_paged.kv_formats import KV_CACHE_DTYPES  # noqa: PLC0415
    unknown = [n for n in names if n not in KV_CACHE_DTYPES]
    if unknown or not names:
        parser.error(f"--formats: unknown {unknown or 'none given'}; choose from {','.join(KV_CACHE_DTYPES)}")
    if args.threads < 1 or args.rounds < 1:
        parser.error(f"--threads and --rounds must be >= 1 (got {args.threads}, {args.rounds})")
    torch.set_num_threads(args.threads)
    from hf_paged.integrations.smollm2 import load_smollm2  # noqa: PLC0415

    progress = functools.partial(print, flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{os.cpu_count()} CPUs, no GPU",
              "threads": args.threads, "torch": torch.__version__, "host": machine()}
    runs = [  # section, model dtype, result key, what it runs; fp32 first, the bf16 model loaded when needed
        ("quality", torch.float32, "quality_fp32", lambda m, tok: quality(m, tok, names, progress)),
        ("held-out", torch.float32, "held_out", lambda m, tok: held_out(m, tok, names, progress, args.prompt)),
        ("speed", torch.float32, "speed", lambda m, tok: speed(m, names, progress, args.rounds, args.speed_prompt,
                                                            args.speed_output, args.speed_requests,
                                                            args.speed_control)),
        ("quantized-cache", torch.float32, "quantized_cache", lambda m, tok: quantized_cache(m, tok, progress)),
        ("quality", torch.bfloat16, "quality_bf16", lambda m, tok: quality(m, tok, names, progress)),
        ("capacity", torch.bfloat16, "capacity", lambda m, tok: capacity(m, names, progress))]
    loaded = {}
    for section, dtype, key, run in runs:
        if section not in sections:
            continue
        if dtype not in loaded:
            loaded[dtype] = load_smollm2(dtype=dtype, verbose=False)
            hf_paged.patch(loaded[dtype][0])
        progress(f"{key.replace('_', ' ')}, {str(dtype).removeprefix('torch.')} model")
        result[key] = run(*loaded[dtype])
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"kv-quant-{stamp()}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(report(result))
    plotted = plot(result, stem.with_suffix(".png"))
    print(report(result))
    print(f"wrote {stem}.json, .md" + (", .png" if plotted else ""))
