"""The report's parts from the full-length allocator replay (bench/replay.py): the summary block, section 6
and replay.png. Used by bench/report.py."""
from __future__ import annotations

from .common import fmt_spread, md_table


def _mib(n) -> str:
    return "–" if n is None else f"{n / 2**20:.2f}"


def _mibs(s: dict) -> str:
    return fmt_spread({k: s[k] / 2**20 for k in ("median", "min", "max")})


def replay_summary(res: dict) -> list[str]:
    """The "full-length ShareGPT, allocator replay" block of the summary."""
    rp = res.get("replay")
    if not rp:
        return []
    sg, conc, bm = rp["sharegpt"], rp["concurrency"], rp["beams"]
    s, budget = sg["summary"], conc["_budget_bytes"] / 2**20
    rows = [("hf_paged peak KV in use (MiB)", _mibs(s["paged_peak_bytes"])),
            ("DynamicCache, same padded batch (MiB)", _mibs(s["dynamic_bytes"])),
            ("StaticCache, max_cache_len = max prompt + max new (MiB)", _mibs(s["static_bytes"])),
            (f"generate_batch policy, page {sg['cb_page_size']}, all at full length (MiB)", _mibs(s["gb_policy_bytes"])),
            ("hf_paged peak / DynamicCache", fmt_spread(s["paged_over_dynamic"], "{:.3f}")),
            ("utilisation at the peak step (real / in use)", fmt_spread(s["utilisation_at_peak"], "{:.1%}")),
            ("utilisation averaged over live steps", fmt_spread(s["utilisation_mean"], "{:.1%}")),
            ("hf_paged growable pool's allocated size (no pool size given; grows by half) (MiB)",
             f"{_mibs(s['pool_allocated_bytes'])}, / DynamicCache {fmt_spread(s['pool_over_dynamic'], '{:.3f}')}")]
    for k, label in (("dynamic", "DynamicCache padded batch"), ("static", "StaticCache (oracle max_cache_len)"),
                     ("paged_full", f"hf_paged, full length reserved (block {conc['_block_size']})"),
                     ("paged", "hf_paged padded generate, fixed pool (grows per token, releases at EOS)")):
        rows.append((f"requests held in {budget:.0f} MiB: {label}", fmt_spread(conc[k])))
    for key, e in bm.get("summary", {}).items():
        rows.append((f"{key}: hf_paged allocated / DynamicCache (recorded beams; fully diverged bound)",
                     f"{fmt_spread(e['paged_over_dynamic'], '{:.2f}')}; {fmt_spread(e['diverged_over_dynamic'], '{:.2f}')}"))
    return ["### Full-length ShareGPT, allocator replay (no scaling; SmolLM2-135M shape, fp32)", "",
            f"The real `PagedCache` driven on the meta device with the calls `generate` makes (see section 6). "
            f"Batch of {sg['batch']} unscaled ShareGPT requests, {sg['seeds']} seeds: median (min–max).", "",
            *md_table(["measure", "value"], rows), ""]


CONCURRENCY_LABELS = {
    "dynamic": "DynamicCache, padded batch: n × (max prompt + max output − 1)",
    "static": "StaticCache, max_cache_len = max prompt + max output (oracle)",
    "static_2048": "StaticCache sized for any ShareGPT request (2048 per row)",
    "generate_batch": "generate_batch policy: full length per request, page {page}",
    "paged_full": "hf_paged, full length reserved per request at admission (block {block})",
    "paged": "hf_paged padded generate with max_memory_bytes = budget (blocks grow per token, rows release at EOS); "
             "checked: n replays, n + 1 raises PoolExhaustedError"}


def _beam_rows(bm: dict) -> list[str]:
    if "error" in bm:
        return ["", f"Beam search: {bm['error']}"]
    if "runs" not in bm:
        return []
    same = {True: "yes", False: "**no**", None: "–"}
    return ["", f"**Beam search** — {bm['source']}. Fully diverged = beam i always continues beam i after the "
            "first step (no generated block shared: the upper bound).", "",
            *md_table(["beams", "prompt", "new", "beam_idx", "DynamicCache (MiB)", "hf_paged peak in use (MiB)",
                       "hf_paged allocated (MiB)", "allocated / DynamicCache", "diverged bound ratio",
                       "replay = real run's peak"],
                      [(r["num_beams"], r["prompt_len"], r["max_new_tokens"], r["source"], _mib(r["dynamic_bytes"]),
                        _mib(r["paged_peak_bytes"]), _mib(r.get("paged_allocated_bytes", 0)),
                        f"{r['paged_over_dynamic']:.2f}", f"{r['diverged_over_dynamic']:.2f}",
                        same[r["matches_real_run"]]) for r in bm["runs"]])]


