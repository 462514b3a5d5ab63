"""The quantised tensor-core extend (cuda/fast_quant_extend.cuh: codes and scales staged by cp.async, one
dequantise pass per tile into the tiles mma.sync reads) run through the CPU shim, for every format with
kernels, against the quantised PyTorch reference (hf_paged.backends.quantized_torch): ragged rows of prefix
+ chunk (pure prefill, chunked prefill, a one-token chunk, a long prefix), GQA groups 1/4/8, head dims
64/128, block sizes 16/32, with split-K and a sliding window, under two schedules. And the stronger check
the design allows: its output equals the model-dtype tensor-core kernel's over the dequantised pools, bit
for bit (the dequantised tiles are the same values, the mma loop the same code)."""
from __future__ import annotations

import pytest
import torch
from test_quantised_kernels import quantised_pools

import harness
from hf_paged import kv_formats
from hf_paged.backends import cuda_fast
from hf_paged.backends import kernel_registry as reg
from hf_paged.backends import quantized_torch as qt

ROWS = [(0, 37), (50, 30), (5, 1), (120, 17)]     # (prefix already stored, chunk of new query tokens)
CASES = [("int8", 64, torch.float16, 1, 16), ("int8", 128, torch.bfloat16, 8, 32),
         ("fp8_e4m3", 64, torch.bfloat16, 4, 32), ("fp8_e4m3", 128, torch.float16, 1, 16),
         ("fp8_e5m2", 64, torch.float16, 8, 16), ("fp8_e5m2", 128, torch.bfloat16, 4, 32),
         ("int4", 64, torch.bfloat16, 4, 16), ("int4", 128, torch.float16, 8, 32)]


