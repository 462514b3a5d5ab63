"""The SASS gate's machinery (sass_gate.py), proven on kernels whose SASS is known: a synthetic module
with cp.async + ldmatrix + mma.sync inline PTX (positive control: LDGSTS, LDSM, HMMA found, rules
pass), a plain kernel and a local-memory kernel (negative controls: the rules fail them), the registry's
fp32 decode kernel (no cp.async: the pipelined-decode rule would fail it), and the occupancy arithmetic
by hand. The gate on the registry itself runs in test_nvrtc_gate.py (it shares that compile).

The compiler tests need the NVRTC and cuobjdump wheels (pip-installed on first run, see
nvrtc_gate.py); HF_PAGED_SKIP_NVRTC=1 skips them explicitly.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import nvrtc_gate
import pytest
import sass_gate

from hf_paged.backends import kernel_registry as reg

SASS_TEXT = """
\tcode for sm_90
\t\tFunction : k_one
\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                       /* 0x00000a00ff017b82 */
                                                                                /* 0x000fe20000000800 */
        /*0010*/                   LDGSTS.E.BYPASS.LTC128B.128 [R3], desc[UR4][R4.64] ;
        /*0020*/              @!P0 LDS.128 R8, [R2] ;
        /*0030*/                   LDS.U16 R9, [R2+0x10] ;
        /*0040*/               @P1 HMMA.16816.F32.BF16 R12, R4, R8, R12 ;
        /*0050*/                   MUFU.EX2 R5, R5 ;
        /*0060*/                   LDG.E.128.CONSTANT R4, desc[UR6][R6.64] ;
        /*0070*/                   EXIT ;
\t\tFunction : k_two
        /*0000*/                   STL [R1], R2 ;
        /*0010*/              @!PT SHFL.BFLY PT, R3, R2, 0x1, 0x1f ;
        /*0020*/                   LDSM.16.MT88.4 R4, [R5] ;
