"""write_kv and copy_blocks kernels (run by the CPU shim) against hf_paged.backends.torch_backend."""
from __future__ import annotations

import pytest
import torch

import harness
from hf_paged.backends import torch_backend as ta


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim,num_kv_heads", [(64, 1), (80, 3), (256, 2)])
def test_write_kv_matches_torch(shim_libraries, dtype, head_dim, num_kv_heads):
    gen = torch.Generator().manual_seed(head_dim)
    pools = [torch.randn(num_kv_heads, 6, 8, head_dim, generator=gen).to(dtype) for _ in range(2)]
    expected = [p.clone() for p in pools]
    # [B, Hkv, Q, D] as a model makes it, seen as [N, Hkv, D] through a strided view; fp32 input
    # into a half pool exercises the cast.
    key = torch.randn(2, num_kv_heads, 5, head_dim, generator=gen).transpose(1, 2).reshape(10, num_kv_heads, head_dim)
    value = torch.randn(2, 5, num_kv_heads, head_dim, generator=gen).view(10, num_kv_heads, head_dim)[::1]
    slots = torch.tensor([3, -1, 47, 8, 9, -1, -1, 0, 21, 22], dtype=torch.int64)
    ta.write_kv(*expected, key, value, slots)
    harness.shim_backend(shim_libraries, schedule="random").write_kv(*pools, key, value, slots)
    assert torch.equal(pools[0], expected[0]) and torch.equal(pools[1], expected[1])


def test_write_kv_non_unit_last_stride(shim_libraries):
    pools = [torch.zeros(2, 2, 8, 64, dtype=torch.float16) for _ in range(2)]
    expected = [p.clone() for p in pools]
    key = torch.randn(64, 2, 3).half().permute(2, 1, 0)  # [3, 2, 64] with stride(-1) != 1
    slots = torch.tensor([0, 5, 15])
    ta.write_kv(*expected, key, key, slots)
    harness.shim_backend(shim_libraries).write_kv(*pools, key, key, slots)
    assert torch.equal(pools[0], expected[0]) and torch.equal(pools[1], expected[1])


@pytest.mark.parametrize("dtype,head_dim,block_size", [(torch.float16, 64, 8), (torch.bfloat16, 80, 16),
                                                        (torch.float32, 128, 32)])
def test_copy_blocks_all_pools_one_launch(shim_libraries, dtype, head_dim, block_size):
    gen = torch.Generator().manual_seed(1)
    pools = [torch.randn(2, 9, block_size, head_dim, generator=gen).to(dtype) for _ in range(6)]  # 3 layers x k, v
    expected = [p.clone() for p in pools]
    pairs = torch.tensor([[0, 5], [3, 7], [0, 8]], dtype=torch.int64)
    ta.copy_blocks(expected, pairs)
    backend = harness.shim_backend(shim_libraries, schedule="reverse")
    backend.copy_blocks(pools, pairs)
    backend.copy_blocks(pools, torch.zeros(0, 2, dtype=torch.int64))
    assert backend.launcher.launches == ["hfp_copy_blocks"]
    for got, want in zip(pools, expected):
        assert torch.equal(got, want)
