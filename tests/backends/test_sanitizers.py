"""The kernels under AddressSanitizer + UndefinedBehaviorSanitizer (the shim's fibers announce their
stack switches to ASan). Small shapes, one head dim; see sanitize_check.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _runtime(name: str) -> str | None:
    path = subprocess.run(["g++", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def _run_check(*args):
    # libstdc++ preloaded too, or ASan's __cxa_throw interceptor finds no real one (torch throws).
    env = {**os.environ, "LD_PRELOAD": f"{_runtime('libasan.so')} {_runtime('libstdc++.so')}",
           "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1", "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
    return subprocess.run([sys.executable, str(HERE / "sanitize_check.py"), "address,undefined", *args],
                          capture_output=True, text=True, env=env, timeout=600)


pytestmark = pytest.mark.skipif(_runtime("libasan.so") is None, reason="no libasan for g++")


def test_asan_ubsan_clean():
    proc = _run_check()
    assert proc.returncode == 0 and "sanitizer run clean" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert "runtime error" not in proc.stderr, proc.stderr[-6000:]


def test_asan_reports_a_read_past_the_pool():
    proc = _run_check("--out-of-bounds")
    assert proc.returncode != 0 and "heap-buffer-overflow" in proc.stderr and "attention.cu" in proc.stderr, \
        proc.stdout[-2000:] + proc.stderr[-4000:]
