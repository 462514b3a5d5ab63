"""Quantised KV pools in the kernels (run by the CPU shim) against hf_paged.kv_formats and torch_backend.

- write: the quantising write kernel gives the codes and scales of ``kv_formats.quantize``, bit for bit.
- attention: decode (one split and split-K) and extend over pools quantised by ``kv_formats.quantize``
  match ``torch_backend`` run on the same pools dequantised by ``kv_formats.dequantize`` into the
  query's dtype, within the model-dtype tests' tolerances; and they equal, bit for bit, the model-dtype
  kernels run on those dequantised pools (the staging dequantises exactly, kv_quant.cuh, and all
  later arithmetic is shared).
- copy_blocks over codes, scales and model-dtype pools together, and its narrow-word fallbacks.

A covering design, as test_attention_kernels.py: each format under two head dims, dtypes, block sizes,
GQA ratios 1/4/7 and schedules (warp-ahead plus one other per case), not the full product. The shim
builds only the modules these cases launch (head dims 64 and 128, and int4 at 80, the one format and
head dim whose code rows are read in 8-byte words).
"""
from __future__ import annotations

import pytest
import torch

import harness
from hf_paged import kv_formats
from hf_paged.backends import kernel_registry as reg
from hf_paged.backends import torch_backend as ta
from test_attention_kernels import TOL, assert_close, cache_tables, extend_batch

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
FORMATS = list(reg.KV_FORMAT_TAGS)              # kv_formats names: fp8_e4m3, fp8_e5m2, int8, int4


@pytest.fixture(scope="module")
def libs(shim_libraries):
    """The shim libraries with this file's quantised modules built up front, two compiles at a time."""
    units = harness.quantised_units(head_dims=(64, 128)) + harness.quantised_units((80,), ("int4",))
    shim_libraries.update(harness.build(units=units, **shim_libraries.options))
    return shim_libraries


def fmt_of(name: str) -> kv_formats.KVFormat:
    return kv_formats.FORMATS[name]


def quantised_pools(fmt, num_kv_heads, num_blocks, block_size, head_dim, gen, dtype):
    """(k, v) QuantizedPools of random values (per-head magnitudes differ; some rows all zero) and the
    same pools dequantised into ``dtype`` (the reference's view)."""
    pools, plain = [], []
    for _ in range(2):
        x = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen)
        x *= torch.logspace(-1, 0, num_kv_heads).view(-1, 1, 1, 1)   # magnitudes the tolerances are for
        x[:, 0, 1] = 0                                   # all-zero rows: scale 1
        codes, scales = kv_formats.quantize(fmt, x.to(dtype))
        pools.append(kv_formats.QuantizedPool(codes, scales, fmt, head_dim))
        plain.append(kv_formats.dequantize(fmt, codes, scales, dtype))
    return pools, plain


