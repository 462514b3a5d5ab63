"""The summary of ``python -m bench serve`` (bench/serve_load.py): min / median / max over rounds per server and
rate, hf_paged's ratio to each peer taken within a round, the table on stdout, the JSON and the plot.

A rate is requests per second (Poisson arrivals) or ``inf``: every request sent at once, the saturated run;
its key in the JSON is ``"inf"`` and its label ``all``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from .common import pyplot, spread, stamp

METRICS = ("output_tokens_per_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "e2e_p50", "e2e_p99")

INF = float("inf")


def rate_key(rate: float) -> str:
    """The key of a rate in the summary and the runs: str(rate), 'inf' for all requests at once."""
    return "inf" if math.isinf(rate) else str(rate)


def rate_label(rate: float) -> str:
    return "all" if math.isinf(rate) else f"{rate:g}"


def summarise(runs: list[dict], rates) -> dict:
    """{server: {rate_key(rate): {metric: min/median/max over rounds, "rounds", "requests_failed"}}}."""
    summary = {}
    for name in {r["server"] for r in runs}:
        for rate in rates:
            rs = [r for r in runs if r["server"] == name and str(r["rate"]) == rate_key(rate)]
            if rs:
                summary.setdefault(name, {})[rate_key(rate)] = {m: spread([r[m] for r in rs]) for m in METRICS} | {
                    "rounds": len(rs), "requests_failed": sum(r["requests_failed"] for r in rs)}
    return summary


def ratios(runs: list[dict], rates, base: str = "hf_paged") -> dict:
    """{f"{base}/{peer}": {rate_key: {"output_tokens_per_s", "ttft_p50": min/median/max of the per-round
    ratio}}}: each ratio taken within one round, so that a noisy moment moves both sides."""
    by = {(r["server"], str(r["rate"]), r["round"]): r for r in runs if r["requests_ok"]}
    rounds = sorted({r["round"] for r in runs})
    out = {}
    for peer in sorted({r["server"] for r in runs} - {base}):
        for rate in rates:
            k = rate_key(rate)
            pairs = [(by[(base, k, n)], by[(peer, k, n)]) for n in rounds if (base, k, n) in by and (peer, k, n) in by]
            if pairs:
                out.setdefault(f"{base}/{peer}", {})[k] = {
                    m: spread([a[m] / b[m] for a, b in pairs if a[m] and b[m]]) for m in ("output_tokens_per_s", "ttft_p50")}
    return out


def write(result: dict, args, model_desc: str) -> None:
    """The JSON and the plot under --out; the table and the caveats on stdout."""
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"serve-{stamp()}"
    json_path = args.out / f"{name}.json"
    json_path.write_text(json.dumps(result, indent=1))
    print_table(result["summary"], args.rates)
    print_ratios(result["ratios"], args.rates)
    print("caveats:\n" + "\n".join(f"  - {c}" for c in result["caveats"]))
    print(f"[serve] results: {json_path}")
    if not args.no_plot and result["summary"]:
        png = plot(result["summary"], args.rates, args.out / f"{name}.png", model_desc, args.threads)
        if png:
            print(f"[serve] plot: {png}")


def fmt_ms(v: float | None) -> str:
    return "    -   " if v is None else f"{v * 1000:6.0f}ms"


def print_table(summary: dict, rates: list[float]) -> None:
    print("\nmedian over rounds [min - max]; tok/s = output tokens / run wall time; rate 'all': every request at once")
    print(f"{'server':>12} {'rate':>5} {'tok/s':>22} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>9} {'ITL p99':>9} {'E2E p50':>9}")
    for name in sorted(summary):
        for rate in rates:
            s = summary[name].get(rate_key(rate))
            if not s:
                continue
            tp = s["output_tokens_per_s"]
            tps = f"{tp['median']:.1f} [{tp['min']:.1f}-{tp['max']:.1f}]" if tp else "-"
            med = {m: (s[m]["median"] if s[m] else None) for m in METRICS}
            print(f"{name:>12} {rate_label(rate):>5} {tps:>22} {fmt_ms(med['ttft_p50']):>9} {fmt_ms(med['ttft_p99']):>9} "
                  f"{fmt_ms(med['itl_p50']):>9} {fmt_ms(med['itl_p99']):>9} {fmt_ms(med['e2e_p50']):>9}")


def print_ratios(ratios: dict, rates: list[float]) -> None:
    """hf_paged's ratio to each peer, per rate (tok/s above 1 and TTFT below 1 favour hf_paged)."""
    for pair, by_rate in ratios.items():
        cells = []
        for rate in rates:
            r = by_rate.get(rate_key(rate), {})
            tp, tt = r.get("output_tokens_per_s"), r.get("ttft_p50")
            cell = f"rate {rate_label(rate)}:"
            cell += f" tok/s x{tp['median']:.2f} [{tp['min']:.2f}-{tp['max']:.2f}]" if tp else ""
            cell += f" TTFT p50 x{tt['median']:.2f} [{tt['min']:.2f}-{tt['max']:.2f}]" if tt else ""
            cells.append(cell)
        print(f"{pair}, ratio within a round, median [min-max]: " + "; ".join(cells))


def plot(summary: dict, rates: list[float], path: Path, model_desc: str, threads: int) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    panels = [("ttft_p50", "TTFT p50 (ms)"), ("ttft_p99", "TTFT p99 (ms)"), ("itl_p50", "ITL p50 (ms)"),
              ("output_tokens_per_s", "output tokens/s")]
    finite = [r for r in rates if not math.isinf(r)]
    xpos = {rate_key(r): (r if not math.isinf(r) else 2 * max(finite, default=1.0)) for r in rates}
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (metric, label) in zip(axes, panels):
        scale = 1.0 if metric == "output_tokens_per_s" else 1000.0
        for name in sorted(summary):
            xs, ys, lo, hi = [], [], [], []
            for rate in rates:
                s = summary[name].get(rate_key(rate), {}).get(metric)
                if s:
                    xs.append(xpos[rate_key(rate)])
                    ys.append(s["median"] * scale)
                    lo.append((s["median"] - s["min"]) * scale)
                    hi.append((s["max"] - s["median"]) * scale)
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=name)
        ax.set_xlabel("request rate (req/s, Poisson; 'all': at once)")
        ax.set_xticks(list(xpos.values()), [rate_label(r) for r in rates])
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{model_desc}; {threads} threads per server; median over rounds, bars min-max", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
