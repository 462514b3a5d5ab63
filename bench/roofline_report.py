"""The roofline's findings and markdown (bench/roofline.py computes the rows): plain sentences on each
target and the table the README quotes. Every figure here is predicted, not measured."""
from __future__ import annotations

from .roofline import LABEL, DecodeFast, DecodeRow, ExtendRow, Machine, Ragged, decode_row, memory_bound_limit


def headroom(clocks: dict) -> float:
    """Memory clocks over the busiest other pipe: how much worse the kernel may get before that pipe,
    not HBM, binds (above 1: memory-bound)."""
    return clocks["memory"] / max(v for k, v in clocks.items() if k != "memory")


def findings(decode: list[DecodeRow], extend: list[ExtendRow], m: Machine) -> list[str]:
    """Plain sentences on the targets, each a prediction."""
    out = []
    for r in decode:
        if r.target is not None:
            out.append(f"{r.design} at {r.batch}x{r.context // 1024}k GQA {r.group}: {r.fraction:.0%} of copy bandwidth "
                       f"against the {r.target:.0%} target: {r.verdict.lower()} ({r.bound}-bound; the busiest other "
                       f"pipe is at {1 / headroom(r.clocks):.0%} of the memory time).")
    fast = DecodeFast()
    limit = memory_bound_limit(fast, m)
    over = fast.load(limit + 1).clocks(m)
    at_7 = decode_row(fast, 64, 4096, 7, m)
    ragged = decode_row(Ragged(), 64, 4096, 7, m)
    routing = ("matches" if fast.max_group <= limit else "should be lowered to") + f" {limit}"
    out.append(f"hfp_decode_fast stays memory-bound up to GQA group {limit}; from {limit + 1} the "
               f"{max(over, key=over.get)} pipe binds (shared-memory reads grow with the group: every row re-reads "
               f"each K/V chunk, plus log2(bdx) shuffles per key and row). At 64x4k GQA 7 it would predict "
               f"{at_7.fraction:.0%} against hfp_ragged's {ragged.fraction:.0%}; FAST_DECODE_MAX_GROUP = "
               f"{fast.max_group} {routing}.")
    batch1 = [r for r in decode if r.batch == 1 and r.design == fast.name]
    out.append("Batch 1 x 4k is latency-bound: " + ", ".join(f"GQA {r.group} {r.time_us:.1f} us ({r.fraction:.0%})"
                                                             for r in batch1)
               + f" with {m.launch_us:g} us per launch and one {m.latency_ns:.0f} ns pipeline fill per wave.")
    for r in extend:
        if r.verdict:
            out.append(f"hfp_ragged extend at {r.tokens} tokens: at most {r.tflops:.0f} TFLOPS, {r.fraction_of_baseline:.0%} "
                       f"of the assumed SDPA-flash {r.baseline_tflops:.0f}: the model {r.verdict.lower()} the 50% target "
                       f"({r.bound}-bound).")
    if extend:
        c = extend[-1].clocks
        out.append(f"Extend is an upper bound: pipes shared {c['shared']}, L2 {c['l2']}, tensor {c['tensor']} clocks per "
                   f"tile; all 4 warps re-read the whole K/V tile from shared memory and 64-row CTAs re-read K/V "
                   f"from L2 twice as often as 128-row ones. Two 16-row m-tiles per warp (128 rows per CTA, as "
                   f"FlashAttention-2 at head dim 128) would halve both.")
    return [f"{s} ({LABEL})" for s in out]


def markdown(decode: list[DecodeRow], extend: list[ExtendRow], m: Machine) -> str:
    lines = [f"### Static roofline ({LABEL})", "",
             (f"{m.name}, copy bandwidth {m.copy_bw / 1e12:.1f} TB/s, latency {m.latency_ns:.0f} ns, "
              f"{m.clock_ghz} GHz; Llama-3-8B heads (32 q, d128, bf16). Model: `bench/roofline.py`."), "",
             "| design | batch x context | GQA | bound | predicted fraction of copy bandwidth | target |",
             "|---|---|---|---|---|---|"]
    for r in decode:    # the kernel each group goes to (decode_fast up to 4), and ragged from group 8
        if r.design not in ("hfp_decode_fast", "hfp_ragged") or (r.design == "hfp_ragged" and r.group < 8):
            continue
        target = f"{r.target:.0%}: {r.verdict}" if r.target is not None else ""
        lines.append(f"| {r.design} | {r.batch}x{r.context // 1024}k | {r.group} | {r.bound} | {r.fraction:.0%} | {target} |")
    lines += ["", "| design | tokens (causal) | bound | predicted TFLOPS | of assumed SDPA-flash | target 50% |",
              "|---|---|---|---|---|---|"]
    for r in extend:
        lines.append(f"| {r.design} | {r.tokens} | {r.bound} | {r.tflops:.0f} | {r.fraction_of_baseline:.0%} | {r.verdict} |")
    lines += ["", *(f"- {s}" for s in findings(decode, extend, m))]
    return "\n".join(lines)