# -- write -------------------------------------------------------------------------------------------
def awkward_values(n, heads, head_dim, gen):
    """[n, heads, head_dim] fp32 values that reach every code path of the encoders: rows over six
    decades, an all-zero row, a constant group, a huge outlier beside tiny values (fp8 subnormal codes,
    int codes rounding to 0), negative zeros, exact halves under a scale of 1 (round-to-even ties of
    int8 and int4), a row of equal magnitudes."""
    x = torch.randn(n, heads, head_dim, generator=gen) * torch.logspace(-3, 3, n).view(-1, 1, 1)
    x[0, 0] = 0
    x[1, 0, :16] = 0.75
    x[1, -1] = -x[1, -1].abs()
    x[2, 0] = torch.randn(head_dim, generator=gen) * 1e-4
    x[2, 0, 3] = 500.0
    x[3, 0, ::2] = -0.0
    x[3, 0, 1::2] = torch.linspace(-126.5, 125.5, head_dim // 2).round() + 0.5    # ties
    x[3, 0, 0] = 127.0                                                             # int8 scale 1
    x[4, 0] = torch.where(torch.rand(head_dim, generator=gen) < 0.5, -1.0, 1.0) * 3.0
    x[5, 0, :16] = torch.tensor([0.0, 15.0, *(k + 0.5 for k in range(14))])        # int4 scale 1, ties
    return x


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("name", FORMATS)
def test_write_kv_quantises_as_kv_formats(shim_libraries, name, dtype):
    fmt = fmt_of(name)
    gen = torch.Generator().manual_seed(len(name) + dtype.itemsize)
    heads, blocks, block_size = 3, 5, 8
    for head_dim in (64, 80):                               # 80: int4 groups in 8-byte code words
        k_pool = kv_formats.QuantizedPool.zeros(fmt, heads, blocks, block_size, head_dim, torch.device("cpu"))
        v_pool = kv_formats.QuantizedPool.zeros(fmt, heads, blocks, block_size, head_dim, torch.device("cpu"))
        for t in (*k_pool.tensors, *v_pool.tensors):
            t.view(torch.uint8).fill_(0x5a)                  # untouched slots keep this
        expected = [t.clone() for t in (*k_pool.tensors, *v_pool.tensors)]
        n = 12
        key = awkward_values(n, heads, head_dim, gen).to(dtype)
        value = (awkward_values(n, heads, head_dim, gen).flip(0) * 7).to(dtype)
        value = value.transpose(0, 1).contiguous().transpose(0, 1)   # strided [N, Hkv, D]
        slots = torch.tensor([3, -1, 39, 8, 9, 0, -1, 21, 22, 30, 31, 12], dtype=torch.int64)
        keep = slots >= 0
        for x, (codes, scales) in zip((key, value), (expected[:2], expected[2:])):
            want_codes, want_scales = kv_formats.quantize(fmt, x[keep])          # [n', Hkv, ...]
            codes.view(heads, -1, codes.shape[-1])[:, slots[keep]] = want_codes.transpose(0, 1)
            scales.view(heads, -1, scales.shape[-1])[:, slots[keep]] = want_scales.transpose(0, 1)
        backend = harness.shim_backend(shim_libraries, schedule="random")
        backend.write_kv(k_pool, v_pool, key, value, slots)
        assert backend.launcher.launches == [f"hfp_write_kv_{reg.KV_FORMAT_TAGS[name]}_{reg.DTYPE_TAGS[dtype]}"]
        for got, want, what in zip((*k_pool.tensors, *v_pool.tensors), expected,
                                   ("key codes", "key scales", "value codes", "value scales")):
            mismatch = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero()
            assert mismatch.numel() == 0, f"head_dim {head_dim}: {what} differ at {mismatch[:5].tolist()}"


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_write_kv_searches_the_fp8_scale_as_kv_formats(shim_libraries, name):
    """The write kernel's scale search (kv_quant.cuh searched_scale: one warp per row, an int64 warp sum)
    picks kv_formats.quantize's scale and codes bit for bit on the search's edge cases (fp32 states)."""
    from test_cpu_kernel_quant import scale_search_rows
    fmt = fmt_of(name)
    heads, blocks, block_size, n = 2, 4, 8, 16
    for head_dim in (64, 128):
        pools = [kv_formats.QuantizedPool.zeros(fmt, heads, blocks, block_size, head_dim, torch.device("cpu"))
                 for _ in range(2)]
        key = scale_search_rows(n, heads, head_dim, seed=head_dim)
        value = -key.flip(0)
        slots = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(1))[:n]
        harness.shim_backend(shim_libraries, schedule="random").write_kv(pools[0], pools[1], key, value, slots)
        for pool, x in zip(pools, (key, value)):
            want_codes, want_scales = kv_formats.quantize(fmt, x)
            got_codes = pool.data.view(heads, -1, head_dim)[:, slots].transpose(0, 1)
            got_scales = pool.scales.view(heads, -1, 1)[:, slots].transpose(0, 1)
            assert torch.equal(got_codes, want_codes), f"head_dim {head_dim}: codes differ"
            assert torch.equal(got_scales.view(torch.int16), want_scales.view(torch.int16)), f"head_dim {head_dim}"


def test_write_kv_refuses_mismatched_pools(shim_libraries):
    cpu = torch.device("cpu")
    k_pool = kv_formats.QuantizedPool.zeros(fmt_of("int8"), 2, 4, 8, 64, cpu)
    v_pool = kv_formats.QuantizedPool.zeros(fmt_of("fp8_e4m3"), 2, 4, 8, 64, cpu)
    key = torch.zeros(1, 2, 64)
    backend = harness.shim_backend(shim_libraries)
    with pytest.raises(ValueError, match="one format and shape"):
        backend.write_kv(k_pool, v_pool, key, key, torch.tensor([0]))
    with pytest.raises(ValueError, match=r"\[N, 2, 64\]"):
        backend.write_kv(k_pool, k_pool, torch.zeros(1, 2, 32), torch.zeros(1, 2, 32), torch.tensor([0]))


