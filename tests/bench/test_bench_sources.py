"""Every bench script parses: ``python -m bench fused-ops`` failed with an IndentationError for a day while
its tests, which import other modules, passed."""
from __future__ import annotations

from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_bench_module_parses(path):
    compile(path.read_text(), str(path), "exec")
