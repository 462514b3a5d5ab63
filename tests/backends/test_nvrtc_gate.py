"""The production compiler, with no GPU: every registry kernel compiles with NVRTC 12.4, 12.9 and 13.0
for sm_80 and sm_90, the cubins' entry points equal the registry, and the decode kernels do not spill.

The NVRTC wheels are pip-installed on first run (see nvrtc_gate.py); failing to install them fails
the test. Offline, opt out explicitly with HF_PAGED_SKIP_NVRTC=1 (the test then reports a skip).
`pytest -s` prints the register table; it is also written to nvrtc_report.txt in the NVRTC cache folder.
"""
from __future__ import annotations

import os

import pytest

import nvrtc_gate
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


def test_entries_equal_registry(gate):
    expected = {spec.name for spec in reg.all_kernels()}
    for toolkit in nvrtc_gate.TOOLKITS:
        for arch in nvrtc_gate.ARCHS:
            compiled = set().union(*(entries for (t, a, _), entries in gate.entries.items()
                                     if t == toolkit and a == arch))
            assert compiled == expected, (toolkit, arch, compiled ^ expected)


def test_every_kernel_reported_and_decode_never_spills(gate):
    for toolkit in nvrtc_gate.TOOLKITS:
        for arch in nvrtc_gate.ARCHS:
            for spec in reg.all_kernels():
                usage = gate.usage[(toolkit, arch, spec.name)]
                assert usage.registers <= 255
                if spec.name.startswith("hfp_decode"):
                    assert usage.spill_stores == usage.spill_loads == usage.stack == 0, (toolkit, arch, spec, usage)


def test_shared_memory_fits():
    """The largest dynamic shared memory the backend asks for, plus static, fits sm_80's 163 KiB."""
    for spec in reg.all_kernels():
        if spec.head_dim:
            for elem in (2, 4):
                assert reg.attention_smem_bytes(spec.head_dim, elem, reg.MAX_ROWS) <= 163 * 1024
