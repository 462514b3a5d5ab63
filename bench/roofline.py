"""Static roofline of the attention kernels at the benchmark shapes of issue 11: PREDICTED, NOT MEASURED.

    python -m bench roofline [--json out.json] [--copy-bw 4.2e12] [--latency-ns 700] ...   (prints the markdown;
    every row, with each pipe's clocks, goes to the JSON; the findings and markdown: bench/roofline_report.py)

Per SM of an H200 (sm_90), every inner loop is reduced to what it costs per 32 KB of K+V (64 keys at
head dim 128, bf16): shared-memory wavefronts, shuffles, FP32 / integer / MUFU lane operations,
tensor-core FLOPs and issued warp instructions. Each pipe's clocks are compared with the clocks HBM
needs to deliver those 32 KB at the copy bandwidth; the predicted fraction of copy bandwidth is
``min(1, memory / max(memory, every pipe))``, further limited by Little's law (bytes in flight per SM
against bandwidth per SM x latency), wave tails, launch gaps and split-K merge traffic. Extend
(prefill) is predicted in TFLOPS the same way per 64x64 tile, scheduled over the SMs.

The instruction counts are inputs, one dataclass per kernel design (``DecodeFast``, ``Ragged``): the
designs the lead is implementing, counted from their descriptions, not from SASS. The machine numbers
(``Machine``) come from the CUDA C++ Programming Guide's throughput table (results per clock per SM,
compute capability 9.0: FP32 add/mul/FMA 128, 32-bit integer/logic/shift 64, MUFU exp2 16, warp
shuffle 32), its shared-memory chapter (32 banks x 4 bytes: one 128-byte wavefront per clock; a
warp's LDS.128 = 4 wavefronts conflict-free, LDSM.x4 = 4, LDS.32 = 1) and NVIDIA's H200 datasheet
(132 SMs, HBM3e 4.8 TB/s, boost ~1.98 GHz). Assumptions, each a parameter: copy bandwidth 4.2 TB/s
(copies typically measure 4.0-4.3), DRAM latency under load 700 ns, L2->SM bandwidth 6 TB/s,
mma.sync m16n8k16 bf16 with fp32 accumulation at 2048 FLOP/clk/SM on sm_90 (A100's per-SM rate,
312 TFLOPS / 108 SMs / 1.41 GHz; Hopper's full rate, 4096, needs wgmma, which mma.sync cannot use),
shuffles sharing the shared-memory crossbar (counted as wavefronts), and SDPA-flash at 335 TFLOPS
(FlashAttention-2 class on H100/H200, head dim 128, long sequences). Every pipe is assumed to overlap
perfectly with the others, so each prediction is an upper bound.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, replace

LABEL = "predicted, not measured"
TILE_BYTES = 32 * 1024          # the unit: 32 KB of K+V


@dataclass(frozen=True)
class Machine:
    """H200 SXM (sm_90). Rates are per clock per SM."""

    name: str = "H200 SXM (sm_90)"
    sms: int = 132
    clock_ghz: float = 1.98
    copy_bw: float = 4.2e12           # B/s a device-to-device copy reaches (nominal HBM3e: 4.8e12)
    latency_ns: float = 700.0         # DRAM latency under load (Little's law)
    l2_bw: float = 6.0e12             # L2 -> SMs, B/s (assumed; extend re-reads K/V from L2)
    issue: float = 4.0                # warp instructions (4 schedulers x 1)
    fp32: float = 128.0               # FFMA/FADD/FMUL lanes
    alu: float = 64.0                 # integer, logic, PRMT, conversions, FMNMX lanes
    mufu: float = 16.0                # ex2 lanes
    shfl: float = 32.0                # shuffle lanes (= 1 warp instruction)
    wavefronts: float = 1.0           # shared-memory wavefronts of 128 B
    mma_flop: float = 2048.0          # mma.sync m16n8k16 bf16/fp16, fp32 accumulate
    regs_per_sm: int = 65536
    smem_per_sm: int = 228 * 1024
    max_warps: int = 64
    launch_us: float = 1.0            # gap per dependent kernel launch, back to back
    sdpa_flash_tflops: float = 335.0  # the extend baseline (assumed)

    @property
    def clocks_per_s(self) -> float:
        return self.clock_ghz * 1e9

    def memory_clocks(self, nbytes: float = TILE_BYTES) -> float:
        """Clocks one SM waits for ``nbytes`` when all SMs share the copy bandwidth."""
        return nbytes / (self.copy_bw / self.sms / self.clocks_per_s)

    def bytes_in_flight_needed(self) -> float:
        """Little's law, per SM: bandwidth per SM x latency."""
        return self.copy_bw / self.sms * self.latency_ns * 1e-9

    def ctas_per_sm(self, threads: int, registers: int, smem: int) -> int:
        """Occupancy as tests/backends/sass_gate.ctas_per_sm (256-register warp granules, 4
        sub-partitions, 128-byte shared-memory granules plus 1 KiB reserved per CTA, 32 CTAs max)."""
        warps = -(-threads // 32)
        per_warp = -(-registers * 32 // 256) * 256
        by_regs = (self.regs_per_sm // 4 // per_warp) * 4 // warps
        by_smem = self.smem_per_sm // (-(-(smem + 1024) // 128) * 128)
        return min(32, self.max_warps // warps, by_regs, by_smem)


@dataclass
class Load:
    """The work of one SM per 32 KB of K+V (per 64-key x 64-row tile for extend), summed over warps."""

    wavefronts: float = 0.0     # shared-memory wavefronts: LDS/LDSM reads and cp.async writes
    shfl: float = 0.0           # shuffle lanes
    fp32: float = 0.0           # FP32 lanes
    alu: float = 0.0            # integer / conversion lanes
    mufu: float = 0.0           # MUFU lanes
    mma_flop: float = 0.0       # tensor-core FLOPs issued (padding included)
    warp_instructions: float = 0.0
    l2_bytes: float = TILE_BYTES

    def clocks(self, m: Machine) -> dict[str, float]:
        """Clocks of each pipe. Shuffles go through the shared-memory crossbar: counted there."""
        return {"shared": self.wavefronts / m.wavefronts + self.shfl / m.shfl, "fp32": self.fp32 / m.fp32,
                "alu": self.alu / m.alu, "mufu": self.mufu / m.mufu, "tensor": self.mma_flop / m.mma_flop,
                "issue": self.warp_instructions / m.issue,
                "l2": self.l2_bytes / (m.l2_bw / m.sms / m.clocks_per_s)}


@dataclass(frozen=True)
class Kernel:
    """What every design shares: head dim 128, 2-byte elements (bf16), 128 threads per CTA."""

    head_dim: int = 128
    elem_bytes: int = 2
    threads: int = 128

    def bytes_per_head_token(self) -> float:
        """Bytes one token of one KV head takes in the pool (keys or values; scales included)."""
        return self.head_dim * self.elem_bytes


@dataclass(frozen=True)
class DecodeFast(Kernel):
    """hfp_decode_fast (CUDA cores, G <= 4): 128 threads, one CTA per (sequence, KV head, split).
    head_dim split over ``bdx`` lanes (16 bytes each); the 128 / bdx slots are rows (one per query
    head) x key groups; K and V tiles of ``tile_keys`` keys by 16-byte cp.async into rings of
    ``stages`` K and ``stages`` V buffers (kernel_registry.DECODE_FAST_STAGES), key groups merged
    through shared memory. Counts per (key, query row), per lane of the row's bdx lanes."""

    name: str = "hfp_decode_fast"
    bdx: int = 16
    tile_keys: int = 32
    stages: int = 3              # per ring (K and V)
    registers: int = 111         # ptxas, NVRTC 13.0 sm_90 (tests/backends/sass_gate.py table)
    max_group: int = 4           # kernel_registry.FAST_DECODE_MAX_GROUP
    lds128: float = 2            # one 16-byte K chunk, one V chunk
    ffma: float = 16             # 8 for q.k, 8 for o += p v
    convert: float = 16          # bf16 -> fp32: one PRMT / shift / AND per element, K and V
    shfl: float = 4              # log2(bdx) butterfly of the dot product
    fadd: float = 4              # the butterfly's adds
    mufu: float = 1              # exp2 of the score, computed in every lane of the row
    other: float = 6             # running max, scale, p, bookkeeping (assumed)

    def smem_bytes(self, group: int) -> int:
        """K and V rings + the key-group merge (kernel_registry.decode_fast_smem_bytes)."""
        return 2 * self.stages * self.stage_bytes() + 4 * (self.threads // self.bdx) * (self.head_dim + 2)

    def stage_bytes(self) -> int:
        return self.tile_keys * self.bytes_per_head_token()

    def in_flight_stages(self) -> int:
        return 2 * self.stages - 1          # every buffer of both rings but the one being read

    def load(self, group: int) -> Load:
        pairs = TILE_BYTES / (2 * self.head_dim * self.elem_bytes) * group     # (key, row) pairs
        lanes = pairs * self.bdx
        copies = TILE_BYTES / 16                                               # cp.async of 16 B
        per_lane = self.lds128 + self.ffma + self.convert + self.shfl + self.fadd + self.mufu + self.other
        return Load(wavefronts=lanes * self.lds128 * 16 / 128 + TILE_BYTES / 128,
                    shfl=lanes * self.shfl, fp32=lanes * (self.ffma + self.fadd + self.other / 2),
                    alu=lanes * (self.convert + self.other / 2), mufu=lanes * self.mufu,
                    warp_instructions=lanes * per_lane / 32 + copies * 3 / 32)     # copy + 2 address ops


@dataclass(frozen=True)
class Ragged(Kernel):
    """hfp_ragged (tensor cores, mma.sync m16n8k16, fp32 accumulate, FlashAttention-2 style): 4 warps x
    16 query rows (query heads of the group x tokens); K/V tiles of 64 keys (head dim 128) by cp.async,
    double-buffered; K by ldmatrix.x4, V by ldmatrix.x4.trans, Q by ldmatrix from shared memory each
    tile. Counts per warp per 64-key tile at head dim 128. ``decode_split_keys``: at decode (rows <= 16)
    the 4 warps take a quarter of each tile each (merged at the end) instead of padding rows."""

    name: str = "hfp_ragged"
    warps: int = 4
    rows_per_warp: int = 16
    tile_keys: int = 64
    stages: int = 2
    registers: int = 183         # ptxas, NVRTC 13.0 sm_90 (tests/backends/sass_gate.py table)
    decode_split_keys: bool = False
    hmma: float = 128            # QK^T: 8 k-steps x 8 n-tiles; PV: 4 k-steps x 16 n-tiles
    ldsm_kv: float = 64          # x4: 32 for K, 32 (.trans) for V
    ldsm_q: float = 8
    mufu: float = 34             # per lane: exp2 of 32 scores, 2 rescale factors
    fp32: float = 168            # per lane: 32 scale-subtract, 32 max, 32 sum, 64 O rescale, 8 misc
    f2fp: float = 16             # per lane: P packed to bf16 pairs
    shfl: float = 8              # per lane: row max and row sum over the 4 lanes of a quad, 2 rows
    other: float = 48            # per lane: cp.async issue (16) and addressing, loop, barriers

    @property
    def name_variant(self) -> str:
        return self.name + (" (decode: warps split keys)" if self.decode_split_keys else "")

    def smem_bytes(self, group: int) -> int:
        """Q [64][D + 8], K and V [stages][keys][D + 8], 64 positions (kernel_registry.ragged_smem_bytes)."""
        rows = self.warps * self.rows_per_warp
        return (rows + 2 * self.stages * self.tile_keys) * (self.head_dim + 8) * self.elem_bytes + 4 * rows

    def stage_bytes(self) -> int:
        return 2 * self.tile_keys * self.head_dim * self.elem_bytes     # K and V of one tile

    def in_flight_stages(self) -> int:
        return self.stages - 1

    def load(self, group: int | None = None) -> Load:
        """Per CTA per tile (= 32 KB of K+V at head dim 128). group None: extend (64 full rows)."""
        split = group is not None and group <= self.rows_per_warp and self.decode_split_keys
        f = 1 / self.warps if split else 1.0           # each warp's share of the tile's keys
        per_warp_lanes = 32
        hmma = self.hmma * f
        ldsm = self.ldsm_kv * f + self.ldsm_q
        scores = self.mufu - 2
        mufu = scores * f + 2
        fp32 = (self.fp32 - 64 - 8) * f + 64 + 8       # the O rescale does not shrink with the keys
        f2fp = self.f2fp * f
        per_warp = hmma + ldsm + mufu + fp32 + f2fp + self.shfl + self.other
        return Load(wavefronts=self.warps * ldsm * 4 + TILE_BYTES / 128, shfl=self.warps * self.shfl * per_warp_lanes,
                    fp32=self.warps * fp32 * per_warp_lanes, alu=self.warps * f2fp * per_warp_lanes,
                    mufu=self.warps * mufu * per_warp_lanes, mma_flop=self.warps * hmma * 16 * 8 * 16 * 2,
                    warp_instructions=self.warps * per_warp)


# --- decode -------------------------------------------------------------------------------------------

Q_HEADS, HEAD_DIM, ELEM = 32, 128, 2                     # Llama-3-8B, bf16
DECODE_SHAPES = ((1, 4096), (16, 4096), (64, 4096), (256, 2048))
GROUPS = (1, 4, 8, 16)
DECODE_TARGETS = {((64, 4096), 4): 0.80, ((64, 4096), 16): 0.60}


@dataclass
class DecodeRow:
    design: str
    batch: int
    context: int
    group: int
    ctas: int
    splits: int
    resident: float             # CTAs per SM, averaged over SMs (capped by occupancy)
    in_flight_kb: float
    needed_kb: float
    clocks: dict                # pipe -> clocks per 32 KB, "memory" included
    bound: str
    steady: float               # fraction of copy bandwidth in steady state
    time_us: float
    fraction: float             # of copy bandwidth, end to end (launches, fill, tail, merge)
    target: float | None = None
    label: str = LABEL

    @property
    def verdict(self) -> str:
        if self.target is None:
            return ""
        return "meets" if self.fraction >= self.target else "MISSES"


def decode_row(design, batch: int, context: int, group: int, m: Machine) -> DecodeRow:
    kv_heads = Q_HEADS // group
    base = batch * kv_heads
    tile = design.tile_keys
    splits = max(1, -(-2 * m.sms // base))                 # >= 2 CTAs per SM, as the plan sizes split-K
    splits = min(splits, -(-context // tile))
    ctas = base * splits
    occupancy = m.ctas_per_sm(design.threads, design.registers, design.smem_bytes(group))
    resident = min(occupancy, ctas / m.sms)
    in_flight = resident * design.in_flight_stages() * design.stage_bytes()
    needed = m.bytes_in_flight_needed()
    clocks = {"memory": m.memory_clocks(), **design.load(group).clocks(m)}
    bound = max(clocks, key=clocks.get)
    steady = min(clocks["memory"] / clocks[bound], in_flight / needed, 1.0)
    if in_flight / needed < clocks["memory"] / clocks[bound]:
        bound = "in flight"
    kv_bytes = batch * kv_heads * context * design.bytes_per_head_token() * 2
    merge_bytes = 2 * batch * Q_HEADS * splits * (HEAD_DIM + 1) * 4 if splits > 1 else 0
    tail = (ctas / m.sms) / math.ceil(ctas / m.sms)         # SMs holding one CTA more than average
    waves = math.ceil(ctas / (m.sms * occupancy))
    time_s = ((kv_bytes + merge_bytes) / (m.copy_bw * steady * tail)
              + (2 if splits > 1 else 1) * m.launch_us * 1e-6 + waves * m.latency_ns * 1e-9)
    fraction = kv_bytes / time_s / m.copy_bw
    return DecodeRow(getattr(design, "name_variant", design.name), batch, context, group, ctas, splits,
                     round(resident, 2), in_flight / 1024, needed / 1024,
                     {k: round(v) for k, v in clocks.items()}, bound, steady, time_s * 1e6, fraction,
                     DECODE_TARGETS.get(((batch, context), group)))


def decode_designs() -> list:
    return [DecodeFast(), Ragged(), Ragged(decode_split_keys=True)]


def decode_table(m: Machine) -> list[DecodeRow]:
    rows = []
    for design in decode_designs():
        for group in GROUPS:
            if group > getattr(design, "max_group", 64):
                continue
            rows += [decode_row(design, b, ctx, group, m) for b, ctx in DECODE_SHAPES]
    return rows


def memory_bound_limit(design: DecodeFast, m: Machine, upto: int = 32) -> int:
    """The largest group for which every pipe of ``design`` is at or under the memory clocks."""
    best = 0
    for group in range(1, upto + 1):
        if max(design.load(group).clocks(m).values()) <= m.memory_clocks():
            best = group
    return best


# --- extend -------------------------------------------------------------------------------------------

EXTEND_TOKENS = (512, 1024, 2048, 4096, 8192)
EXTEND_GROUP = 4                                         # Llama-3-8B: 32 query heads, 8 KV heads


@dataclass
class ExtendRow:
    design: str
    tokens: int
    ctas: int
    resident: int
    clocks: dict                # pipe -> clocks per 64-row x 64-key tile
    bound: str
    tflops: float               # causal FLOPs (4 D per visible query-key pair) / time
    baseline_tflops: float
    fraction_of_baseline: float
    verdict: str
    label: str = LABEL


def extend_row(design: Ragged, tokens: int, m: Machine) -> ExtendRow:
    """One causal sequence of ``tokens`` (query = key length), Llama-3-8B heads. Each CTA takes 64 rows
    (16 tokens x 4 heads) of one KV head and walks the 64-key tiles its last token sees; CTAs are
    placed longest first on the least-loaded SM; an SM runs at full pipe rate only with >= 2 CTAs
    (a lone CTA: 4 warps, one per scheduler, is charged double)."""
    kv_heads = Q_HEADS // EXTEND_GROUP
    rows = design.warps * design.rows_per_warp
    tokens_per_cta = rows // EXTEND_GROUP
    clocks = design.load(None).clocks(m)
    bound = max(clocks, key=clocks.get)
    tile_clk = clocks[bound]
    ctas = []
    for start in range(0, tokens, tokens_per_cta):
        tiles = -(-(start + tokens_per_cta) // design.tile_keys)
        ctas += [tiles] * kv_heads
    ctas.sort(reverse=True)
    load = [0.0] * m.sms
    longest = [0.0] * m.sms
    for tiles in ctas:
        i = min(range(m.sms), key=load.__getitem__)
        load[i] += tiles
        longest[i] = max(longest[i], tiles)
    fill = m.latency_ns * 1e-9 * m.clocks_per_s
    sm_clocks = max(max(l * tile_clk, 2 * lo * tile_clk) + fill for l, lo in zip(load, longest))
    time_s = sm_clocks / m.clocks_per_s + m.launch_us * 1e-6
    flops = 4 * HEAD_DIM * Q_HEADS * tokens * (tokens + 1) / 2
    tflops = flops / time_s / 1e12
    fraction = tflops / m.sdpa_flash_tflops
    verdict = "" if tokens < 2048 else ("meets" if fraction >= 0.5 else "MISSES")
    resident = m.ctas_per_sm(design.threads, design.registers, design.smem_bytes(64))
    return ExtendRow(design.name, tokens, len(ctas), resident, {k: round(v) for k, v in clocks.items()}, bound,
                     tflops, m.sdpa_flash_tflops, fraction, verdict)


def main(argv=None, prog: str = "python -m bench roofline") -> dict:
    parser = argparse.ArgumentParser(prog=prog, description=f"Static roofline of the attention kernels ({LABEL}).")
    parser.add_argument("--json", help="write the rows here")
    for name, value in asdict(Machine()).items():
        if isinstance(value, float):
            parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=value)
    args = parser.parse_args(argv)
    from .roofline_quant import quant_decode_table, quant_extend_table
    from .roofline_report import findings, markdown
    m = replace(Machine(), **{k: getattr(args, k) for k, v in asdict(Machine()).items() if isinstance(v, float)})
    decode = decode_table(m)
    extend = [extend_row(Ragged(), n, m) for n in EXTEND_TOKENS]
    print(markdown(decode, extend, m))
    report = {"label": LABEL, "machine": asdict(m), "designs": [asdict(d) for d in decode_designs()],
              "decode": [asdict(r) | {"verdict": r.verdict} for r in decode], "extend": [asdict(r) for r in extend],
              "findings": findings(decode, extend, m), "markdown": markdown(decode, extend, m),
              "decode_quantised": [asdict(r) for r in quant_decode_table(m)],
              "extend_quantised": [asdict(r) for r in quant_extend_table(m)]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report
