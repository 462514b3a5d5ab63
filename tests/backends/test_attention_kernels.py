"""The attention kernels, run on the CPU by the shim, against hf_paged.backends.torch_backend.

A covering design rather than the full product: every (head dim, block size) pair appears, each with
a different dtype / GQA ratio, each under the warp-ahead schedule and one other; every case batches
the context lengths 0, 1, block-1, block, block+1 and a long one.
"""
from __future__ import annotations

import itertools

import harness
import pytest
import torch

from hf_paged.backends import kernel_registry as reg
from hf_paged.backends import torch_backend as ta
from hf_paged.backends.synthetic import assign_blocks, random_paged_kv

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}
HEADS = [(3, 3), (8, 2), (14, 2), (16, 1), (32, 2), (8, 1)]  # GQA 1, 4, 7, 16 (MQA), 16, 8 (MQA)
OTHER_SCHEDULES = ["in_order", "reverse", "random"]


def covering_cases():
    cases = []
    for i, (d, bs) in enumerate(itertools.product(reg.HEAD_DIMS, reg.BLOCK_SIZES)):
        dtype = DTYPES[i % 3]
        heads = HEADS[i % len(HEADS)]
        long_len = 300 if i % 3 == 0 else 130 + 7 * i
        cases.append(pytest.param(d, bs, dtype, heads, long_len, OTHER_SCHEDULES[i % 3],
                                  id=f"d{d}-b{bs}-{reg.DTYPE_TAGS[dtype]}-q{heads[0]}kv{heads[1]}"))
    return cases


def cache_tables(lengths, block_size, gen, spare_blocks=3):
    """Shuffled block tables holding ``lengths`` stored tokens per row; (num_blocks, tables, lens)."""
    blocks = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks) + spare_blocks
    tables = assign_blocks(torch.randperm(num_blocks, generator=gen), blocks)
    return num_blocks, tables, torch.tensor(lengths, dtype=torch.int32)


def make_cache(lengths, block_size, num_kv_heads, head_dim, dtype, seed=0, spare_blocks=3):
    """Random pools and shuffled block tables holding `lengths` stored tokens per row."""
    gen = torch.Generator().manual_seed(seed)
    return (*random_paged_kv(lengths, block_size, num_kv_heads, head_dim, dtype, gen, spare_blocks), gen)


def packed_case(spec, block_size, num_q_heads, num_kv_heads, head_dim, dtype, seed):
    """An engine step: ``spec`` = (tokens computed before, tokens this step) per sequence, one-token
    entries first; (StepPlan, k_pool, v_pool, query [N, Hq, D]) over shuffled blocks."""
    from hf_paged.blocks import BlockTable
    from hf_paged.plan import packed_plan
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in spec) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    entries, used = [], 0
    for computed, new in spec:
        need = -(-(computed + new) // block_size)
        entries.append((BlockTable(order[used:used + need], computed + new), computed, new))
        used += need
    plan = packed_plan(entries, block_size, torch.device("cpu"))
    k_pool = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    v_pool = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    query = torch.randn(sum(n for _, n in spec), num_q_heads, head_dim, generator=gen).to(dtype)
    return plan, k_pool, v_pool, query


def assert_close(out, ref, dtype):
    tol = TOL[dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out.float()).all(), "non-finite output (poisoned shared memory read?)"
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("head_dim,block_size,dtype,heads,long_len,other", covering_cases())
def test_decode_matches_torch(shim_libraries, head_dim, block_size, dtype, heads, long_len, other):
    num_q_heads, num_kv_heads = heads
    lengths = [0, 1, block_size - 1, block_size, block_size + 1, long_len]
    k_pool, v_pool, tables, lens, gen = make_cache(lengths, block_size, num_kv_heads, head_dim, dtype)
    query = torch.randn(len(lengths), num_q_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    ref = ta.decode_attention(query, k_pool, v_pool, tables, lens, scale)
    for schedule in ("warp_ahead", other):
        for partition in (None, 64):  # one split for most rows, then split-K with the merge kernel
            backend = harness.shim_backend(shim_libraries, schedule=schedule, partition_size=partition)
            out = backend.decode_attention(query, k_pool, v_pool, tables, lens, scale)
            assert_close(out, ref, dtype)
            if partition == 64:
                assert any(name.startswith(("hfp_decode_reduce", "hfp_merge_splits")) for name in backend.launcher.launches)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 5, 40, 200])