# -- attention ---------------------------------------------------------------------------------------
DECODE_CASES = [  # format, head_dim, block_size, dtype, (Hq, Hkv), other schedule, window
    ("fp8_e4m3", 64, 16, F16, (8, 2), "reverse", 0),
    ("fp8_e4m3", 128, 32, BF16, (7, 1), "random", 40),
    ("fp8_e5m2", 64, 8, BF16, (3, 3), "random", 0),
    ("fp8_e5m2", 128, 16, F32, (8, 2), "in_order", 5),
    ("int8", 64, 32, F32, (7, 1), "in_order", 0),
    ("int8", 128, 8, F16, (3, 3), "reverse", 40),
    ("int4", 64, 16, BF16, (14, 2), "reverse", 0),
    ("int4", 128, 32, F16, (8, 2), "random", 0),
    ("int4", 80, 8, F32, (4, 1), "in_order", 5),
]


def case_id(c):
    return f"{reg.KV_FORMAT_TAGS[c[0]]}-d{c[1]}-b{c[2]}-{reg.DTYPE_TAGS[c[3]]}-q{c[4][0]}kv{c[4][1]}-w{c[-1]}"


@pytest.mark.parametrize("name,head_dim,block_size,dtype,heads,other,window", DECODE_CASES,
                         ids=[case_id(c) for c in DECODE_CASES])
