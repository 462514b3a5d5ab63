"""Fixtures of the engine tests."""
from __future__ import annotations

import pytest

from hf_paged.engine.cpu_ops import load_fused_ops


@pytest.fixture(scope="module")
def ops():
    """torch.ops.hf_paged_fused, built on first use; the test is skipped where it cannot be built."""
    try:
        return load_fused_ops()
    except RuntimeError as err:         # no C++ compiler on this machine
        pytest.skip(f"fused CPU ops cannot be built here: {err}")


@pytest.fixture(scope="module")
def fp32_kernel(ops):
    """The fused ops where their linear kernel takes float32 weights (a build with hardware FMA: every native
    build on x86 with AVX2 or aarch64); skipped for a plain x86-64 build, whose float32 linears are oneDNN's."""
    if not ops.linear_hardware_fma():
        pytest.skip("this build's linear kernel has no hardware FMA: float32 linears go through oneDNN")
    return ops
