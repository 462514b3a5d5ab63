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
    assert not any(c["tensor_cores"] for c in cases.values())      # the PyTorch path stood in
    assert "quantised_extend" in run("--list").stdout


def test_quantised_extend_predictions_name_every_format():
    from bench.gpu_quant import EXTEND_TOKENS, predicted_extend_tflops
    from hf_paged.backends.kernel_registry import KV_FORMAT_TAGS
    predicted = predicted_extend_tflops(EXTEND_TOKENS)
    assert set(predicted) == {"auto", *KV_FORMAT_TAGS} and all(v > 0 for v in predicted.values())
    assert all(predicted[f] < predicted["auto"] for f in KV_FORMAT_TAGS)   # the dequantise pass costs shared memory


def test_extend_flops_by_hand():
    from bench.gpu_quant import extend_flops
    assert extend_flops(2, q_heads=1, head_dim=1) == 4 * 3      # 3 visible (query, key) pairs, 4 FLOPs each
    assert extend_flops(2048) == 4 * 128 * 32 * 2048 * 2049 / 2


# --- the engine sections' CPU-side logic (issue 26 item 5): parsing, selection, the report -------------------
def test_default_run_fits_five_minutes_and_orders_the_wanted_sections_first():
    from bench import gpu_check
    from bench.gpu_sections import SECTIONS
    assert gpu_check.TOTAL_BUDGET_S <= 300
    assert gpu_check.build_parser("x").parse_args([]).budget == gpu_check.TOTAL_BUDGET_S
    order = list(SECTIONS)
    assert order[:5] == ["env", "correctness", "quantised", "engine_step", "generate_batch"]
    assert sum(SECTIONS[n][0] for n in order[:5]) <= gpu_check.TOTAL_BUDGET_S      # each within its deadline
    args = gpu_check.build_parser("x").parse_args(["--sections", "engine_step,generate_batch", "--no-graphs"])
    assert args.sections == "engine_step,generate_batch" and args.no_graphs


def test_step_and_batch_reports():
    from bench.gpu_engine_step import batch_summary, step_plan, step_summary
    assert step_plan(False) == {"batches": (1, 8, 64), "prompt": 512, "warm": 3, "timed": 20}
    cases = [{"case": "engine_graphs", "batch": 8, "ms": 2.3}, {"case": "hf_sdpa_captured", "batch": 8, "ms": 2.0},
             {"case": "engine_eager", "batch": 8, "ms": 6.0}, {"case": "engine_graphs", "batch": 1, "ok": False}]
    assert step_summary(cases) == ["decode step, batch 8: engine_graphs 2.300 ms, hf_sdpa_captured 2.000 ms, "
                                   "engine_eager 6.000 ms; engine_graphs/sdpa 1.15x; engine_eager/sdpa 3.00x"]
    engine = {"requests": 64, "new_tokens": 64, "tokens_per_s": 3000.0}
    assert batch_summary(engine, {"tokens_per_s": 1000.0}).endswith("ratio 3.00x (target >= 2.0x)")
    assert "generate_batch failed (boom)" in batch_summary(engine, {"error": "boom"})


def test_within_turns_a_blocking_call_into_a_failed_case():
    from bench.gpu_engine_step import within
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish in 1 s"):
        within(1.0, time.sleep, 30)
    assert time.monotonic() - started < 5
    with pytest.raises(ValueError, match="inner"):
        within(5.0, lambda: (_ for _ in ()).throw(ValueError("inner")))


def test_engine_step_section_runs_on_the_cpu(tmp_path):
    """--cpu-smoke with the PyTorch path (no CPU kernel build): every variant at every batch is timed and the
    summary has one line per batch with the engine's ratios (figures mean nothing on the CPU)."""
    import os
    env = {**os.environ, "HF_PAGED_CPU_KERNEL": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "bench", "gpu", "--no-install", "--cpu-smoke", "--sections",
                           "engine_step", "--out", str(tmp_path)], capture_output=True, text=True, timeout=170,
                          check=False,
                          cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = lines(tmp_path)["engine_step"]
    cases = record["figures"]["cases"]
    assert {(c["case"], c["batch"]) for c in cases} == {(n, b) for n in ("engine_graphs", "engine_eager",
                                                                         "hf_sdpa_captured") for b in (1, 3)}
    assert all(c["ok"] and c["ms"] > 0 for c in cases), cases
    assert [line.split(":")[0] for line in record["figures"]["summary"]] == ["decode step, batch 1",
                                                                             "decode step, batch 3"]


def test_quantised_section_reports_time_per_token_beside_the_roofline(tmp_path):
    from bench.gpu_quant import per_token, per_token_line, predicted_ns_per_token
    predicted = predicted_ns_per_token(64, 4096, 4)
    assert set(predicted) == {"bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"}
    assert all(predicted[f] <= predicted["bf16"] for f in predicted)        # the roofline's own claim
    auto, int8 = {"format": "auto", "ms": 0.262144}, {"format": "int8", "ms": 0.131072}
    per_token(auto, 64, 4096, predicted["bf16"])
    per_token(int8, 64, 4096, None)
    assert auto["ns_per_token"] == pytest.approx(1.0) and int8["ns_per_token"] == pytest.approx(0.5)
    line = per_token_line([auto, int8, {"format": "int4", "ok": False}])
    assert line == (f"decode ns per token of context, measured (roofline): auto 1.000 ({predicted['bf16']:.3f} "
                    "predicted), int8 0.500 = 0.50x bf16")
    done = run("--no-install", "--cpu-smoke", "--sections", "quantised", "--out", str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    record = lines(tmp_path)["quantised"]
    cases = {c["format"]: c for c in record["figures"]["cases"]}
    assert set(cases) == {"auto", "fp8_e4m3", "fp8_e5m2", "int8", "int4"}
    assert all(c["ok"] and c["ns_per_token"] > 0 and c["predicted_ns_per_token"] > 0 for c in cases.values())
    assert record["figures"]["summary"][1].startswith("decode ns per token of context")
