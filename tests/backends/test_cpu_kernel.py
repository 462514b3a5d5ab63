"""The CPU kernel (cuda/paged_attention_cpu.cpp through hf_paged.backends.cpu_backend) against the PyTorch
reference (hf_paged.backends.torch_backend): decode, extend and packed steps over odd grids, GQA,
sliding windows, pads and empty rows; its refusals; and how select_backend picks or skips it.
"""
from __future__ import annotations

import itertools
import logging

import pytest
import torch
from test_attention_kernels import DTYPES, assert_close, make_cache, packed_case

from hf_paged.backends import BackendRegistry, backend_kind, cpp_build, cpu_backend, select_backend
from hf_paged.backends import torch_backend as ta

HEADS = [(3, 3), (9, 3), (8, 2), (14, 2), (16, 1), (32, 1)]      # GQA 1, 3, 4, 7, 16 (MQA), 32


@pytest.fixture(scope="module")
def backend():
    return cpu_backend.make_backend()


GRID = [pytest.param(d, bs, dtype, heads, window, id=f"d{d}-b{bs}-{str(dtype)[6:]}-q{heads[0]}kv{heads[1]}-w{window}")
        for i, (d, bs, window) in enumerate(itertools.product([40, 64, 80, 128, 256], [1, 8, 12, 16, 32], [0, 5]))
        for dtype, heads in [(DTYPES[i % 3], HEADS[i % len(HEADS)])]]


@pytest.mark.parametrize("head_dim,block_size,dtype,heads,window", GRID)
def test_decode_matches_torch(backend, head_dim, block_size, dtype, heads, window):
    num_q, num_kv = heads
    lengths = [0, 1, block_size - 1 or 2, block_size, block_size + 1, 3 * block_size + 5, 211]
    k_pool, v_pool, tables, lens, gen = make_cache(lengths, block_size, num_kv, head_dim, dtype, seed=head_dim + block_size)
    query = torch.randn(len(lengths), num_q, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    out = backend.decode_attention(query, k_pool, v_pool, tables, lens, scale, window)
    ref = ta.decode_attention(query, k_pool, v_pool, tables, lens, scale, window)
    assert_close(out, ref, dtype)
    assert torch.all(out[0] == 0), "a row with no stored tokens gives zeros"


@pytest.mark.parametrize("head_dim,block_size,dtype,heads,window", GRID[::3])
def test_extend_matches_torch(backend, head_dim, block_size, dtype, heads, window):
    """Rows with earlier context, left pads (query_pos -1) and new tokens attending causally."""
    num_q, num_kv = heads
    befores, news, q_len = [0, 3, block_size + 2, 40], [5, 1, 7, 9], 9
    lengths = [b + n for b, n in zip(befores, news)]
    k_pool, v_pool, tables, lens, gen = make_cache(lengths, block_size, num_kv, head_dim, dtype, seed=7 * head_dim)
    query_pos = torch.full((len(lengths), q_len), -1, dtype=torch.int32)
    for row, (before, new) in enumerate(zip(befores, news)):
        query_pos[row, q_len - new:] = torch.arange(before, before + new, dtype=torch.int32)
    query = torch.randn(len(lengths), num_q, q_len, head_dim, generator=gen).to(dtype)
    scale = 0.3
    out = backend.extend_attention(query, k_pool, v_pool, tables, lens, query_pos, scale, window)
    ref = ta.extend_attention(query, k_pool, v_pool, tables, lens, query_pos, scale, window)
    assert_close(out, ref, dtype)
    assert torch.all(out[0, :, :q_len - news[0]] == 0), "pad queries give zeros"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 4])
def test_packed_step_matches_torch(backend, dtype, window):
    """One ragged call for a packed step (decode rows, then prefill chunks) equals the PyTorch step, which
    scatters the chunks into padding."""
    spec = [(5, 1), (16, 1), (30, 1), (0, 13), (9, 20)]   # three decodes, a fresh prompt, a chunk after a prefix
    plan, k_pool, v_pool, query = packed_case(spec, 8, 6, 2, 64, dtype, seed=11)
    out = backend.prepare(plan).attend(query, k_pool, v_pool, 0.125, window)
    ref = ta.TorchBackend().prepare(plan).attend(query, k_pool, v_pool, 0.125, window)
    assert_close(out, ref, dtype)


def test_strided_query_and_all_pads(backend):
    k_pool, v_pool, tables, lens, gen = make_cache([4, 9], 4, 2, 64, torch.float32, seed=3)
    query = torch.randn(2, 64, 4, generator=gen).transpose(1, 2)          # [B, Hq=4, D=64], not contiguous
    torch.testing.assert_close(backend.decode_attention(query, k_pool, v_pool, tables, lens, 0.1),
                               ta.decode_attention(query, k_pool, v_pool, tables, lens, 0.1))
    pads = torch.full((2, 3), -1, dtype=torch.int32)
    out = backend.extend_attention(torch.randn(2, 4, 3, 64), k_pool, v_pool, tables, lens, pads, 0.1)
    assert torch.all(out == 0)