"""


def test_count_opcodes():
    counts = sass_gate.count_opcodes(SASS_TEXT)
    assert set(counts) == {"k_one", "k_two"}
    one, two = counts["k_one"], counts["k_two"]
    assert (one["LDGSTS"], one["LDS"], one["LDS.128"], one["HMMA"], one["MUFU.EX2"], one["LDG.128"]) == (1, 2, 1, 1, 1, 1)
    assert one["LDGSTS.128"] == 1 and one["EXIT"] == 1 and one["STL"] == 0
    assert (two["STL"], two["SHFL"], two["LDSM"], two["LDGSTS"]) == (1, 1, 1, 0)


@pytest.mark.parametrize("arch, registers, smem, expected", [
    ("sm_80", 32, 0, 16),               # 1024 registers per warp: 16 warps per sub-partition; 64 warps max
    ("sm_80", 255, 0, 2),               # 8192 per warp (255 x 32 rounded to 256): 2 warps per sub-partition
    ("sm_90", 128, 80 * 1024, 2),       # registers allow 4; 82,944 B of 233,472: 2
    ("sm_80", 64, 33 * 1024, 4),        # 34 KiB with the reserved 1 KiB: 164 / 34 -> 4
    ("sm_90", 64, 33 * 1024, 6),        # 228 / 34 -> 6 (registers allow 8)
    ("sm_80", 40, 100 * 1024 + 1, 1),   # 101 KiB + 1 B -> 101 KiB + 128 B: 1
    ("sm_80", 32, 164 * 1024, 0),       # above sm_80's 163 KiB per CTA: cannot launch
])
def test_ctas_per_sm_by_hand(arch, registers, smem, expected):
    assert sass_gate.ctas_per_sm(arch, registers, smem) == expected


def test_rules_name_the_new_kernels():
    def rules(name):
        return [r.why for r in sass_gate.RULES if r.matches(name)]

    local, fast, ragged, quantised, quantised_extend, decode = (r.why for r in sass_gate.RULES)
    assert rules("hfp_decode_fast_bf16_d128") == [local, fast, decode]
    assert rules("hfp_decode_fast_fp8e4m3_f16_d64") == [local, fast, quantised, decode]
    assert rules("hfp_decode_fast_int4_bf16_d80") == [local, fast, quantised, decode]
    assert rules("hfp_decode_fast_int8_f32_d128") == [local, decode]       # no such kernel; no cp.async asked
    assert rules("hfp_decode_fast_f32_d128") == [local, decode]          # no cp.async demanded of fp32
    assert rules("hfp_ragged_f16_d256") == [local, ragged]
    assert rules("hfp_ragged_int8_bf16_d128") == [local, ragged, quantised_extend]
    assert rules("hfp_ragged_fp8e5m2_f16_d80") == [local, ragged, quantised_extend]
    assert rules("hfp_extend_int8_bf16_d128") == []          # attention.cu's quantised extend: no rule
    assert rules("hfp_decode_bf16_d128") == [decode]
    assert rules("hfp_extend_bf16_d128") == [] and rules("hfp_copy_blocks") == []


def test_dynamic_smem_as_the_backend_sizes_launches():
    assert sass_gate.dynamic_smem("hfp_copy_blocks", 4) == 0
    assert sass_gate.dynamic_smem("hfp_decode_bf16_d128", 4) == reg.attention_smem_bytes(128, 2, 4)
    assert sass_gate.dynamic_smem("hfp_extend_f32_d128", 4) == reg.attention_smem_bytes(128, 4, 32)   # 8 tokens x 4
    if hasattr(reg, "kernel_smem_bytes") and hasattr(reg, "uses_decode_fast"):
        ragged, fast = reg.ragged_kernel("bf16", 128), reg.decode_fast_kernel("bf16", 128)
        assert sass_gate.dynamic_smem(ragged.name, 16) == reg.kernel_smem_bytes(ragged, 16)
        assert sass_gate.dynamic_smem(fast.name, 4) == reg.kernel_smem_bytes(fast, 4)
        assert sass_gate.dynamic_smem(fast.name, 16) is None          # group 16 decodes on the ragged kernel


# --- with the compiler and the disassembler -----------------------------------------------------

CONTROL_SOURCE = r"""
// cp.async + ldmatrix + mma.sync: what the new kernels' inner loops are built from
extern "C" __global__ void ctl_tensor(const unsigned short* __restrict__ g, float* out) {
    __shared__ __align__(16) unsigned short tile[16 * 16];
    const unsigned dst = (unsigned)__cvta_generic_to_shared(tile + threadIdx.x * 8);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(g + threadIdx.x * 8));
    asm volatile("cp.async.commit_group;\n" ::);
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncwarp();
    unsigned a[4];
    const unsigned row = (unsigned)__cvta_generic_to_shared(tile + (threadIdx.x % 16) * 16 + (threadIdx.x / 16) * 8);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(row));
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(a[0]), "r"(a[2]));
    for (int i = 0; i < 4; ++i) out[threadIdx.x * 4 + i] = d[i];
}

// plain 16-byte loads: no cp.async, no tensor cores
extern "C" __global__ void ctl_plain(const uint4* __restrict__ g, uint4* out) {
    out[threadIdx.x] = g[threadIdx.x];
}

