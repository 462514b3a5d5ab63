"""cuda/fast_attention.cu run by the CPU shim against hf_paged.backends.torch_backend: the tensor-core
ragged kernel (mma.sync / ldmatrix / cp.async emulated by the shim from the PTX fragment layouts) and
the cp.async-pipelined CUDA-core decode, with and without split-K; and mutations of their pipelines
(a missing cp.async wait or barrier) that the tests must catch.

The shim's cp.async poisons its destination at issue and writes it only when the issuing thread waits
for the copy's group, so a read before the wait (or a buffer refilled while another warp still reads
it) gives NaN. Both kernels exist for fp16 and bf16 only; fp32 and quantised pools stay on attention.cu.
"""
from __future__ import annotations

import itertools
import shutil

import harness
import pytest
import torch
from test_attention_kernels import assert_close, make_cache, packed_case

from hf_paged.backends import kernel_registry as reg
from hf_paged.backends import torch_backend as ta

FAST = [torch.float16, torch.bfloat16]
GROUPS = [(4, 4), (8, 2), (14, 2), (16, 2), (32, 1), (32, 2), (6, 6)]   # GQA 1, 4, 7, 8, 32, 16, 1


def ragged_reference(query, k_pool, v_pool, tables, rows, pos, scale, window):
    """Each token attends to its row's keys 0..pos: decode attention over context pos + 1."""
    return ta.decode_attention(query, k_pool, v_pool, tables[rows.long()], (pos + 1).clamp(min=0), scale,
                               sliding_window=window)


def ragged_case(block_size, num_kv_heads, head_dim, dtype, seed):
    """Rows: a 150-token prefill (three K/V tiles or more: buffers are refilled), 9 tokens after 40
    stored, one decode token at 250, a pad-only row; the token list has pads inside a row."""
    lengths = [150, 49, 251, 3]
    k_pool, v_pool, tables, _, gen = make_cache(lengths, block_size, num_kv_heads, head_dim, dtype, seed=seed)
    rows = torch.tensor([0] * 150 + [1] * 11 + [2] + [3] * 2, dtype=torch.int32)
    pos = torch.cat([torch.arange(150), torch.tensor([-1]), torch.arange(40, 49), torch.tensor([-1]),
                     torch.tensor([250]), torch.tensor([-1, -1])]).to(torch.int32)
    return k_pool, v_pool, tables, rows, pos, gen


def fast_cases():
    cases = []
    for i, (d, bs) in enumerate(itertools.product(reg.HEAD_DIMS, reg.BLOCK_SIZES)):
        cases.append(pytest.param(d, bs, FAST[i % 2], GROUPS[i % len(GROUPS)], [0, 9][i % 2],
                                  id=f"d{d}-b{bs}-{reg.DTYPE_TAGS[FAST[i % 2]]}-q{GROUPS[i % len(GROUPS)][0]}"
                                     f"kv{GROUPS[i % len(GROUPS)][1]}-w{[0, 9][i % 2]}"))
    return cases