def test_refusals_name_the_problem(backend):
    k_pool, v_pool, tables, lens, gen = make_cache([20], 8, 2, 64, torch.float32, seed=5)
    query = torch.randn(1, 4, 64)
    bad = tables.clone()
    bad[0, 1] = k_pool.shape[1] + 7
    with pytest.raises(RuntimeError, match="outside the pool"):
        backend.decode_attention(query, k_pool, v_pool, bad, lens, 0.1)
    with pytest.raises(RuntimeError, match="block-table row has"):
        backend.decode_attention(query, k_pool, v_pool, tables[:, :1], lens, 0.1)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        backend.decode_attention(torch.randn(1, 3, 64), k_pool, v_pool, tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="head_dim"):
        backend.op(torch.randn(1, 4, 32), k_pool, v_pool, tables, torch.zeros(1, dtype=torch.int32),
                   torch.zeros(1, dtype=torch.int32), 0.1, 0)


def test_mixed_dtypes_use_the_torch_path(backend):
    """A query whose dtype differs from the pools' is served by the PyTorch path, not refused."""
    k_pool, v_pool, tables, lens, gen = make_cache([7, 12], 4, 1, 64, torch.bfloat16, seed=9)
    query = torch.randn(2, 2, 64, dtype=torch.float64)
    with pytest.raises(RuntimeError):       # the reference refuses it too: the matmul needs one dtype
        ta.decode_attention(query, k_pool, v_pool, tables, lens, 0.1)
    with pytest.raises(RuntimeError):
        backend.decode_attention(query, k_pool, v_pool, tables, lens, 0.1)


def test_select_backend_picks_the_kernel_and_falls_back(monkeypatch, caplog):
    cpu = torch.device("cpu")
    assert isinstance(select_backend(cpu), cpu_backend.CpuKernelBackend)
    assert select_backend(cpu) is select_backend(cpu)           # one per device and process
    monkeypatch.setenv(cpp_build.KERNEL_ENV, "0")
    assert isinstance(select_backend(cpu), ta.TorchBackend)
    monkeypatch.setenv(cpp_build.KERNEL_ENV, "1")

    def broken():
        raise RuntimeError("could not build the CPU paged-attention kernel (paged_attention_cpu.cpp): no g++")
    monkeypatch.setattr(cpu_backend, "make_backend", broken)
    with caplog.at_level(logging.WARNING, logger="hf_paged.backends"):
        assert isinstance(BackendRegistry().get(cpu, backend_kind(cpu)), ta.TorchBackend)   # a fresh process
    assert "no g++" in caplog.text and cpp_build.KERNEL_ENV in caplog.text


def test_torch_compile_traces_the_op_without_a_graph_break(backend):
    """fullgraph=True fails on any graph break: the op has a fake implementation, so inductor takes it
    as one node, and the compiled function equals the eager one."""
    k_pool, v_pool, tables, lens, gen = make_cache([9, 30], 8, 2, 64, torch.float32, seed=13)
    query = torch.randn(2, 6, 64, generator=gen)
    rows = torch.arange(2, dtype=torch.int32)
    pos = lens - 1

    def attention_then_proj(q, weight):
        out = torch.ops.hf_paged_cpu.paged_attention(q, k_pool, v_pool, tables, rows, pos, 0.125, 0)
        return (out.flatten(1) @ weight).relu()

    weight = torch.randn(6 * 64, 16, generator=gen)
    compiled = torch.compile(attention_then_proj, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(query, weight), attention_then_proj(query, weight))


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_prefill_rows(backend, dtype):
    """Rows of 100 new tokens (13 chunks, the last partial) after 0 and 37 stored ones, with a window,
    through the backend and the op directly."""
    num_q, num_kv, head_dim, block_size = 6, 2, 64, 16
    befores, q_len = [0, 37], 100
    lengths = [b + q_len for b in befores]
    k_pool, v_pool, tables, lens, gen = make_cache(lengths, block_size, num_kv, head_dim, dtype, seed=21)
    query_pos = torch.stack([torch.arange(b, b + q_len, dtype=torch.int32) for b in befores])
    query = torch.randn(len(lengths), num_q, q_len, head_dim, generator=gen).to(dtype)
    ref = ta.extend_attention(query, k_pool, v_pool, tables, lens, query_pos, 0.125, 24)
    assert_close(backend.extend_attention(query, k_pool, v_pool, tables, lens, query_pos, 0.125, 24), ref, dtype)
    rows = torch.arange(len(lengths), dtype=torch.int32).repeat_interleave(q_len)
    flat = query.transpose(1, 2).reshape(-1, num_q, head_dim).contiguous()
    direct = backend.op(flat, k_pool, v_pool, tables, rows, query_pos.reshape(-1).contiguous(), 0.125, 24)
    assert_close(direct.view(len(lengths), q_len, num_q, head_dim).transpose(1, 2), ref, dtype)


