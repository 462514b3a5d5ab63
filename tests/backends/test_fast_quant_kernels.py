"""The quantised fast decode (cuda/fast_quant.cuh: codes and scales staged by cp.async, each key decoded
once for the whole GQA group) run through the CPU shim against the quantised PyTorch reference, under two
schedules, with and without split-K and a sliding window. Not routed yet: cuda_fast.decode_fast_quantised
is called directly."""
from __future__ import annotations

import pytest
import torch
from test_quantised_kernels import quantised_pools

import harness
from hf_paged import kv_formats
from hf_paged.backends import cuda_fast, kernel_registry
from hf_paged.backends import quantized_torch as qt

LENGTHS = [0, 1, 7, 9, 200, 77]        # empty, one token, inside one block, across blocks, long, ragged
CASES = [("int8", 128, torch.bfloat16, 4), ("int8", 64, torch.float16, 1), ("int4", 80, torch.bfloat16, 3),
         ("int4", 128, torch.float16, 4), ("fp8_e4m3", 256, torch.float16, 2), ("fp8_e5m2", 96, torch.bfloat16, 4)]


def _case(fmt_name, head_dim, dtype, group, block_size=16, num_kv_heads=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    per_row = [(n + block_size - 1) // block_size for n in LENGTHS]
    num_blocks = sum(per_row) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(LENGTHS), max(per_row), dtype=torch.int32)
    taken = 0
    for row, n in enumerate(per_row):          # shuffled physical blocks, no two rows sharing one
        tables[row, :n] = perm[taken:taken + n]
        taken += n
    (k_pool, v_pool), _ = quantised_pools(kv_formats.FORMATS[fmt_name], num_kv_heads, num_blocks, block_size,
                                          head_dim, gen, dtype)
    query = torch.randn(len(LENGTHS), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return query, k_pool, v_pool, tables, torch.tensor(LENGTHS, dtype=torch.int32)


@pytest.mark.parametrize("fmt_name,head_dim,dtype,group", CASES, ids=[f"{c[0]}-d{c[1]}-g{c[3]}" for c in CASES])
@pytest.mark.parametrize("window,partition", [(0, None), (0, 32), (9, None)], ids=["full", "split32", "window9"])
@pytest.mark.parametrize("schedule", ["warp_ahead", "random"])
def test_quantised_fast_decode_matches_the_reference(shim_libraries, fmt_name, head_dim, dtype, group, window,
                                                     partition, schedule):
    query, k_pool, v_pool, tables, lens = _case(fmt_name, head_dim, dtype, group)
    backend = harness.shim_backend(shim_libraries, schedule=schedule, seed=1, partition_size=partition)
    scale = head_dim ** -0.5
    out = cuda_fast.decode_fast_quantised(backend, query, k_pool, v_pool, tables, lens, scale, window, max(LENGTHS))
    tag = kernel_registry.kv_format_tag(k_pool.fmt)
    assert any(name.startswith(f"hfp_decode_fast_{tag}_") for name in backend.launcher.launches)
    if partition:
        assert any(name.startswith("hfp_merge_splits") for name in backend.launcher.launches)
    ref = qt.decode_attention(query, k_pool, v_pool, tables, lens, scale, sliding_window=window).float()
    bound = 1e-3 * ref.abs().max().item()          # outputs ~2-3; observed error <= 2.4e-4 (fp8_e4m3, f16)
    torch.testing.assert_close(out.float(), ref, atol=bound, rtol=0)
    # the check can fail: the reference over values scaled by 1.01 is out of bounds
    off = kv_formats.QuantizedPool(v_pool.data, v_pool.scales * 1.01, v_pool.fmt, v_pool.head_dim, v_pool.rotation)
    wrong = qt.decode_attention(query, k_pool, off, tables, lens, scale, sliding_window=window).float()
    assert (out.float() - wrong).abs().max().item() > bound
