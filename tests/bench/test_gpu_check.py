"""The GPU check (``python -m bench gpu``, bench/gpu_check.py) cannot lose its one try: each section runs in its own process under its own deadline,
and its JSON line is appended as soon as it ends. Proved on the CPU with --dry-run's fake sections (one
raises, one hangs past its deadline, one aborts like a CUDA fault; the one after them still runs), and the
real sections report "skipped: no CUDA device" quickly where there is no GPU."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "bench", "gpu", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def lines(out_dir: Path) -> dict:
    records = [json.loads(line) for line in (out_dir / "gpu_check.jsonl").read_text().splitlines()]
    return {r["section"]: r for r in records}


def test_dry_run_isolates_every_section(tmp_path):
    started = time.monotonic()
    done = run("--dry-run", "--out", str(tmp_path))
    assert time.monotonic() - started < 20, "the 2 s deadline did not stop the hanging section"
    assert done.returncode == 1, done.stdout + done.stderr      # failures are reported in the exit status
    got = lines(tmp_path)
    assert {k: v["status"] for k, v in got.items()} == {
        "install": "skipped (--dry-run)", "fake_ok": "ok", "fake_fail": "failed", "fake_timeout": "timeout",
        "fake_crash": "failed", "fake_after": "ok"}
    assert "a planted failure" in got["fake_fail"]["error"]
    assert "SIGABRT" in got["fake_crash"]["error"]
    assert got["fake_timeout"]["seconds"] < 10
    for name in ("fake_fail", "fake_timeout", "fake_crash"):    # what a section recorded before it died stays
        assert got[name]["cases_total"] == 1 and got[name]["figures"]["cases"][0]["ok"] is True
    ok = got["fake_ok"]
    assert ok["figures"]["cases"][1] == {"case": "two", "ok": True, "value": 2.0}
    assert ok["device"] == "fake" and "--section fake_ok" in ok["command"] and ok["date"] and ok["run_id"]
    assert len({r["run_id"] for r in got.values()}) == 1
    assert "==== gpu_check summary" in done.stdout and "fake_after" in done.stdout.split("summary")[-1]


def test_sections_subset_appends(tmp_path):
    out = tmp_path / "check.jsonl"
    for _ in range(2):
        assert run("--dry-run", "--sections", "fake_ok", "--out", str(out)).returncode == 0
    sections = [json.loads(line)["section"] for line in out.read_text().splitlines()]
    assert sections == ["install", "fake_ok"] * 2           # appended, never overwritten
    listed = run("--list").stdout
    assert all(name in listed for name in ("env", "correctness", "decode_bandwidth", "extend", "generate", "engine"))
    bad = run("--dry-run", "--sections", "nope")
    assert bad.returncode == 2 and "unknown section" in bad.stderr


@pytest.fixture
def no_cuda():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")


def test_without_a_gpu_real_sections_skip_quickly(tmp_path, no_cuda):
    started = time.monotonic()
    done = run("--no-install", "--sections", "env,correctness,decode_bandwidth,engine", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    got = lines(tmp_path)
    assert {k: v["status"] for k, v in got.items() if k != "install"} == dict.fromkeys(
        ("env", "correctness", "decode_bandwidth", "engine"), "skipped: no CUDA device")
    env = got["env"]["figures"]
    assert env["cuda_available"] is False and env["torch"] and "package" in env
    assert time.monotonic() - started < 30


def test_a_section_alone_reports_no_cuda(tmp_path, no_cuda):
    result = tmp_path / "extend.jsonl"
    done = run("--section", "extend", "--result-file", str(result), "--deadline", "30")
    assert done.returncode == 0, done.stderr
    assert json.loads(result.read_text()) == {"kind": "status", "data": "skipped: no CUDA device"}


def test_quantised_extend_runs_every_format_on_the_cpu(tmp_path):
    """--cpu-smoke: the section's code on the CPU with the PyTorch path standing in for the kernels (its
    figures mean nothing; on a GPU the kernels are compared with the PyTorch path on the same pools)."""
    from hf_paged.backends.kernel_registry import KV_FORMAT_TAGS
    done = run("--no-install", "--cpu-smoke", "--sections", "quantised_extend", "--out", str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    record = lines(tmp_path)["quantised_extend"]
    cases = {c["format"]: c for c in record["figures"]["cases"]}
    assert set(cases) == {"auto", *KV_FORMAT_TAGS}       # the formats with kernels (not nvfp4/kivi)
    assert all(c["ok"] and c["ms"] > 0 and c["tokens"] == 48 for c in cases.values()), cases
    assert "quantised_extend" in run("--list").stdout


def test_extend_flops_by_hand():
    from bench.gpu_quant import extend_flops
    assert extend_flops(2, q_heads=1, head_dim=1) == 4 * 3      # 3 visible (query, key) pairs, 4 FLOPs each
    assert extend_flops(2048) == 4 * 128 * 32 * 2048 * 2049 / 2