# -- prefill tiles (paged_attention_cpu_tile.h) ---------------------------------------------------------
# Rows of one extend call: (tokens stored before, new tokens). A fresh prompt that fills no tile evenly,
# a chunk continuing a prefix, one new token (the decode path inside an extend) and two (the smallest tile).
PREFILL_ROWS = [(0, 131), (45, 70), (130, 1), (7, 2)]
# (head_dim, block_size, (query heads, KV heads), window, dtype): GQA 1 / 3 / 8; D 64 / 80 / 128 and 36 (a
# channel tail on every vector width); blocks of 1 (64 per key tile), 5 and 7 (tiles end mid-row), 96 (one
# block wider than a key tile); windows of 37 and 100 start and end inside tiles.
PREFILL_CASES = [(64, 16, (9, 3), 0, torch.float32), (64, 16, (9, 3), 37, torch.bfloat16),
                 (80, 5, (3, 3), 100, torch.float32), (128, 16, (16, 2), 37, torch.float32),
                 (128, 96, (16, 2), 0, torch.float16), (36, 1, (9, 3), 37, torch.float32),
                 (80, 32, (16, 2), 0, torch.bfloat16), (64, 7, (3, 3), 0, torch.float16)]


def prefill_query(rows, num_q, head_dim, dtype, gen):
    """query [B, Hq, Q, D] and query_pos [B, Q] (left pads -1) for PREFILL_ROWS-like (before, new) rows."""
    q_len = max(new for _, new in rows)
    query_pos = torch.full((len(rows), q_len), -1, dtype=torch.int32)
    for row, (before, new) in enumerate(rows):
        query_pos[row, q_len - new:] = torch.arange(before, before + new, dtype=torch.int32)
    return torch.randn(len(rows), num_q, q_len, head_dim, generator=gen).to(dtype), query_pos


@pytest.mark.parametrize("head_dim,block_size,heads,window,dtype", PREFILL_CASES,
                         ids=[f"d{c[0]}-b{c[1]}-q{c[2][0]}kv{c[2][1]}-w{c[3]}-{str(c[4])[6:]}" for c in PREFILL_CASES])
def test_prefill_tiles_match_torch(backend, head_dim, block_size, heads, window, dtype):
    (num_q, num_kv), lengths = heads, [b + n for b, n in PREFILL_ROWS]
    k_pool, v_pool, tables, lens, gen = make_cache(lengths, block_size, num_kv, head_dim, dtype, seed=head_dim + window)
    query, query_pos = prefill_query(PREFILL_ROWS, num_q, head_dim, dtype, gen)
    out = backend.extend_attention(query, k_pool, v_pool, tables, lens, query_pos, head_dim ** -0.5, window)
    ref = ta.extend_attention(query, k_pool, v_pool, tables, lens, query_pos, head_dim ** -0.5, window)
    assert_close(out, ref, dtype)


# bf16 prefill chunks, scored by VDPBF16PS where built for AVX-512 BF16 (score_block_bf16): D 32-256 and an odd
# 35 (the float tiles); blocks of 1, 5 and 7 keys (the 6-key register tile's tails); GQA 1 to 16; windows.
BF16_PREFILL_CASES = [(128, 16, (16, 2), 0), (256, 8, (8, 1), 37), (64, 1, (9, 3), 0), (64, 5, (3, 3), 100),
                      (32, 7, (8, 8), 0), (35, 16, (4, 2), 0)]


@pytest.mark.parametrize("head_dim,block_size,heads,window", BF16_PREFILL_CASES)
def test_bf16_prefill_tiles_match_torch(backend, head_dim, block_size, heads, window):
    (num_q, num_kv), lengths = heads, [b + n for b, n in PREFILL_ROWS]
    k_pool, v_pool, tables, lens, gen = make_cache(lengths, block_size, num_kv, head_dim, torch.bfloat16,
                                                   seed=head_dim + block_size)
    query, query_pos = prefill_query(PREFILL_ROWS, num_q, head_dim, torch.bfloat16, gen)
    scale = head_dim ** -0.5           # (not a power of two at 32, 128 and 35: applied after the sums)
    out = backend.extend_attention(query, k_pool, v_pool, tables, lens, query_pos, scale, window)
    ref = ta.extend_attention(query, k_pool, v_pool, tables, lens, query_pos, scale, window)
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("name,head_dim,heads,window", [("int8", 64, (9, 3), 0), ("int4", 128, (16, 2), 37),
                                                        ("fp8_e4m3", 80, (3, 3), 0)])