@pytest.mark.parametrize("head_dim,block_size,dtype,heads,window", fast_cases())
def test_ragged_matches_torch(shim_libraries, head_dim, block_size, dtype, heads, window):
    num_q, num_kv = heads
    k_pool, v_pool, tables, rows, pos, gen = ragged_case(block_size, num_kv, head_dim, dtype, seed=head_dim + block_size)
    query = torch.randn(rows.numel(), num_q, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    ref = ragged_reference(query, k_pool, v_pool, tables, rows, pos, scale, window)
    for schedule, partition in (("warp_ahead", None), ("random", 32)):
        backend = harness.shim_backend(shim_libraries, schedule=schedule, seed=head_dim, partition_size=partition)
        out = backend.ragged_attention(query, k_pool, v_pool, tables, rows, pos, scale, window)
        assert_close(out, ref, dtype)
        assert backend.launcher.launches[0] == reg.ragged_kernel(reg.DTYPE_TAGS[dtype], head_dim).name
        assert (reg.merge_kernel(reg.DTYPE_TAGS[dtype], head_dim).name in backend.launcher.launches) == (partition is not None)
    assert torch.all(out[pos < 0] == 0), "pad tokens give zeros"


@pytest.mark.parametrize("dtype", FAST)
@pytest.mark.parametrize("head_dim,heads", [(64, (16, 1)), (128, (4, 1)), (256, (8, 2)), (80, (7, 1)), (96, (2, 2))])
def test_decode_routes_and_matches(shim_libraries, dtype, head_dim, heads):
    """Small groups decode on CUDA cores, large ones on the ragged kernel; both with and without splits,
    with a sliding window, at lengths 0, 1, a stage's width +- 1 and long."""
    num_q, num_kv = heads
    group = num_q // num_kv
    keys = reg.decode_fast_keys(head_dim)
    lengths = [0, 1, keys - 1, keys + 1, 3 * keys * reg.DECODE_FAST_STAGES + 5, 250]
    k_pool, v_pool, tables, lens, gen = make_cache(lengths, 16, num_kv, head_dim, dtype, seed=group)
    query = torch.randn(len(lengths), num_q, head_dim, generator=gen).to(dtype)
    kernel = (reg.decode_fast_kernel if reg.uses_decode_fast(group, head_dim) else reg.ragged_kernel)(
        reg.DTYPE_TAGS[dtype], head_dim).name
    for window in (0, 37):
        ref = ta.decode_attention(query, k_pool, v_pool, tables, lens, head_dim ** -0.5, sliding_window=window)
        for schedule, partition in (("warp_ahead", None), ("reverse", 48)):
            backend = harness.shim_backend(shim_libraries, schedule=schedule, partition_size=partition)
            out = backend.decode_attention(query, k_pool, v_pool, tables, lens, head_dim ** -0.5, sliding_window=window)
            assert_close(out, ref, dtype)
            assert backend.launcher.launches[0] == kernel


@pytest.mark.parametrize("dtype", FAST)
def test_packed_step_is_one_ragged_launch(shim_libraries, dtype):
    """An engine step (three decodes, a fresh prompt, a chunk after a prefix) is one launch per layer,
    equal to the PyTorch step that scatters the chunks into padding."""
    spec = [(5, 1), (16, 1), (30, 1), (0, 13), (9, 20)]
    plan, k_pool, v_pool, query = packed_case(spec, 8, 8, 2, 64, dtype, seed=5)
    backend = harness.shim_backend(shim_libraries, schedule="warp_ahead")
    step = backend.prepare(plan)
    for window in (0, 4):   # two "layers": the second reuses the step's ragged plan and chunks
        out = step.attend(query, k_pool, v_pool, 0.125, window)
        assert_close(out, ta.TorchBackend().prepare(plan).attend(query, k_pool, v_pool, 0.125, window), dtype)
    assert backend.launcher.launches == [reg.ragged_kernel(reg.DTYPE_TAGS[dtype], 64).name] * 2


def test_ragged_chunks_cut_runs_without_a_host_sync():
    from hf_paged.backends.cuda_fast import ragged_chunks
    rows = torch.tensor([0, 0, 0, 0, 0, 1, 2, 2, 2, 0], dtype=torch.int32)
    chunks = ragged_chunks(rows, 2, 3)
    real = [tuple(c) for c in chunks.tolist() if c[1] > 0]
    assert real == [(0, 2), (2, 2), (4, 1), (5, 1), (6, 2), (8, 1), (9, 1)]
    assert chunks.shape[0] >= len(real) and chunks[:, 1].sum() == rows.numel()


# --- mutations of the pipelines: each must make the tests above fail ----------------------------
MUTATIONS = {  # name: (statement as written, with the comment after it, replacement statement)
    "ragged: no wait for V": ("cp_async_wait<2>();  // V(t) has landed", "(void)0;"),
    "ragged: no wait for K": ("cp_async_wait<3>();  // Q and K(t) have landed", "(void)0;"),
    "ragged: refill before readers finish": ("__syncthreads();  // tile t's buffers are free", "(void)0;"),
    "decode: no wait for V": ("cp_async_wait<2 * kStages - 2>();  // V(t) has landed", "(void)0;"),
    "decode: one stage too few waited": ("cp_async_wait<2 * kStages - 1>();  // K(t) has landed",
                                         "cp_async_wait<2 * kStages>();"),
    "decode: refill before readers finish": ("__syncthreads();  // ring slot t % kStages is free", "(void)0;"),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_pipeline_mutations_are_caught(tmp_path, name):
    old, statement = MUTATIONS[name]
    new = statement + old[old.index(";") + 1:]       # keep the comment: line numbers stay
    sources = tmp_path / "cuda"
    shutil.copytree(harness.CUDA_DIR, sources, ignore=shutil.ignore_patterns("__pycache__", "*.py", "*.cpp"))
    text = (sources / reg.FAST_SOURCE).read_text()
    assert text.count(old) == 1, old
    (sources / reg.FAST_SOURCE).write_text(text.replace(old, new))
    libs = harness.build(sources_dir=sources, units=[(reg.FAST_SOURCE, 64, "")])
    dtype = torch.float16
    if name.startswith("ragged"):
        k_pool, v_pool, tables, rows, pos, gen = ragged_case(8, 2, 64, dtype, seed=3)
        query = torch.randn(rows.numel(), 8, 64, generator=gen).to(dtype)
        ref = ragged_reference(query, k_pool, v_pool, tables, rows, pos, 0.125, 0)
        run = lambda b: b.ragged_attention(query, k_pool, v_pool, tables, rows, pos, 0.125)
    else:
        k_pool, v_pool, tables, lens, gen = make_cache([1, 40, 150, 300], 16, 2, 64, dtype, seed=3)
        query = torch.randn(4, 4, 64, generator=gen).to(dtype)
        ref = ta.decode_attention(query, k_pool, v_pool, tables, lens, 0.125)
        run = lambda b: b.decode_attention(query, k_pool, v_pool, tables, lens, 0.125)
    caught = []
    for schedule in ("warp_ahead", "random", "in_order"):
        try:
            assert_close(run(harness.shim_backend(libs, schedule=schedule, seed=7)), ref, dtype)
        except (AssertionError, harness.KernelError) as exc:
            caught.append((schedule, type(exc).__name__))
    assert caught, f"mutation {name!r} went unnoticed under every schedule"


def test_self_check_keeps_attention_cu_when_the_fast_kernels_disagree(tmp_path, shim_libraries, caplog):
    """On a GPU the first fast launch per (device, dtype, head_dim) is checked against PyTorch; here the
    check is pointed at the shim. Correct kernels pass it; a broken build is caught, logged, and
    attention.cu serves the calls instead, with correct results."""
    k_pool, v_pool, tables, lens, gen = make_cache([1, 40, 150], 16, 2, 64, torch.float16, seed=2)
    query = torch.randn(3, 8, 64, generator=gen).half()
    ref = ta.decode_attention(query, k_pool, v_pool, tables, lens, 0.125)
    good = harness.shim_backend(shim_libraries)
    good.self_check_devices = ("cpu",)
    assert_close(good.decode_attention(query, k_pool, v_pool, tables, lens, 0.125), ref, torch.float16)
    assert reg.decode_fast_kernel("f16", 64).name in good.launcher.launches

    sources = tmp_path / "cuda"
    shutil.copytree(harness.CUDA_DIR, sources, ignore=shutil.ignore_patterns("__pycache__", "*.py", "*.cpp"))
    old, statement = MUTATIONS["decode: no wait for V"]
    text = (sources / reg.FAST_SOURCE).read_text()
    (sources / reg.FAST_SOURCE).write_text(text.replace(old, statement + old[old.index(";") + 1:]))
    broken = harness.build(sources_dir=sources, units=[(reg.FAST_SOURCE, 64, "")])
    libraries = harness.ShimLibraries({**shim_libraries, **broken}, shim_libraries.options)
    bad = harness.shim_backend(libraries)
    bad.self_check_devices = ("cpu",)
    with caplog.at_level("ERROR", logger="hf_paged.backends.cuda_backend"):
        out = bad.decode_attention(query, k_pool, v_pool, tables, lens, 0.125)
    assert "disagree with the PyTorch reference" in caplog.text and "decode, group 4" in caplog.text
    assert_close(out, ref, torch.float16)
    assert bad.launcher.launches[-1] == "hfp_decode_f16_d64"