def replay_section(res: dict, pngs: list[str]) -> list[str]:
    rp = res.get("replay")
    if not rp:
        return []
    sg, conc = rp["sharegpt"], rp["concurrency"]
    lines = ["## 6. Full-length allocator replay", "",
             f"{rp['model_shape']}: {rp['bytes_per_token']} bytes/token, block {rp['block_size']}. The real "
             "`hf_paged.PagedCache` (pools on the `meta` device: no memory, no attention) receives the calls "
             "`generate` makes — `plan_step` with the left-padded 2D mask and the input ids of every forward, "
             "`reorder_cache` with beam indices; a row's last token is EOS, fed once (its blocks are released), "
             "then pad. `tests/bench/test_bench_replay.py` checks the replay's `stats()` after every forward against a "
             "real `generate` on a tiny model. DynamicCache = rows × (max prompt + max new − 1) columns (its size "
             f"after the last forward); StaticCache = rows × (max prompt + max new). Took {rp['seconds']:.1f} s.", "",
             f"**ShareGPT, padded batch of {sg['batch']}, unscaled lengths**, seed s = the draw of "
             f"`sharegpt_mix({sg['batch']}, 2048, seed=s)`:", "",
             *md_table(["seed", "max prompt", "max output", "DynamicCache (MiB)", "hf_paged peak in use (MiB)", "ratio",
                        "real at peak (MiB)", "utilisation at peak", "over steps", "growable pool (MiB)"],
                       [(x["seed"], x["max_prompt"], x["max_output"], _mib(x["dynamic_bytes"]),
                         _mib(x["paged_peak_bytes"]), f"{x['paged_over_dynamic']:.3f}", _mib(x["real_at_peak_bytes"]),
                         f"{x['utilisation_at_peak']:.1%}", f"{x['utilisation_mean']:.1%}",
                         _mib(x["pool_allocated_bytes"])) for x in sg["per_seed"]])]
    labels = {k: v.format(page=conc["_cb_page_size"], block=conc["_block_size"]) for k, v in CONCURRENCY_LABELS.items()}
    lines += ["", f"**Concurrency at {conc['_budget_bytes'] / 2**20:.0f} MiB** ({conc['_bytes_per_token']} bytes/token, "
              f"{conc['_draws']} arrival orders of unscaled ShareGPT, the same orders for every policy): the largest n such that "
              "the first n requests, as one batch, never need more KV than the budget.", "",
              *md_table(["approach / allocation policy", "requests held: median (min–max)"],
                        [(label, fmt_spread(conc[k])) for k, label in labels.items() if k in conc])]
    lines += _beam_rows(rp["beams"])
    if "replay.png" in pngs:
        lines += ["", "![full-length replay](replay.png)"]
    return lines + [""]


def bars(ax, labels, stats, scale: float = 1.0, horizontal: bool = False) -> None:
    """Bars at the medians with min–max error bars (none for a figure of one run: a median alone)."""
    med = [s["median"] * scale for s in stats]
    err = [[(s["median"] - s.get("min", s["median"])) * scale for s in stats],
           [(s.get("max", s["median"]) - s["median"]) * scale for s in stats]]
    if horizontal:
        ax.barh(labels, med, xerr=err)
    else:
        ax.bar(labels, med, yerr=err)


def replay_plot(res: dict, plt):
    rp = res.get("replay")
    if not rp:
        return None
    s, conc = rp["sharegpt"]["summary"], rp["concurrency"]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(12, 3.4))
    items = [("Dynamic\nCache", "dynamic_bytes"), ("Static\nCache", "static_bytes"),
             ("generate_batch\npolicy", "gb_policy_bytes"), ("hf_paged\npeak", "paged_peak_bytes"),
             ("real tokens", "real_at_peak_bytes")]
    bars(a1, [k for k, _ in items], [s[v] for _, v in items], 2**-20)
    a1.set_ylabel("KV MiB (median, min–max)")
    a1.set_title(f"ShareGPT batch of {rp['sharegpt']['batch']}, full lengths", fontsize=9)
    a1.tick_params(axis="x", labelsize=6)
    keys = [k for k in ("static_2048", "dynamic", "static", "generate_batch", "paged_full", "paged") if k in conc]
    bars(a2, keys, [conc[k] for k in keys], horizontal=True)
    a2.set_xlabel(f"requests held in {conc['_budget_bytes'] / 2**20:.0f} MiB")
    a2.tick_params(axis="y", labelsize=7)
    runs = rp["beams"].get("runs", [])
    if runs:
        labels = [f"b{r['num_beams']} p{r['prompt_len']} n{r['max_new_tokens']}" for r in runs]
        a3.barh(labels, [r["paged_over_dynamic"] for r in runs], label="recorded beams")
        a3.scatter([r["diverged_over_dynamic"] for r in runs], labels, color="k", marker="|", s=80, label="diverged bound")
        a3.axvline(0.5, color="r", lw=0.8)
        a3.set_xlabel("hf_paged / DynamicCache KV")
        a3.legend(fontsize=6)
        a3.tick_params(axis="y", labelsize=6)
    return fig