def test_quantised_decode_matches_torch(libs, name, head_dim, block_size, dtype, heads, other, window):
    num_q_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(head_dim + block_size)
    lengths = [0, 1, block_size - 1, block_size, block_size + 1, 237]
    num_blocks, tables, lens = cache_tables(lengths, block_size, gen)
    (k_pool, v_pool), (k_ref, v_ref) = quantised_pools(fmt_of(name), num_kv_heads, num_blocks, block_size,
                                                       head_dim, gen, dtype)
    query = torch.randn(len(lengths), num_q_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    ref = ta.decode_attention(query, k_ref, v_ref, tables, lens, scale, sliding_window=window)
    kernel = f"hfp_decode_{reg.KV_FORMAT_TAGS[name]}_{reg.DTYPE_TAGS[dtype]}_d{head_dim}"
    for schedule in ("warp_ahead", other):
        for partition in (None, 64):  # one split for most rows, then split-K with the merge kernel
            # attention.cu's quantised decode (fp16/bf16 queries with groups <= 4 are routed to the quantised
            # fast decode by default: test_fast_quant_routing.py); it serves the rest and the self-check
            backend = harness.shim_backend(libs, schedule=schedule, partition_size=partition, fast_kernels=False)
            out = backend.decode_attention(query, k_pool, v_pool, tables, lens, scale, sliding_window=window)
            launched = list(backend.launcher.launches)
            assert_close(out, ref, dtype)
            assert launched[0] == kernel
            if partition == 64 and not window:
                assert launched[1:] == [f"hfp_decode_reduce_{reg.DTYPE_TAGS[dtype]}"]
            if schedule == other:   # attention.cu on the dequantised pools: the compute the formats share
                plain = harness.shim_backend(libs, schedule=schedule, partition_size=partition, fast_kernels=False)
                assert torch.equal(out, plain.decode_attention(query, k_ref, v_ref, tables, lens, scale,
                                                               sliding_window=window))


EXTEND_CASES = [  # format, head_dim, block_size, dtype, (Hq, Hkv), other schedule
    ("fp8_e4m3", 128, 8, F32, (8, 2), "in_order"),
    ("fp8_e5m2", 64, 32, F16, (7, 1), "reverse"),
    ("int8", 64, 16, BF16, (3, 3), "random"),
    ("int8", 128, 32, F32, (8, 2), "reverse"),
    ("int4", 128, 16, BF16, (14, 2), "in_order"),
    ("int4", 64, 8, F16, (4, 1), "random"),
]


@pytest.mark.parametrize("name,head_dim,block_size,dtype,heads,other", EXTEND_CASES,
                         ids=[case_id((*c, 0))[:-3] for c in EXTEND_CASES])
def test_quantised_extend_matches_torch(libs, name, head_dim, block_size, dtype, heads, other):
    num_q_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(head_dim * block_size)
    # prefill, continuation after a block boundary, one new token, a pad-only row, a long prefill
    befores = [0, block_size + 1, 40, 0, 0]
    news = [9, 7, 1, 0, 37]
    q_len = 37
    pos = extend_batch(befores, news, q_len, left_pad=[True, False, True, False, False])
    num_blocks, tables, lens = cache_tables([b + n for b, n in zip(befores, news)], block_size, gen)
    (k_pool, v_pool), (k_ref, v_ref) = quantised_pools(fmt_of(name), num_kv_heads, num_blocks, block_size,
                                                       head_dim, gen, dtype)
    query = torch.randn(len(befores), num_q_heads, q_len, head_dim, generator=gen).to(dtype)
    for window, schedule in ((0, "warp_ahead"), (6, other)):
        ref = ta.extend_attention(query, k_ref, v_ref, tables, lens, pos, head_dim ** -0.5, sliding_window=window)
        # attention.cu's quantised extend (fp16/bf16 queries otherwise take the tensor-core one:
        # test_fast_quant_extend.py)
        backend = harness.shim_backend(libs, schedule=schedule, fast_kernels=False)
        out = backend.extend_attention(query, k_pool, v_pool, tables, lens, pos, head_dim ** -0.5,
                                       sliding_window=window)
        assert_close(out, ref, dtype)
        plain = harness.shim_backend(libs, schedule=schedule, fast_kernels=False).extend_attention(
            query, k_ref, v_ref, tables, lens, pos, head_dim ** -0.5, sliding_window=window)
        assert torch.equal(out, plain)
        assert backend.launcher.launches[:1] == [
            f"hfp_extend_{reg.KV_FORMAT_TAGS[name]}_{reg.DTYPE_TAGS[dtype]}_d{head_dim}"]


@pytest.mark.parametrize("name", ["fp8_e4m3", "int4"])
def test_write_then_attend(libs, name):
    """The write kernel's pools read by the attention kernels: the layouts agree end to end."""
    fmt, dtype, head_dim, block_size = fmt_of(name), BF16, 64, 16
    gen = torch.Generator().manual_seed(7)
    cpu = torch.device("cpu")
    pools = [kv_formats.QuantizedPool.zeros(fmt, 2, 6, block_size, head_dim, cpu) for _ in range(2)]
    n = 70
    key, value = (torch.randn(n, 2, head_dim, generator=gen).to(dtype) for _ in range(2))
    slots = torch.cat([torch.arange(32, 64), torch.arange(16, 32), torch.arange(64, 86)])   # blocks 2, 3, 1, 4, 5
    backend = harness.shim_backend(libs, schedule="warp_ahead", partition_size=32)
    backend.write_kv(*pools, key, value, slots)
    tables = torch.tensor([[2, 3, 1, 4, 5]], dtype=torch.int32)
    lens = torch.tensor([n], dtype=torch.int32)
    query = torch.randn(1, 8, head_dim, generator=gen).to(dtype)
    ref_pools = [kv_formats.dequantize(fmt, p.data, p.scales, dtype) for p in pools]
    ref = ta.decode_attention(query, *ref_pools, tables, lens, 0.125)
    assert_close(backend.decode_attention(query, *pools, tables, lens, 0.125), ref, dtype)
    # and the reference pools hold what was written, within the format's error
    written = ref_pools[0].view(2, -1, head_dim)[:, slots].transpose(0, 1).float()
    bound = {"fp8_e4m3": 0.07, "int4": 0.2}[name] * key.float().abs().amax(-1, keepdim=True)
    assert ((written - key.float()).abs() <= bound).all()


def test_quantised_refusals(libs):
    cpu = torch.device("cpu")
    query = torch.zeros(1, 4, 64)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    backend = harness.shim_backend(libs)
    k_pool = kv_formats.QuantizedPool.zeros(fmt_of("int8"), 2, 2, 16, 64, cpu)
    with pytest.raises(ValueError, match="float16"):
        backend.decode_attention(query.double(), k_pool, k_pool, tables, lens, 1.0)
    with pytest.raises(ValueError, match="one format and shape"):
        backend.decode_attention(query, k_pool, torch.zeros(2, 2, 16, 64), tables, lens, 1.0)
    odd = kv_formats.QuantizedPool.zeros(fmt_of("int8"), 2, 2, 16, 72, cpu)
    with pytest.raises(ValueError, match=r"supported: \(64, 80, 96, 128, 256\)"):
        backend.decode_attention(torch.zeros(1, 4, 72), odd, odd, tables, lens, 1.0)
    with pytest.raises(ValueError, match="groups of 16"):
        reg.check_attention_shape(F16, 72, 16, 4, 2, fmt_of("int4"))
    bad = kv_formats.QuantizedPool(k_pool.data[:, :, :, :32], k_pool.scales, k_pool.fmt, 64)
    with pytest.raises(ValueError, match="contiguous torch.uint8 tensor"):
        backend.extend_attention(query.unsqueeze(2), bad, bad, tables, lens, torch.zeros(1, 1, dtype=torch.int32),
                                 1.0)


# -- copy_blocks -------------------------------------------------------------------------------------
def test_copy_blocks_codes_scales_and_model_pools(shim_libraries):
    """Every layer's codes and scales (int4 and int8 layers) with model-dtype pools: one launch per
    (shape, dtype size), all in 16-byte words at block size 16."""
    gen = torch.Generator().manual_seed(3)
    cpu = torch.device("cpu")
    pools = []
    for name in ("int4", "int4", "int8"):
        for _ in range(2):
            p = kv_formats.QuantizedPool.zeros(fmt_of(name), 2, 9, 16, 64, cpu)
            p.data.copy_(torch.randint(0, 256, p.data.shape, generator=gen))
            p.scales.copy_(torch.randn(p.scales.shape, generator=gen))
            pools += p.tensors
    pools += [torch.randn(2, 9, 16, 64, generator=gen).half() for _ in range(2)]
    expected = [p.clone() for p in pools]
    pairs = torch.tensor([[0, 5], [3, 7], [0, 8]], dtype=torch.int64)
    ta.copy_blocks(expected, pairs)
    backend = harness.shim_backend(shim_libraries, schedule="reverse")
    backend.copy_blocks(pools, pairs)
    # groups: int4 codes [2, 9, 16, 32] u8, int4 scales [.., 8] bf16, int8 codes [.., 64] u8,
    # int8 scales [.., 1] bf16, f16 pools [.., 64]
    assert backend.launcher.launches == ["hfp_copy_blocks"] * 5
    for got, want in zip(pools, expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("block_size,offset,kernel", [(2, 0, "hfp_copy_blocks_w4"),   # 4-byte scale tiles
                                                      (3, 0, "hfp_copy_blocks_w1"),   # 6-byte scale tiles
                                                      (8, 2, "hfp_copy_blocks_w1"),   # a 2-byte aligned view
                                                      (8, 4, "hfp_copy_blocks_w4")])  # a 4-byte aligned view
def test_copy_blocks_narrow_words(shim_libraries, block_size, offset, kernel):
    """Tiles or pool addresses that are not multiples of 16 bytes are copied in 4- or 1-byte words."""
    gen = torch.Generator().manual_seed(block_size + offset)
    shape = (2, 9, block_size, 1)                                       # 8-bit formats' scales
    storage = [torch.randn(offset // 2 + 2 * 9 * block_size, generator=gen).to(BF16) for _ in range(3)]
    pools = [s[offset // 2:].view(shape) for s in storage]
    expected = [p.clone() for p in pools]
    before = [s[:offset // 2].clone() for s in storage]
    pairs = torch.tensor([[1, 4], [2, 6]], dtype=torch.int64)
    ta.copy_blocks(expected, pairs)
    backend = harness.shim_backend(shim_libraries, schedule="random")
    backend.copy_blocks(pools, pairs)
    assert backend.launcher.launches == [kernel]
    for got, want, s, prefix in zip(pools, expected, storage, before):
        assert torch.equal(got, want) and torch.equal(s[:offset // 2], prefix)
