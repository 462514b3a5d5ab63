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