def test_prefill_tiles_over_quantised_pools(backend, name, head_dim, heads, window):
    """Quantised pools take the same tiles (dequantised tiles from the thread's cache, several per key tile)."""
    from test_cpu_kernel_quant import quantised_pool, shared_tables

    from hf_paged import kv_formats
    from hf_paged.backends import quantized_torch
    (num_q, num_kv), fmt = heads, kv_formats.FORMATS[name]
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, tables, lens = shared_tables([b + n for b, n in PREFILL_ROWS], 16, gen)
    k, v = (quantised_pool(fmt, (num_kv, num_blocks, 16, head_dim), gen) for _ in range(2))
    query, query_pos = prefill_query(PREFILL_ROWS, num_q, head_dim, torch.float32, gen)
    out = backend.extend_attention(query, k, v, tables, lens, query_pos, 0.3, window)
    ref = quantized_torch.extend_attention(query, k, v, tables, lens, query_pos, 0.3, window)
    assert_close(out, ref, torch.float32)


# -- the model-dtype write (kv_write_cpu.cpp's write_kv) -------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_stores_what_index_copy_stores(backend, dtype):
    """Strided states (a transposed view, as the layers hand them), slots -1 skipped, every head: the pools
    equal torch_backend.write_kv's bit for bit, and nothing else is touched."""
    gen = torch.Generator().manual_seed(11)
    n, heads, blocks, bs, d = 21, 3, 6, 8, 64
    key = torch.randn(heads, n, d, generator=gen).to(dtype).transpose(0, 1)       # [N, Hkv, D], strided
    value = torch.randn(n, d, heads, generator=gen).to(dtype).transpose(1, 2)
    slots = torch.randperm(blocks * bs, generator=gen)[:n]
    slots[[2, 7, 20]] = -1
    ours = [torch.full((heads, blocks, bs, d), 7.0, dtype=dtype) for _ in range(2)]
    ref = [p.clone() for p in ours]
    backend.write_kv(*ours, key, value, slots)
    ta.write_kv(*ref, key, value, slots)
    for mine, theirs in zip(ours, ref):
        assert torch.equal(mine, theirs)
    assert int((ours[0] != 7.0).any(-1).sum()) == heads * (n - 3), "each kept token in each head, no other slot"


def test_write_refuses_what_it_cannot_store(backend):
    pools = [torch.zeros(2, 4, 8, 64) for _ in range(2)]
    x = torch.randn(3, 2, 64)
    with pytest.raises(RuntimeError, match="outside the pool's 32 slots"):
        backend.plain_write_op(x, x, torch.tensor([0, 1, 32]), *pools)
    with pytest.raises(RuntimeError, match="share one dtype"):
        backend.plain_write_op(x.double(), x.double(), torch.tensor([0, 1, 2]), *pools)
    with pytest.raises(RuntimeError, match="do not fit pools"):
        backend.plain_write_op(torch.randn(3, 3, 64), torch.randn(3, 3, 64), torch.tensor([0, 1, 2]), *pools)


@pytest.mark.parametrize("head_dim,block_size,heads,window", [(64, 16, (9, 3), 0), (64, 32, (8, 1), 7), (128, 12, (4, 2), 0),
                                                              (128, 32, (8, 2), 0), (32, 1, (2, 2), 0),
                                                              (256, 8, (16, 2), 33), (80, 16, (4, 2), 0)])
def test_bf16_decode_steps_match_torch(backend, head_dim, block_size, heads, window):
    """A decode step of bf16 pools: where built for AVX-512 BF16 and D % 32 == 0 the keys are scored in place by
    VDPBF16PS (paged_attention_cpu_bf16.cpp), else through attend's float tiles; both against the PyTorch
    reference, with empty rows (zeros), rows ending inside a block, 16-key groups and their tails."""
    num_q, num_kv = heads
    lengths = [0, 1, 5, block_size, block_size + 17, 3 * block_size + 5, 211, 64]
    k_pool, v_pool, tables, lens, gen = make_cache(lengths, block_size, num_kv, head_dim, torch.bfloat16, seed=head_dim)
    query = torch.randn(len(lengths), num_q, head_dim, generator=gen).bfloat16()
    scale = head_dim ** -0.5
    out = backend.decode_attention(query, k_pool, v_pool, tables, lens, scale, window)
    ref = ta.decode_attention(query, k_pool, v_pool, tables, lens, scale, window)
    assert_close(out, ref, torch.bfloat16)
    assert torch.all(out[0] == 0), "a row with no stored tokens gives zeros"
