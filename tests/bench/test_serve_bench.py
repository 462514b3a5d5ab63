"""The machinery of ``python -m bench serve`` and ``python -m bench vllm-client`` that needs no server: the
saturated rate (all requests at once), its keys in the JSON, ratios taken within a round, and the command
line handed to vLLM's client. No time is asserted; no server is started."""
from __future__ import annotations

import json
import math

import pytest

from bench import serve_load, serve_report, vllm_client
from bench.serve_client import arrivals


def test_saturated_rate_sends_everything_at_once():
    assert arrivals(5, math.inf, 0) == [0.0] * 5
    poisson = arrivals(5, 2.0, 0)
    assert poisson[0] == 0.0 and poisson == sorted(poisson) and poisson[-1] > 0
    assert serve_load.rate_arg("inf") == serve_load.rate_arg("all") == math.inf
    with pytest.raises(Exception):
        serve_load.rate_arg("0")


def test_saturate_flag_and_default_rates():
    assert serve_load.parse_args(["--saturate"], "x").rates == [math.inf]
    assert math.inf in serve_load.parse_args([], "x").rates  # reported beside the Poisson rates by default


def _run(server, rate, rnd, tps, ttft):
    m = dict.fromkeys(serve_report.METRICS, 0.1) | {"output_tokens_per_s": tps, "ttft_p50": ttft}
    return m | {"server": server, "rate": rate, "round": rnd, "requests_ok": 4, "requests_failed": 0}


def test_summary_and_ratios_within_a_round_are_strict_json():
    runs = [_run("hf_paged", "inf", 0, 30.0, 2.0), _run("vllm", "inf", 0, 60.0, 1.0),
            _run("hf_paged", "inf", 1, 40.0, 1.0), _run("vllm", "inf", 1, 40.0, 1.0),
            _run("hf_paged", 1.0, 0, 10.0, 0.5)]
    rates = [1.0, math.inf]
    summary = serve_report.summarise(runs, rates)
    assert summary["hf_paged"]["inf"]["output_tokens_per_s"] == {"min": 30.0, "median": 35.0, "max": 40.0, "n": 2}
    ratios = serve_report.ratios(runs, rates)["hf_paged/vllm"]
    assert ratios["inf"]["output_tokens_per_s"] == {"min": 0.5, "median": 0.75, "max": 1.0, "n": 2}
    assert ratios["inf"]["ttft_p50"]["max"] == 2.0
    assert "1.0" not in ratios  # vllm had no run at that rate
    json.dumps({"summary": summary, "ratios": ratios}, allow_nan=False)


def test_vllm_client_command_line(tmp_path, monkeypatch):
    py = tmp_path / "bin" / "python"
    py.parent.mkdir()
    py.write_text("")
    monkeypatch.setenv("HF_PAGED_VLLM_PYTHON", str(py))
    args = vllm_client.parse_args(["--num-prompts", "3", "--input-len", "16", "--output-len", "4"], "x")
    argv = vllm_client.client_argv(args, "http://127.0.0.1:1", "bench", "/tok", str(tmp_path), "r.json", 7)
    assert argv[:5] == [str(py), "-m", "vllm.entrypoints.cli.main", "bench", "serve"]  # no bin/vllm here
    flags = dict(zip(argv[5::], argv[6::]))
    assert flags["--backend"] == "openai" and flags["--endpoint"] == "/v1/completions"
    assert flags["--dataset-name"] == "random" and flags["--request-rate"] == "inf" and flags["--seed"] == "7"
    assert flags["--tokenizer"] == "/tok" and flags["--num-prompts"] == "3" and "--ignore-eos" in argv


def test_vllm_client_summary_leaves_out_runs_that_completed_nothing():
    runs = [{"server": "hf_paged", "round": 0, "completed": 0, "failed": 4, "output_throughput": None},
            {"server": "vllm", "round": 0, "completed": 4, "failed": 0, "output_throughput": 20.0, "median_ttft_ms": 50.0}]
    summary, ratios = vllm_client.summarise(runs)
    assert summary["hf_paged"]["output_throughput"] is None and summary["hf_paged"]["failed"]["median"] == 4
    assert ratios["hf_paged/vllm"]["output_throughput"] is None


def test_idle_servers_cpu_is_counted_per_session():
    """session_cpu_s sums every process of a server's session (what an idle peer spends during a run)."""
    import subprocess
    import sys
    import time

    from bench.common import session_cpu_s
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", burn], start_new_session=True)
    try:
        used = 0.0
        for _ in range(100):                       # until the burn is done (bounded: 10 s)
            used = session_cpu_s(proc.pid)
            if used is None or used >= 0.3:
                break
            time.sleep(0.1)
        if used is None:
            pytest.skip("no /proc here")
        assert 0.3 <= used < 5.0
        assert session_cpu_s(proc.pid + 10**7) == 0.0        # no such session: nothing counted
    finally:
        proc.kill()
        proc.wait()
    assert serve_load.parse_args([], "x").settle == 5.0
