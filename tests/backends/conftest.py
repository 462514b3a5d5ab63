"""Fixtures for the kernel tests: the shim libraries are built once per session (cached on disk)."""
from __future__ import annotations

import pytest

import harness


@pytest.fixture(scope="session")
def shim_libraries():
    return harness.build()