def extend_case(fmt_name, head_dim, dtype, group, block_size, num_kv_heads=2, seed=0, rows=ROWS):
    """query [B, Hq, Q, D], quantised pools (and the same dequantised into dtype), tables, context
    lengths and query positions (-1 = pad) of ``rows``, in shuffled blocks no two rows share."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [p + c for p, c in rows]
    per_row = [-(-n // block_size) for n in lengths]
    num_blocks = sum(per_row) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(rows), max(per_row), dtype=torch.int32)
    taken = 0
    for row, n in enumerate(per_row):
        tables[row, :n] = perm[taken:taken + n]
        taken += n
    pools, plain = quantised_pools(kv_formats.FORMATS[fmt_name], num_kv_heads, num_blocks, block_size, head_dim,
                                   gen, dtype)
    q_len = max(c for _, c in rows)
    pos = torch.full((len(rows), q_len), -1, dtype=torch.int32)
    for row, (p, c) in enumerate(rows):
        pos[row, :c] = torch.arange(p, p + c)
    query = torch.randn(len(rows), num_kv_heads * group, q_len, head_dim, generator=gen).to(dtype)
    return query, pools, plain, tables, torch.tensor(lengths, dtype=torch.int32), pos


def _ids(c):
    return f"{c[0]}-d{c[1]}-{reg.DTYPE_TAGS[c[2]]}-g{c[3]}-bs{c[4]}"


VARIANTS = [("full", 0, None, "warp_ahead"), ("split64", 0, 64, "warp_ahead"), ("window9", 9, None, "warp_ahead")]
# every case under warp_ahead; the seeded random schedule too at head dim 64 (the cheap cases), every format
PARAMS = [(c, v) for c in CASES for v in VARIANTS + ([("full", 0, None, "random")] if c[1] == 64 else [])]


@pytest.mark.parametrize("case,variant", PARAMS, ids=[f"{_ids(c)}-{v[0]}-{v[3]}" for c, v in PARAMS])
def test_quantised_extend_matches_the_reference(shim_libraries, case, variant):
    _, window, partition, schedule = variant
    query, (k_pool, v_pool), _, tables, lens, pos = extend_case(*case)
    backend = harness.shim_backend(shim_libraries, schedule=schedule, seed=1, partition_size=partition)
    scale = case[1] ** -0.5
    out = backend.extend_attention(query, k_pool, v_pool, tables, lens, pos, scale, window).float()
    kernel = reg.ragged_kernel(reg.DTYPE_TAGS[case[2]], case[1], reg.KV_FORMAT_TAGS[case[0]]).name
    assert kernel in backend.launcher.launches, backend.launcher.launches
    assert (partition is not None) == any(n.startswith("hfp_merge_splits") for n in backend.launcher.launches)
    ref = qt.extend_attention(query, k_pool, v_pool, tables, lens, pos, scale, window).float()
    # 1.5 ulps of the output dtype at the largest output: the kernel rounds P to T for the PV mma and its
    # output once to T; the reference keeps P in fp32
    bound = 1.5 * (2 ** -7 if case[2] == torch.bfloat16 else 2 ** -10) * ref.abs().max().item()
    torch.testing.assert_close(out, ref, atol=bound, rtol=0)
    assert torch.all(out.transpose(1, 2)[pos < 0] == 0)              # pad query tokens give zeros
    # the check can fail: the reference over values scaled by 1.05 is out of bounds
    off = kv_formats.QuantizedPool(v_pool.data, v_pool.scales * 1.05, v_pool.fmt, v_pool.head_dim)
    wrong = qt.extend_attention(query, k_pool, off, tables, lens, pos, scale, window).float()
    assert (out - wrong).abs().max().item() > bound


@pytest.mark.parametrize("fmt_name", list(reg.KV_FORMAT_TAGS))
@pytest.mark.parametrize("partition", [None, 64], ids=["one-split", "split64"])
def test_equals_the_model_dtype_kernel_on_dequantised_pools(shim_libraries, fmt_name, partition):
    """Same tiles, same mma loop: the quantised kernel over the codes and hfp_ragged_<T> over
    kv_formats.dequantize(codes, T) give the same bits (tiles start at the same keys without a window)."""
    query, (k_pool, v_pool), (k_plain, v_plain), tables, _, pos = extend_case(fmt_name, 64, torch.bfloat16, 4, 16)
    backend = harness.shim_backend(shim_libraries, schedule="warp_ahead", partition_size=partition)
    flat = query.transpose(1, 2).reshape(-1, query.shape[1], query.shape[-1])
    rows = torch.arange(len(ROWS), dtype=torch.int32).repeat_interleave(query.shape[2])
    got = backend.ragged_attention(flat, k_pool, v_pool, tables, rows, pos.reshape(-1), 0.125)
    want = backend.ragged_attention(flat, k_plain, v_plain, tables, rows, pos.reshape(-1), 0.125)
    names = backend.launcher.launches
    assert reg.ragged_kernel("bf16", 64, reg.KV_FORMAT_TAGS[fmt_name]).name in names
    assert reg.ragged_kernel("bf16", 64).name in names
    assert torch.equal(got, want)
    assert got.abs().max() > 0


def test_eligibility():
    query = torch.zeros(3, 32, 64, dtype=torch.bfloat16)
    data, scales = torch.zeros(2, 4, 16, 64, dtype=torch.uint8), torch.ones(2, 4, 16, 8, dtype=torch.bfloat16)
    for name in ("nvfp4", "kivi", "int8", "int4"):
        pool = kv_formats.QuantizedPool(data, scales, kv_formats.kv_format(name), 64)
        assert cuda_fast.eligible_quantised_extend(query, pool) == (name in reg.KV_FORMAT_TAGS), name
        assert not cuda_fast.eligible_quantised_extend(query.float(), pool)        # fp32 queries: attention.cu
    assert not cuda_fast.eligible_quantised_extend(query, torch.zeros(2, 4, 16, 64, dtype=torch.bfloat16))


# --- mutations of the pipeline: each must make the kernel's output wrong on the shim ----------------------
MUTATIONS = {  # name: (statement as written in fast_quant_extend.cuh, with its comment; replacement statement)
    "no wait for the raw tile": ("cp_async_wait<2>();  // Q, K(t), V(t) have landed", "(void)0;"),
    "mma before the dequantised tiles are complete": ("__syncthreads();     // the T tiles are complete", "(void)0;"),
    "next tile dequantised while readers remain": ("__syncthreads();     // raw(t) visible to all", "(void)0;"),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_pipeline_mutations_are_caught(tmp_path, name):
    """A deleted cp.async wait or barrier: the shim's poisoned cp.async destinations (NaN until waited for)
    and the warp-ahead schedule turn it into a wrong output (or a reported error)."""
    import shutil  # noqa: PLC0415
    old, statement = MUTATIONS[name]
    sources = tmp_path / "cuda"
    shutil.copytree(harness.CUDA_DIR, sources, ignore=shutil.ignore_patterns("__pycache__", "*.py", "*.cpp"))
    header = sources / "fast_quant_extend.cuh"
    text = header.read_text()
    assert text.count(old) == 1, old
    header.write_text(text.replace(old, statement + old[old.index(";") + 1:]))   # line numbers kept
    libs = harness.build(sources_dir=sources, units=[(reg.FAST_SOURCE, 64, "int8")])
    query, (k_pool, v_pool), _, tables, lens, pos = extend_case("int8", 64, torch.float16, 4, 16)
    backend = harness.shim_backend(libs, schedule="warp_ahead")
    ref = qt.extend_attention(query, k_pool, v_pool, tables, lens, pos, 0.125).float()
    try:
        out = backend.extend_attention(query, k_pool, v_pool, tables, lens, pos, 0.125).float()
    except harness.KernelError:
        return                                        # the shim reported it (e.g. copies never waited for)
    assert backend.launcher.launches == [reg.ragged_kernel("f16", 64, "int8").name]
    assert not torch.allclose(out, ref, atol=1.5 * 2 ** -10 * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("fmt_name", list(reg.KV_FORMAT_TAGS))
def test_launch_arguments_match_the_kernel_signature(fmt_name):
    """Recorded, not run (recording_launcher): a 4k-token prompt, group 8, split-K, on an H200's limits —
    grid, shared memory, one numpy scalar of the right C type per parameter of the .cu signature, every
    pointer aligned as the kernel reads it."""
    from recording_launcher import RecordingLauncher  # noqa: PLC0415

    from hf_paged.backends.cuda_backend import CudaBackend  # noqa: PLC0415
    from hf_paged.backends.launch_checks import DeviceLimits  # noqa: PLC0415
    fmt = kv_formats.FORMATS[fmt_name]
    codes, scales = kv_formats.quantize(fmt, torch.zeros(2, 8, 16, 128))
    k_pool = v_pool = kv_formats.QuantizedPool(codes, scales, fmt, 128)
    query = torch.zeros(1, 16, 4096, 128, dtype=torch.bfloat16)
    tables = torch.zeros(1, 256, dtype=torch.int32)
    launcher = RecordingLauncher(DeviceLimits.for_arch("sm_90", sm_count=132))
    CudaBackend(launcher, partition_size=1024).extend_attention(
        query, k_pool, v_pool, tables, torch.tensor([4096], dtype=torch.int32),
        torch.arange(4096, dtype=torch.int32).view(1, -1), 0.1)
    names = [launch.name for launch in launcher.launches]
    assert names == [reg.ragged_kernel("bf16", 128, reg.KV_FORMAT_TAGS[fmt_name]).name, "hfp_merge_splits_bf16"]
    launch = launcher.launches[0]
    assert launch.shared_mem == reg.ragged_quant_smem_bytes(128, reg.KV_FORMAT_TAGS[fmt_name])
    assert launch.arg("head_slots") == 8 * 16 and launch.arg("partition") == 1024   # read from the .cu signature
    assert launch.grid[1] == 4 and launch.arg("k_codes") == codes.data_ptr()
