"""The barrier mutation check (``mutate_barriers.py``) as a test: CI fails if a deleted ``__syncthreads``
goes unnoticed by the kernel tests.

``mutate_barriers.main()`` deletes each ``__syncthreads();`` of ``cuda/attention.cu`` in turn, rebuilds
the CPU shim from the mutated copy and runs the decode tests (its default selection, ``decode and not
nvrtc and not quantised``: the four barriers sit in ``attend_tiles``, which decode and extend, model-dtype
and quantised, share) in a subprocess; it
returns non-zero if some deletion leaves every test passing. A control run of the same selection on the
unmodified sources must pass first, or "every deletion caught" would only mean "the tests are broken".

Runtime: one shim build (~30 s on 2 cores) plus the decode tests (~15 s) per deletion, about 3-4 min
on a quiet 2-core machine the first time; the mutated builds are cached by source hash under
``$HF_PAGED_SHIM_CACHE`` (default /tmp/hf_paged_shim_<uid>), so later runs take about 1-1.5 min.
Needs g++, as every shim test does; without it this test fails, it is not skipped.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import mutate_barriers

SELECTION = mutate_barriers.SELECTION      # main's default: the model-dtype decode tests
# (the names of the tests below must not match SELECTION, or the check would run itself recursively)
# The subprocesses' torch (the reference attention) gets one thread: the kernels run in the shim on one
# thread anyway, and two torch threads spin-wait badly on a loaded 2-core machine.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def test_control_selection_passes_unmutated():
    """The control: the selection the mutation check runs passes on the real sources."""
    assert shutil.which("g++"), "g++ is needed to build the CPU shim for the kernel tests"
    env = {k: v for k, v in os.environ.items() if k != "HF_PAGED_SHIM_SOURCES"}
    env.update(ONE_THREAD)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(mutate_barriers.HERE), "-q", "-p", "no:cacheprovider", "-k", SELECTION,
         "-o", "addopts="], capture_output=True, text=True, env=env)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, f"the decode tests fail without any mutation:\n{tail}"
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 10, f"too few decode tests ran:\n{tail}"


def test_every_deleted_barrier_is_caught(capsys, monkeypatch):
    assert shutil.which("g++"), "g++ is needed to build the CPU shim for the kernel tests"
    sites = len(mutate_barriers.BARRIER.findall((mutate_barriers.CUDA / "attention.cu").read_text()))
    assert sites >= 1, "no __syncthreads(); found in cuda/attention.cu: the mutation check would test nothing"
    for name, value in ONE_THREAD.items():
        monkeypatch.setenv(name, value)          # inherited by main's pytest subprocesses
    rc = mutate_barriers.main(SELECTION)
    report = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + report)
    assert rc == 0, f"a deleted barrier went unnoticed by the decode tests:\n{report}"
    assert len(re.findall(r"^deletion \d+/(\d+):", report, re.M)) == sites, report
    assert "every deletion caught" in report, report
    # each deletion was caught by failing tests (not by a build or collection error)
    summaries = re.findall(r"^deletion \d+/\d+: .*\n  (.*)$", report, re.M)
    assert len(summaries) == sites and all(re.search(r"\d+ failed", s) for s in summaries), report
