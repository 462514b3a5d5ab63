"""Fixtures for the kernel tests: the shim libraries are built once per session (cached on disk)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402


@pytest.fixture(scope="session")
def shim_libraries():
    return harness.build()
