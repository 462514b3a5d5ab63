"""The production compiler, with no GPU: the registry kernels compile with NVRTC 12.4, 12.9 and 13.0
for sm_80 and sm_90 (every model-dtype and cache kernel on each pair; the quantised ones all on 13.0
sm_90 and a rotating module on each other pair, see nvrtc_gate.plan) with the options CuPy uses in
production (-ftz=true included), the cubins' entry points equal the registry, and the decode kernels,
model-dtype and quantised, do not spill. The same cubins then go through the SASS gate (sass_gate.py):
opcode counts per kernel, the RULES table (cp.async / mma.sync in the new kernels, no local memory,
>= 2 CTAs per SM at the benchmark shapes); its machinery is proven in test_sass_gate.py.

The NVRTC wheels are pip-installed on first run (see nvrtc_gate.py); failing to install them fails
the test. Offline, opt out explicitly with HF_PAGED_SKIP_NVRTC=1 (the test then reports a skip).
`pytest -s` prints the register table and the SASS table; they are also written to nvrtc_report.txt
and sass_report.txt in the NVRTC cache folder.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import nvrtc_gate
import pytest
import sass_gate

from hf_paged.backends import kernel_registry as reg


@pytest.fixture(scope="module")
def gate():
    if os.environ.get("HF_PAGED_SKIP_NVRTC") == "1":
        pytest.skip("HF_PAGED_SKIP_NVRTC=1: NVRTC compile gate not run")
    for name in nvrtc_gate.TOOLKITS:
        nvrtc_gate.install(name)
    result = nvrtc_gate.run_gate(jobs=max(2, os.cpu_count() or 2))
    table = nvrtc_gate.format_table(result)
    (nvrtc_gate.cache_root() / "nvrtc_report.txt").write_text(table + "\n")
    print("\n" + table)
    return result


@pytest.fixture(scope="module")
def sass(gate):
    result = sass_gate.run_sass(gate, jobs=max(2, os.cpu_count() or 2))
    (nvrtc_gate.cache_root() / "sass_report.txt").write_text(sass_gate.format_table(gate, result) + "\n")
    print("\n" + sass_gate.format_table(gate, result, kernels=sass_gate.default_rows))
    return result


def test_entries_equal_registry(gate):
    for (toolkit, arch, module), entries in gate.entries.items():
        expected = reg.module_kernel_names(module)
        assert entries == expected, (toolkit, arch, module, entries ^ expected)
    newest = set().union(*(e for (t, a, _), e in gate.entries.items() if (t, a) == nvrtc_gate.NEWEST))
    assert newest == {spec.name for spec in reg.all_kernels()}
    for toolkit in nvrtc_gate.TOOLKITS:
        for arch in nvrtc_gate.ARCHS:
            modules = {m for (t, a, m) in gate.entries if (t, a) == (toolkit, arch)}
            assert set(nvrtc_gate.units()) - modules <= set(reg.attention_modules()), (toolkit, arch)
            assert any(m[2] for m in modules) and any(not m[2] for m in modules), (toolkit, arch)


def test_every_kernel_reported_and_decode_never_spills(gate):
    for toolkit, arch, module in gate.entries:
        for name in reg.module_kernel_names(module):
            usage = gate.usage[(toolkit, arch, name)]
            assert usage.registers <= 255
            if name.startswith("hfp_decode"):
                assert usage.spill_stores == usage.spill_loads == usage.stack == 0, (toolkit, arch, name, usage)


def test_sass_rules(gate, sass):
    """Every kernel a rule of sass_gate.RULES names satisfies it (notes: rules that name no kernel
    yet, occupancy rows the registry cannot size yet)."""
    violations, notes = sass_gate.check(gate, sass)
    print("\n" + "\n".join(notes))
    assert violations == [], "\n".join(violations)


def test_model_dtype_modules_disassembled(gate, sass):
    for toolkit, arch, module in gate.entries:
        if module in reg.attention_modules() and not module[2]:
            for name in reg.module_kernel_names(module):
                assert (toolkit, arch, name) in sass.opcodes, (toolkit, arch, name)
                assert sum(sass.opcodes[(toolkit, arch, name)].values()) > 0


def test_shared_memory_fits():
    """The largest dynamic shared memory the backend asks for, plus static, fits sm_80's 163 KiB
    (quantised kernels stage tiles of the query's dtype: the same sizes)."""
    for spec in reg.all_kernels():
        if spec.head_dim:
            for elem in (2, 4):
                assert reg.attention_smem_bytes(spec.head_dim, elem, reg.MAX_ROWS) <= 163 * 1024


NVCC = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"


@pytest.mark.skipif(not os.path.exists(NVCC), reason="no nvcc (CUDA toolkit) on this machine")
def test_nvcc_sass_quantised_decode_never_spills(tmp_path):
    """The offline toolkit's ptxas on the quantised decode kernels that hold the most values in registers
    (int4: 32 codes per 16-byte load, head dim 256): no stack, no spill in the sm_90 SASS."""
    source = tmp_path / "attention.cu"
    source.write_text(reg.kernel_source(reg.ATTENTION_SOURCE))
    spec = reg.decode_kernel("f32", 256, "int4")
    proc = subprocess.run([NVCC, "-cubin", "-arch=sm_90", "-Xptxas", "-v", *spec.defines, str(source),
                           "-o", str(tmp_path / "attention.cubin")], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    usage = {m.group(1): m.groups() for m in nvrtc_gate._INFO.finditer(proc.stdout + proc.stderr)}
    decode = {name for name in reg.module_kernel_names(spec.module) if name.startswith("hfp_decode_int4")}
    assert decode and decode <= set(usage), (decode, sorted(usage))
    for name in decode:
        _, _, stack, stores, loads, regs, _ = usage[name]
        print(f"nvcc sm_90 {name}: {regs} registers, stack {stack}, spill {stores}/{loads}")
        assert int(stack) == int(stores) == int(loads) == 0, (name, usage[name])