// a dynamically indexed array lives in local memory: STL/LDL and a stack frame
extern "C" __global__ void ctl_local(float* out, int n) {
    float buf[256];
    for (int i = 0; i < 256; ++i) buf[i] = out[i * n + threadIdx.x];
    out[threadIdx.x] = buf[n & 255] + buf[(n >> 8) & 255];
}
"""

needs_tools = pytest.mark.skipif(os.environ.get("HF_PAGED_SKIP_NVRTC") == "1",
                                 reason="HF_PAGED_SKIP_NVRTC=1: NVRTC/SASS gate not run")


def compile_controls(toolkit: str, arch: str):
    """(GateResult, SassResult) of CONTROL_SOURCE built with the production options."""
    nvrtc_gate.install(toolkit)
    cubin, log = nvrtc_gate.isolated(nvrtc_gate.compile_source, toolkit, arch, CONTROL_SOURCE)
    gate = nvrtc_gate.GateResult()
    gate.usage = {(toolkit, arch, k): u for k, u in nvrtc_gate.usage_from_log(log).items()}
    sass = sass_gate.SassResult({(toolkit, arch, k): c for k, c in sass_gate.disassemble(cubin).items()})
    return gate, sass


def rule_for(kernel: str, template: sass_gate.Rule) -> sass_gate.Rule:
    return dataclasses.replace(template, pattern=kernel)


FAST, RAGGED, QUANTISED, QUANTISED_EXTEND = sass_gate.RULES[1:5]
NO_LOCAL = dataclasses.replace(sass_gate.RULES[0], min_ctas=0)


@needs_tools
@pytest.mark.parametrize("toolkit", list(nvrtc_gate.TOOLKITS))
@pytest.mark.parametrize("arch", nvrtc_gate.ARCHS)
def test_controls(toolkit, arch):
    gate, sass = compile_controls(toolkit, arch)
    ops = {k[2]: c for k, c in sass.opcodes.items()}
    print(f"\n{toolkit} {arch}: " + "; ".join(f"{k}: LDGSTS {c['LDGSTS']} LDSM {c['LDSM']} HMMA {c['HMMA']} "
                                               f"LDL/STL {c['LDL']}/{c['STL']}" for k, c in sorted(ops.items())))
    assert ops["ctl_tensor"]["LDGSTS"] >= 1 and ops["ctl_tensor"]["LDSM"] >= 1 and ops["ctl_tensor"]["HMMA"] >= 1
    assert ops["ctl_plain"]["LDG.128"] >= 1

    # positive: the tensor kernel passes the ragged, pipelined-decode and no-local-memory rules
    rules = [rule_for("ctl_tensor", r) for r in (RAGGED, FAST, NO_LOCAL)]
    assert sass_gate.check(gate, sass, rules)[0] == []
    # negative: the plain kernel fails both opcode rules; the local-memory kernel fails no-local
    violations, _ = sass_gate.check(gate, sass, [rule_for("ctl_plain", r) for r in (RAGGED, FAST)])
    assert len(violations) == 3 and all("ctl_plain" in v for v in violations)
    assert any("HMMA/HGMMA" in v for v in violations) and sum("LDGSTS" in v for v in violations) == 2
    violations, _ = sass_gate.check(gate, sass, [rule_for("ctl_local", NO_LOCAL)])
    assert any("STL in the SASS" in v for v in violations), violations
    assert any("stack" in v for v in violations), violations


@needs_tools
def test_occupancy_rule_fails_a_fat_kernel():
    gate, sass = compile_controls("13.0", "sm_80")
    rule = dataclasses.replace(sass_gate.RULES[0], pattern="ctl_tensor", min_ctas=2, archs=("sm_80", "sm_90"))
    fits = sass_gate.check(gate, sass, [rule], smem_of=lambda kernel, group: 40 * 1024)
    assert fits[0] == [], fits
    violations, _ = sass_gate.check(gate, sass, [rule], smem_of=lambda kernel, group: 100 * 1024)
    assert len(violations) == len(sass_gate.BENCH_GROUPS) and all("1 CTAs/SM < 2" in v for v in violations)
    _, notes = sass_gate.check(gate, sass, [rule], smem_of=lambda kernel, group: None)
    assert notes == [n for n in notes if n.startswith(f"{len(sass_gate.BENCH_GROUPS)} occupancy rows not computed")]
    assert len(notes) == 1


@needs_tools
def test_registry_fp32_decode_has_no_cp_async():
    """Negative control on production code: the fp32 decode kernel (which stays on the simple path)
    has no LDGSTS, so the pipelined-decode rule applied to it fails."""
    spec = reg.decode_kernel("f32", 64)
    gate = nvrtc_gate.GateResult()
    nvrtc_gate.install("13.0")
    _, cubin, log = nvrtc_gate.isolated(nvrtc_gate.compile_job, ("13.0", "sm_90", spec.module))
    gate.usage = {("13.0", "sm_90", k): u for k, u in nvrtc_gate.usage_from_log(log).items()}
    sass = sass_gate.SassResult({("13.0", "sm_90", k): c for k, c in sass_gate.disassemble(cubin).items()})
    assert sass.opcodes[("13.0", "sm_90", spec.name)]["LDGSTS"] == 0
    violations, _ = sass_gate.check(gate, sass, [rule_for(spec.name, FAST)])
    assert violations == [f"13.0/sm_90/{spec.name}: no LDGSTS in the SASS ({FAST.why})"]


# cp_async_16's PTX (cuda/common.cuh) and a synchronous 16-byte copy in its place: what the negative control builds
CP_ASYNC_PTX = ('asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n" :: "r"(addr), "l"(global), '
                '"r"(fill ? 16 : 0));')
SYNC_COPY = ("(void)addr; *reinterpret_cast<uint4*>(smem) = fill ? *reinterpret_cast<const uint4*>(global) "
             ": make_uint4(0u, 0u, 0u, 0u);")


# mma_16816's two PTX strings (cuda/common.cuh) turned into PTX comments: the kernel then has no HMMA
MMA_PTX = 'asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.'
NO_MMA = 'asm volatile("// no mma (negative control): '


@needs_tools
def test_quantised_fast_kernels_stage_by_cp_async_and_extend_on_tensor_cores():
    """The quantised fast module as production builds it (int4 at head dim 128: 13.0, sm_90; every format
    and head dim are checked by the registry gate in test_nvrtc_gate.py) passes every rule that names its
    kernels: LDGSTS in the decode, HMMA and LDGSTS in the extend, no local memory, >= 2 CTAs/SM. Negative
    control: the same module with cp_async_16's PTX replaced by a synchronous copy and mma_16816's by a
    PTX comment has neither, and fails exactly the quantised decode and extend rules' opcode demands. The
    two compiles run side by side (~30-60 s each on a loaded 2-core machine)."""
    job = ("13.0", "sm_90", (reg.FAST_SOURCE, 128, "int4"))
    nvrtc_gate.install("13.0")
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        real = pool.submit(nvrtc_gate.compile_job, job)
        edited = pool.submit(nvrtc_gate.compile_edited, job, CP_ASYNC_PTX, SYNC_COPY, (MMA_PTX, NO_MMA))
        results = {"real": real.result(), "edited": edited.result()}
    decode = {reg.decode_fast_kernel(t, 128, "int4").name for t in reg.FAST_DTYPE_TAGS}
    extend = {reg.ragged_kernel(t, 128, "int4").name for t in reg.FAST_DTYPE_TAGS}
    checked = {}
    for name, (_, cubin, log) in results.items():
        gate = nvrtc_gate.GateResult()
        gate.usage = {("13.0", "sm_90", k): u for k, u in nvrtc_gate.usage_from_log(log).items()}
        sass = sass_gate.SassResult({("13.0", "sm_90", k): c for k, c in sass_gate.disassemble(cubin).items()})
        assert decode | extend <= {k[2] for k in sass.opcodes}, (name, sorted(sass.opcodes))
        rules = [r for r in sass_gate.RULES if any(r.matches(k) for k in decode | extend)]
        checked[name] = (sass_gate.check(gate, sass, rules)[0],
                         {k: sass.opcodes[("13.0", "sm_90", k)] for k in decode | extend})
    violations, ops = checked["real"]
    assert violations == [] and all(ops[k]["LDGSTS"] > 0 for k in decode | extend), (violations, ops)
    assert all(ops[k]["HMMA"] + ops[k]["HGMMA"] > 0 for k in extend), ops
    violations, ops = checked["edited"]
    assert all(c["LDGSTS"] == 0 and c["HMMA"] == c["HGMMA"] == 0 and c["LDS"] > 0 for c in ops.values()), ops
    want = [f"13.0/sm_90/{k}: no LDGSTS in the SASS ({QUANTISED.why})" for k in decode]
    want += [f"13.0/sm_90/{k}: no {ops_} in the SASS ({QUANTISED_EXTEND.why})" for k in extend
             for ops_ in ("HMMA/HGMMA", "LDGSTS")]
    got = [v for v in violations if QUANTISED.why in v or QUANTISED_EXTEND.why in v]
    assert sorted(got) == sorted(want), violations
