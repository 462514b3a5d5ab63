"""hf_paged.backends.launch_checks: exact limits, exact messages, CPU tensors only."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hf_paged.backends.launch_checks import (
    DeviceLimits,
    check_int32_range,
    check_launch,
    check_tensors,
)

H100 = DeviceLimits.for_arch("sm_90", sm_count=132)
A100 = DeviceLimits.for_arch("sm_80", sm_count=108)
K = "hfp_extend_bf16_d128"


def test_arch_limits():
    assert H100.max_shared_optin == 232448 and A100.max_shared_optin == 166912
    assert H100.max_grid == (2**31 - 1, 65535, 65535) and H100.max_threads_per_block == 1024
    assert H100.default_shared == 48 * 1024 and H100.sm_count == 132
    assert DeviceLimits.for_arch("sm_90a", 1).max_shared_optin == 232448
    assert DeviceLimits.for_arch("sm_100", 148).max_shared_optin == 232448
    with pytest.raises(ValueError, match="unknown architecture 'sm_91'.*sm_90"):
        DeviceLimits.for_arch("sm_91", 1)


def _props(**extra):
    return SimpleNamespace(major=9, minor=0, multi_processor_count=132, **extra)


def test_for_device_reads_properties(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: _props(shared_memory_per_block_optin=1234))
    limits = DeviceLimits.for_device(torch.device("cuda", 1))
    assert (limits.max_shared_optin, limits.sm_count, limits.arch) == (1234, 132, "sm_90")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: _props())   # older torch
    assert DeviceLimits.for_device(0).max_shared_optin == 232448
    with pytest.raises(ValueError, match="cpu is not a CUDA device"):
        DeviceLimits.for_device("cpu")


def test_a_launch_within_limits_passes():
    check_launch(K, (2**31 - 1, 65535, 65535), (1024, 1, 1), 232448, H100)
    check_launch(K, (np.int64(8), 1, 3), (128,), np.int32(40960), H100)   # numpy ints, short tuples


@pytest.mark.parametrize("grid,message", [
    ((8, 1, 70000), r"grid\.z = 70000 exceeds the device limit 65535 \(query tokens 280000 / 4 per CTA\)"),
    ((8, 65536, 1), r"grid\.y = 65536 exceeds the device limit 65535 \(the caller must tile"),
    ((2**31, 1, 1), r"grid\.x = 2147483648 exceeds the device limit 2147483647"),
    ((8, 0, 1), r"grid\.y = 0 must be at least 1"),
])
def test_grid_limits(grid, message):
    with pytest.raises(ValueError, match=rf"^{K}: {message}"):
        check_launch(K, grid, (128, 1, 1), 0, H100, explain={"grid.z": "query tokens 280000 / 4 per CTA"})


def test_block_and_shared_memory_limits():
    with pytest.raises(ValueError, match=r"1536 threads per block exceed the device limit 1024"):
        check_launch(K, (1, 1, 1), (512, 3, 1), 0, H100)
    with pytest.raises(ValueError, match=r"block\.x = 1025 is outside the device limits \[1, 1024\]"):
        check_launch(K, (1, 1, 1), (1025, 1, 1), 0, H100)
    with pytest.raises(ValueError, match=r"1056 threads per block"):
        check_launch(K, (1, 1, 1), (32, 33, 1), 0, H100)
    with pytest.raises(ValueError, match=r"block\.z = 65 is outside the device limits \[1, 64\]"):
        check_launch(K, (1, 1, 1), (1, 1, 65), 0, H100)
    with pytest.raises(ValueError, match=r"shared_mem = 166913 bytes exceeds the device's opt-in maximum 166912 "
                                         r"\(sm_80\) \(fewer query rows"):
        check_launch(K, (1, 1, 1), (128, 1, 1), 166913, A100)
    check_launch(K, (1, 1, 1), (128, 1, 1), 166913, H100)
    with pytest.raises(ValueError, match="must not be negative"):
        check_launch(K, (1, 1, 1), (128, 1, 1), -1, H100)


@pytest.mark.parametrize("grid,block,smem", [((8, 1, 2.0), (128, 1, 1), 0), ((8, 1, 1), (np.float32(128),), 0),
                                             ((8, 1, 1), (128, 1, 1), 1024.0), ((True, 1, 1), (128,), 0),
                                             ((1, 1, 1, 1), (128,), 0)])
def test_non_integers_are_refused(grid, block, smem):
    with pytest.raises(ValueError, match=rf"^{K}: .*(must be an integer|1 to 3 integers)"):
        check_launch(K, grid, block, smem, H100)


def test_tensors_on_the_device_and_aligned():
    pool = torch.zeros(2, 4, 16, 64, dtype=torch.bfloat16)
    table = torch.zeros(3, 5, dtype=torch.int32)
    check_tensors(K, torch.device("cpu"), {"k_pool": (pool, 16), "block_tables": (table, 4), "part_out": (None, 16)})
    flat = torch.zeros(64, dtype=torch.bfloat16)
    view = flat[1:]                                        # storage offset 1 element: 2 bytes past
    with pytest.raises(ValueError, match=rf"^{K}: query at address 0x[0-9a-f]+ is 2 bytes past a 16-byte boundary "
                                         r"\(address % 16 = 2\) but is loaded as 16-byte vectors"):
        check_tensors(K, "cpu", {"query": (view, 16)})
    check_tensors(K, "cpu", {"query": (flat[8:], 16)})     # 16 bytes in: aligned again
    ints = torch.zeros(8, dtype=torch.int32)
    check_tensors(K, "cpu", {"block_tables": (ints[1:], 4)})
    with pytest.raises(ValueError, match=r"block_tables .* is 2 bytes past a 4-byte boundary .* read as 4-byte"):
        check_tensors(K, "cpu", {"block_tables": (torch.zeros(8, dtype=torch.int16)[1:], 4)})


def test_tensors_on_another_device():
    with pytest.raises(ValueError, match=rf"^{K}: query is on cpu but the launch is on meta"):
        check_tensors(K, "meta", {"query": (torch.zeros(4), 16)})
    with pytest.raises(ValueError, match="alignment 12 of query must be a power of two"):
        check_tensors(K, "cpu", {"query": (torch.zeros(4), 12)})


def test_int32_range():
    assert check_int32_range("q_len", 2**31 - 1) == 2**31 - 1
    assert isinstance(check_int32_range("q_len", np.int64(5)), np.int32)
    assert check_int32_range("window", -2**31) == -2**31
    with pytest.raises(ValueError, match=r"q_len = 2147483648 does not fit the kernels' int32 argument "
                                         r"\[-2147483648, 2147483647\]; chunk the prompt"):
        check_int32_range("q_len", 2**31, knob="chunk the prompt")
    with pytest.raises(ValueError, match="must be an integer"):
        check_int32_range("q_len", 3.0)
