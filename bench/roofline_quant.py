"""Static roofline of the quantised fast decode and extend (issue 24 item 5): PREDICTED, NOT MEASURED.

The kernel is ``hfp_decode_fast_<fmt>_<dtype>_d<D>`` (cuda/fast_quant.cuh, routed by CudaBackend for groups
up to 4; the counts below are inputs, as in bench/roofline.py): the pool's codes and bf16 scales staged by
16-byte cp.async in runs of 8 stored tokens into 3-stage K and V rings (``tile_keys``: the bf16 kernel's
code bytes per stage, kernel_registry.decode_fast_quant_keys), each lane dequantising its 8 elements of K
and V in registers once for every query row of the group (``dequant_once``; dequantising per row makes
G = 4 issue-bound and int8 / int4 slower than bf16 per token: set it False to see); the scale of an 8-bit
(token, head) is applied once to the score (keys) and to p (values); int4 dequantises every element as
``code * s + m`` (one FFMA) for keys and values alike. Registers and shared memory are the build's
(ptxas, NVRTC 13.0 sm_90: 168 registers for every format at head dim 128; rings plus a key-group merge
of [slots][4 heads][D + 2] fp32, kernel_registry.decode_fast_quant_smem_bytes).
Conversions counted per element, on sm_90 (assumed instruction choices: the build converts fp8 by integer
arithmetic in KvFormat<F>::decode, kv_quant.cuh, which may take more ALU than counted; the GPU check measures):
    fp8_e4m3  cvt.rn.f16x2.e4m3x2 per 2 elements + half -> float per element        ALU 1.5
    fp8_e5m2  PRMT per 2 elements (e5m2 is fp16's high byte) + half -> float          ALU 1.5
    int8      LOP3 (sign bias, 4 per word) + PRMT into 0x4B0000xx, then one FADD     ALU 1.25, FP32 1
    int4      SHF + LOP3 (nibble), convert, then one FFMA (code * s + m)             ALU 2,    FP32 1
The unit stays 32 KB of *stored* bytes (codes + scales), so a quantised tile holds more keys than a bf16
one: fewer bytes per token of context, more lane work per byte. ``time_per_token`` is the figure the
issue asks for: predicted decode time per token of context, to compare with bf16's.

Extend: ``RaggedQuant`` is ``hfp_ragged_<fmt>_<dtype>_d<D>`` (cuda/fast_quant_extend.cuh): Ragged's mma
loop unchanged, plus per 64-key tile one pass over its K and V (2 x 64 x D elements, once per CTA for its
64 rows) that reads the staged codes, dequantises (the same per-element ALU as decode, one FMUL/FFMA for
the scale, half an F2FP per element to pack) and writes the bf16 tiles (STS.128); raw codes and scales
arrive by cp.async (their bytes, not bf16's, cross L2); two barriers per tile (bf16: three), not modelled.
``quant_extend_table`` gives predicted TFLOPS per format beside bf16's at the extend shapes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .roofline import (DECODE_SHAPES, EXTEND_TOKENS, GROUPS, TILE_BYTES, DecodeFast, DecodeRow, ExtendRow, Load,
                       Machine, Ragged, decode_row, extend_row)


@dataclass(frozen=True)
class DecodeFastQuant(DecodeFast):
    """``DecodeFast`` reading ``bits``-bit codes and ``scales`` bf16 values per (token, head)
    (hf_paged/kv_formats.py). ``tile_keys`` doubles per halving of the bytes, keeping each stage near the
    bf16 kernel's 8 KB in flight (kernel_registry.decode_fast_quant_keys)."""

    name: str = "hfp_decode_fast_q"
    fmt: str = "fp8_e4m3"
    bits: int = 8
    scales: int = 1                  # bf16 values per (token, head): 1, or 2 * D / 16 for int4
    tile_keys: int = 64
    alu_per_elem: float = 1.5
    fp32_per_elem: float = 0.0
    scale_loads: float = 2           # per lane per (key, row): K and V scale (LDS.U16, broadcast)
    scale_fp32: float = 2            # per lane: score *= s_k, p *= s_v
    dequant_once: bool = True        # a lane serves all G rows of its key chunk: loads and converts once
    registers: int = 168             # ptxas, NVRTC 13.0 sm_90, every format at d128 (sass_gate table)

    def smem_bytes(self, group: int) -> int:
        """K and V rings + the merge [slots][max_group][D + 2] fp32 (registry decode_fast_quant_smem_bytes)."""
        merge = 4 * (self.threads // self.bdx) * self.max_group * (self.head_dim + 2)
        return 2 * self.stages * self.stage_bytes() + merge

    @property
    def name_variant(self) -> str:
        return f"{self.name} ({self.fmt})"

    def bytes_per_head_token(self) -> float:
        return self.head_dim * self.bits / 8 + 2 * self.scales

    def load(self, group: int) -> Load:
        pairs = TILE_BYTES / (2 * self.bytes_per_head_token()) * group       # (key, row) pairs
        lanes = pairs * self.bdx
        elems = 2 * self.head_dim / self.bdx                                 # K and V elements per lane
        copies = TILE_BYTES / 16
        share = 1 / group if self.dequant_once else 1.0       # per-key work spread over the G rows
        code_wavefronts = lanes * share * elems * self.bits / 8 / 128
        fp32 = self.ffma + self.fadd + self.other / 2 + share * elems * self.fp32_per_elem + self.scale_fp32
        alu = share * elems * self.alu_per_elem + self.other / 2
        lds = share * (2 + self.scale_loads)
        per_lane = lds + fp32 + alu + self.shfl + self.mufu
        return Load(wavefronts=code_wavefronts + lanes * share * self.scale_loads / 32 + TILE_BYTES / 128,
                    shfl=lanes * self.shfl, fp32=lanes * fp32, alu=lanes * alu, mufu=lanes * self.mufu,
                    warp_instructions=lanes * per_lane / 32 + copies * 3 / 32)


def quant_designs(head_dim: int = 128) -> list[DecodeFastQuant]:
    """One design per quantised format of hf_paged.kv_formats.FORMATS (nvfp4 is not on the fast path)."""
    eight = dict(bits=8, scales=1, tile_keys=64)
    return [DecodeFastQuant(fmt="fp8_e4m3", alu_per_elem=1.5, **eight),
            DecodeFastQuant(fmt="fp8_e5m2", alu_per_elem=1.5, **eight),
            DecodeFastQuant(fmt="int8", alu_per_elem=1.25, fp32_per_elem=1.0, **eight),
            DecodeFastQuant(fmt="int4", bits=4, scales=2 * head_dim // 16, tile_keys=128, alu_per_elem=2.0,
                            fp32_per_elem=1.0, scale_loads=4, scale_fp32=1 + head_dim // 16)]


def time_per_token(row: DecodeRow) -> float:
    """Predicted decode time per token of context, in ns (the whole batch's context)."""
    return row.time_us * 1e3 / (row.batch * row.context)


def quant_decode_table(m: Machine) -> list[DecodeRow]:
    """bf16 DecodeFast and every quantised design at the decode shapes, groups <= max_group."""
    rows = []
    for design in [DecodeFast(), *quant_designs()]:
        for group in GROUPS:
            if group <= design.max_group:
                rows += [decode_row(design, b, ctx, group, m) for b, ctx in DECODE_SHAPES]
    return rows


@dataclass(frozen=True)
class RaggedQuant(Ragged):
    """``Ragged`` over ``bits``-bit codes with ``scales`` bf16 values per (token, head): the dequantise pass
    per tile (module docstring). Per-element costs as the decode designs (``quant_designs``), plus the
    scale's multiply for 8-bit formats (applied per element here, where decode applies it per score)."""

    name: str = "hfp_ragged_q"
    fmt: str = "fp8_e4m3"
    bits: int = 8
    scales: int = 1
    alu_per_elem: float = 1.5
    fp32_per_elem: float = 1.0
    registers: int = 190         # ptxas, NVRTC 13.0 sm_90, int8 at d128 (int4: 181; sass_gate table)

    @property
    def name_variant(self) -> str:
        return f"{self.name} ({self.fmt})"

    def bytes_per_head_token(self) -> float:
        return self.head_dim * self.bits / 8 + 2 * self.scales

    def raw_bytes(self) -> float:
        """K and V codes + scales of one tile, as staged (and read from L2)."""
        return 2 * self.tile_keys * self.bytes_per_head_token()

    def smem_bytes(self, group: int) -> int:
        """Q, single K and V tiles [keys][D + 8], raw [2][K, V] (kernel_registry.ragged_quant_smem_bytes)."""
        rows = self.warps * self.rows_per_warp
        return int((rows + 2 * self.tile_keys) * (self.head_dim + 8) * self.elem_bytes + 2 * self.raw_bytes()
                   + 4 * rows)

    def load(self, group: int | None = None) -> Load:
        base = super().load(group)
        elems = 2 * self.tile_keys * self.head_dim            # K and V of the tile, once per CTA
        chunks = elems / 8                                    # one lane's 8 elements: 3 loads/stores + addressing
        alu = elems * (self.alu_per_elem + 0.5)               # decode + F2FP pack (2 per instruction)
        fp32 = elems * self.fp32_per_elem
        wavefronts = (base.wavefronts - TILE_BYTES / 128 + 2 * self.raw_bytes() / 128   # cp.async in, LDS out
                      + elems * self.elem_bytes / 128)                                    # STS.128 of the tiles
        return replace(base, wavefronts=wavefronts, alu=base.alu + alu, fp32=base.fp32 + fp32,
                       warp_instructions=base.warp_instructions + (alu + fp32) / 32 + chunks * 5 / 32,
                       l2_bytes=self.raw_bytes())


def quant_extend_designs(head_dim: int = 128) -> list[RaggedQuant]:
    """One extend design per format with kernels, the per-element costs of ``quant_designs``."""
    out = []
    for d in quant_designs(head_dim):
        fp32 = d.fp32_per_elem if d.bits == 4 else d.fp32_per_elem + 1.0    # 8-bit: + the scale's FMUL
        out.append(RaggedQuant(name=f"hfp_ragged_{d.fmt}", fmt=d.fmt, bits=d.bits, scales=d.scales,
                               alu_per_elem=d.alu_per_elem, fp32_per_elem=fp32,
                               registers=181 if d.bits == 4 else 190))
    return out


def quant_extend_table(m: Machine) -> list[ExtendRow]:
    """bf16 Ragged and every quantised extend design, one causal sequence per EXTEND_TOKENS, group 4."""
    return [extend_row(design, n, m) for design in [Ragged(), *quant_extend_designs()] for n in EXTEND_TOKENS]