def test_decode_sliding_window_and_splits(shim_libraries, dtype, window):
    lengths = [0, 3, 17, 150, 333]
    k_pool, v_pool, tables, lens, gen = make_cache(lengths, 16, 2, 64, dtype, seed=window)
    query = torch.randn(len(lengths), 8, 64, generator=gen).to(dtype)
    ref = ta.decode_attention(query, k_pool, v_pool, tables, lens, 0.125, sliding_window=window)
    for schedule, partition in (("warp_ahead", None), ("random", 32), ("in_order", 128)):
        backend = harness.shim_backend(shim_libraries, schedule=schedule, seed=window, partition_size=partition)
        out = backend.decode_attention(query, k_pool, v_pool, tables, lens, 0.125, sliding_window=window,
                                       max_context=333)
        assert_close(out, ref, dtype)


def extend_batch(befores, news, q_len, left_pad):
    """query_pos for rows with `before` stored tokens and `new` new ones, padded to q_len."""
    pos = torch.full((len(befores), q_len), -1, dtype=torch.int32)
    for b, (before, new) in enumerate(zip(befores, news)):
        start = q_len - new if left_pad[b] else 0
        pos[b, start:start + new] = torch.arange(before, before + new, dtype=torch.int32)
    return pos


EXTEND_CASES = [  # head_dim, block_size, dtype, heads, schedule
    (64, 16, torch.float16, (8, 2), "in_order"),
    (80, 8, torch.bfloat16, (14, 2), "reverse"),
    (96, 32, torch.float32, (3, 3), "random"),
    (128, 16, torch.bfloat16, (16, 1), "in_order"),
    (256, 8, torch.float16, (8, 1), "random"),
    (128, 32, torch.float16, (32, 2), "reverse"),
]


@pytest.mark.parametrize("head_dim,block_size,dtype,heads,other", EXTEND_CASES,
                         ids=[f"d{c[0]}-b{c[1]}-{reg.DTYPE_TAGS[c[2]]}-q{c[3][0]}kv{c[3][1]}" for c in EXTEND_CASES])
@pytest.mark.parametrize("window", [0, 6])
def test_extend_matches_torch(shim_libraries, head_dim, block_size, dtype, heads, other, window):
    num_q_heads, num_kv_heads = heads
    # prefill, continuation after a block boundary, one new token, a pad-only row, a long prefill
    befores = [0, block_size + 1, 40, 0, 0]
    news = [9, 7, 1, 0, 37]
    q_len = 37
    pos = extend_batch(befores, news, q_len, left_pad=[True, False, True, False, False])
    lengths = [b + n for b, n in zip(befores, news)]
    k_pool, v_pool, tables, lens, gen = make_cache(lengths, block_size, num_kv_heads, head_dim, dtype)
    query = torch.randn(len(lengths), num_q_heads, q_len, head_dim, generator=gen).to(dtype)
    ref = ta.extend_attention(query, k_pool, v_pool, tables, lens, pos, head_dim ** -0.5, sliding_window=window)
    for schedule in ("warp_ahead", other):
        backend = harness.shim_backend(shim_libraries, schedule=schedule)
        out = backend.extend_attention(query, k_pool, v_pool, tables, lens, pos, head_dim ** -0.5,
                                       sliding_window=window)
        assert_close(out, ref, dtype)


def test_extend_strided_query_and_empty(shim_libraries):
    k_pool, v_pool, tables, lens, gen = make_cache([5, 0], 8, 2, 64, torch.float16)
    pos = torch.tensor([[3, 4], [-1, -1]], dtype=torch.int32)
    query = torch.randn(2, 2, 4, 64, generator=gen).half().transpose(1, 2)  # [B, Hq=4, Q=2, D] strided
    ref = ta.extend_attention(query, k_pool, v_pool, tables, lens, pos, 0.125)
    out = harness.shim_backend(shim_libraries).extend_attention(query, k_pool, v_pool, tables, lens, pos, 0.125)
    assert_close(out, ref, torch.float16)
    zero = harness.shim_backend(shim_libraries).extend_attention(
        query, k_pool, v_pool, tables, torch.zeros(2, dtype=torch.int32), pos, 0.125)
    assert not zero.any()


@pytest.mark.parametrize("head_dim,block_size,heads", [(72, 16, (4, 4)), (64, 12, (4, 4)), (64, 16, (66, 2)),
                                                       (64, 16, (6, 4))])
def test_unsupported_shapes_are_refused(shim_libraries, head_dim, block_size, heads):
    k_pool = torch.zeros(heads[1], 2, block_size, head_dim, dtype=torch.float16)
    query = torch.zeros(1, heads[0], head_dim, dtype=torch.float16)
    with pytest.raises(ValueError, match="supported|multiple"):
        harness.shim_backend(shim_libraries).decode_attention(
            query, k_pool, k_pool, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0)
