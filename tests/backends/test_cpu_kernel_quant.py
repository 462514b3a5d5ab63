"""The CPU kernel over quantised pools (torch.ops.hf_paged_cpu.paged_attention_quant, cuda/paged_attention_cpu_quant.cpp)
against the PyTorch reference (hf_paged.backends.quantized_torch) and the codec (hf_paged.kv_formats, hf_paged.kivi).

- the row dequantisers, SIMD and scalar, against kv_formats.dequantize: every fp8 code, awkward values,
  scales read through the layout (several 8-bit scales per row, as a finer scale granularity would store);
- decode, extend and packed steps per format: GQA 1..16, block sizes 1..32, ragged lengths, windows,
  pads, rows sharing blocks (copy-on-write prefixes), the rotation through Step.attend;
- KIVI (hf_paged.kivi's read rule): a packed step whose queries read their own block from an open slot, from
  the rows the step's write sealed (a block open before it, a block started and filled by it) or, gone, from
  codes, earlier blocks from codes and sink rows; GQA 1..4 (prefill items aligned to blocks), windows, rows
  sharing sealed blocks and a copied (CoW) open block; negative controls (fresh rows or sinks dropped);
- routing (quantised pools reach the quantised op) and refusals that name the problem.
"""
from __future__ import annotations

import pytest
import torch
from test_attention_kernels import DTYPES, assert_close, packed_case

from hf_paged import kv_formats
from hf_paged.backends import cpu_backend, quantized_torch
from hf_paged.backends import cpp_build
from hf_paged.backends import torch_backend as ta
from hf_paged.backends.synthetic import assign_blocks
from hf_paged.kivi import KiviPool

FORMATS = list(cpu_backend.FORMAT_IDS)          # the row formats the kernel reads: int8, fp8_e4m3, fp8_e5m2, int4, nvfp4
HEADS = [(3, 3), (8, 2), (14, 2), (16, 1)]      # GQA 1, 4, 7, 16


@pytest.fixture(scope="module")
def backend():
    return cpu_backend.make_backend()


def quantised_pool(fmt, shape, gen, rotation=None):
    """A QuantizedPool of random values [Hkv, blocks, BS, D] (per-head magnitudes, one all-zero row)."""
    x = torch.randn(*shape, generator=gen) * torch.logspace(-1, 0, shape[0]).view(-1, 1, 1, 1)   # the tolerances' scale
    x[:, 0, 0] = 0
    codes, scales = kv_formats.quantize(fmt, x)
    return kv_formats.QuantizedPool(codes, scales, fmt, shape[-1], rotation)


def shared_tables(lengths, block_size, gen, shared=1):
    """Shuffled tables where every other row starts with the longest row's first ``shared`` blocks (a
    prefix shared copy-on-write: one physical block in several tables); (num_blocks, tables, lens)."""
    blocks = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks) + 2
    tables = assign_blocks(torch.randperm(num_blocks, generator=gen), blocks)
    source = max(range(len(lengths)), key=lambda r: blocks[r])
    for row in range(len(lengths)):
        take = min(shared, blocks[row], blocks[source] - 1)
        if row != source and take > 0:
            tables[row, :take] = tables[source, :take]
    return num_blocks, tables, torch.tensor(lengths, dtype=torch.int32)


# -- the row dequantisers -----------------------------------------------------------------------------
@pytest.mark.parametrize("simd", [True, False], ids=["simd", "scalar"])
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("head_dim", [64, 80, 48])
def test_rows_dequantise_as_kv_formats(backend, name, head_dim, simd):
    fmt = kv_formats.FORMATS[name]
    gen = torch.Generator().manual_seed(head_dim)
    x = torch.randn(37, head_dim, generator=gen) * torch.logspace(-4, 3, 37).view(-1, 1)
    x[0] = 0
    x[1, 5] = 1e4                                   # outlier: tiny codes, fp8 subnormals
    codes, scales = kv_formats.quantize(fmt, x)
    out = torch.ops.hf_paged_cpu.dequantize_rows(codes, scales, cpu_backend.FORMAT_IDS[name], head_dim, simd)
    ref = kv_formats.dequantize(fmt, codes, scales, torch.float32)
    if fmt.asymmetric:     # code * scale + minimum: the SIMD path fuses it (one rounding, within 1 ulp)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))
    else:                  # code * scale: one rounding either way, bit-exact
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("simd", [True, False], ids=["simd", "scalar"])
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_every_finite_fp8_code(backend, name, simd):
    fmt = kv_formats.FORMATS[name]
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.float_codes).float()
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)[values.isfinite()]
    codes = torch.cat([codes, codes.new_zeros(-len(codes) % 16)]).view(-1, 16)
    scales = torch.tensor([1.0, 0.5, 3.0, -2.0], dtype=torch.bfloat16).repeat(codes.shape[0] // 4 + 1)[:codes.shape[0], None]
    out = torch.ops.hf_paged_cpu.dequantize_rows(codes, scales, cpu_backend.FORMAT_IDS[name], 16, simd)
    torch.testing.assert_close(out, kv_formats.dequantize(fmt, codes, scales, torch.float32), rtol=0, atol=0)


@pytest.mark.parametrize("simd", [True, False], ids=["simd", "scalar"])
def test_scales_are_read_through_the_layout(backend, simd):
    """Four int8 scales per row (groups of 16 of head_dim 64): element i uses scale i // 16; and KIVI keys
    with per-channel scales and minima."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(-127, 128, (9, 64), generator=gen, dtype=torch.int8).view(torch.uint8)
    scales = torch.rand(9, 4, generator=gen).to(torch.bfloat16)
    out = torch.ops.hf_paged_cpu.dequantize_rows(codes, scales, 0, 64, simd)
    ref = codes.view(torch.int8).float() * scales.float().repeat_interleave(16, dim=1)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    nibbles = torch.randint(0, 16, (9, 64), generator=gen, dtype=torch.uint8)
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    channel = torch.rand(2, 64, generator=gen).to(torch.bfloat16)
    out = torch.ops.hf_paged_cpu.dequantize_rows(packed, channel, cpu_backend.KIVI_KEY_ID, 64, simd)
    ref = nibbles.float() * channel[0].float() + channel[1].float()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


# -- attention ----------------------------------------------------------------------------------------
CASES = [pytest.param(name, d, bs, DTYPES[i % 3], HEADS[i % len(HEADS)], (0, 5)[i % 2],
                      id=f"{name}-d{d}-b{bs}-{str(DTYPES[i % 3])[6:]}-q{HEADS[i % 4][0]}kv{HEADS[i % 4][1]}")
         for i, (name, d, bs) in enumerate((n, d, bs) for n in FORMATS for d, bs in [(64, 16), (80, 1), (128, 8), (64, 32)])]


@pytest.mark.parametrize("name,head_dim,block_size,dtype,heads,window", CASES)
def test_decode_matches_the_reference(backend, name, head_dim, block_size, dtype, heads, window):
    fmt, (num_q, num_kv) = kv_formats.FORMATS[name], heads
    gen = torch.Generator().manual_seed(head_dim * block_size)
    lengths = [0, 1, block_size + 1, 3 * block_size + 5, 97]
    num_blocks, tables, lens = shared_tables(lengths, block_size, gen, shared=2)
    k, v = (quantised_pool(fmt, (num_kv, num_blocks, block_size, head_dim), gen) for _ in range(2))
    query = torch.randn(len(lengths), num_q, head_dim, generator=gen).to(dtype)
    out = backend.decode_attention(query, k, v, tables, lens, head_dim ** -0.5, window)
    ref = quantized_torch.decode_attention(query, k, v, tables, lens, head_dim ** -0.5, window)
    assert_close(out, ref, dtype)
    assert torch.all(out[0] == 0), "a row with no stored tokens gives zeros"


@pytest.mark.parametrize("name,head_dim,block_size,dtype,heads,window", CASES[::2])
def test_extend_matches_the_reference(backend, name, head_dim, block_size, dtype, heads, window):
    """Rows with earlier context (sharing the longest row's first block), left pads and causal new tokens."""
    fmt, (num_q, num_kv) = kv_formats.FORMATS[name], heads
    gen = torch.Generator().manual_seed(7 * head_dim + block_size)
    befores, news, q_len = [0, 3, block_size + 2, 40], [5, 1, 7, 12], 12
    lengths = [b + n for b, n in zip(befores, news)]
    num_blocks, tables, lens = shared_tables(lengths, block_size, gen)
    k, v = (quantised_pool(fmt, (num_kv, num_blocks, block_size, head_dim), gen) for _ in range(2))
    query_pos = torch.full((len(lengths), q_len), -1, dtype=torch.int32)
    for row, (before, new) in enumerate(zip(befores, news)):
        query_pos[row, q_len - new:] = torch.arange(before, before + new, dtype=torch.int32)
    query = torch.randn(len(lengths), num_q, q_len, head_dim, generator=gen).to(dtype)
    out = backend.extend_attention(query, k, v, tables, lens, query_pos, 0.3, window)
    ref = quantized_torch.extend_attention(query, k, v, tables, lens, query_pos, 0.3, window)
    assert_close(out, ref, dtype)
    assert torch.all(out[0, :, :q_len - news[0]] == 0), "pad queries give zeros"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FORMATS)
def test_packed_rotated_step_matches_the_torch_step(backend, name, dtype):
    """A packed engine step (decodes, a fresh prompt, a chunk after a prefix) on rotated pools through
    Step.attend: the query is rotated once and the output unrotated once, as on the PyTorch path."""
    fmt = kv_formats.FORMATS[name]
    spec = [(5, 1), (16, 1), (30, 1), (0, 13), (9, 20)]
    plan, k_plain, v_plain, query = packed_case(spec, 8, 6, 2, 64, dtype, seed=11)
    rotation = kv_formats.rotation_matrix(64)
    k, v = (kv_formats.QuantizedPool(*kv_formats.quantize(fmt, p.float() @ rotation), fmt, 64, rotation)
            for p in (k_plain, v_plain))
    out = backend.prepare(plan).attend(query, k, v, 0.125, 0)
    ref = ta.TorchBackend().prepare(plan).attend(query, k, v, 0.125, 0)
    assert_close(out, ref, dtype)
    assert (out.float() - ta.TorchBackend().prepare(plan).attend(query, k_plain, v_plain, 0.125, 0).float()).abs().max() \
        < (0.5 if fmt.bits == 4 else 0.2), "the rotated quantised step approximates the model-dtype one"


@pytest.mark.parametrize("head_dim", [64, 80], ids=["hadamard", "orthogonal"])
def test_the_kernel_rotates_the_query_itself(backend, monkeypatch, head_dim):
    """Rotated pools on the CPU kernel: no PyTorch rotation per layer (the op rotates each query row once and
    unrotates each output row once: the fast Hadamard transform at head_dim 64, the general product at 80)."""
    fmt, rotation = kv_formats.FORMATS["int8"], kv_formats.rotation_matrix(head_dim)
    plan, k_plain, v_plain, query = packed_case([(7, 1), (0, 9)], 8, 4, 2, head_dim, torch.float32, seed=2)
    k, v = (kv_formats.QuantizedPool(*kv_formats.quantize(fmt, p @ rotation), fmt, head_dim, rotation)
            for p in (k_plain, v_plain))
    ref = ta.TorchBackend().prepare(plan).attend(query, k, v, 0.125, 0)

    def refuse(*args):
        raise AssertionError("rotated in PyTorch")
    monkeypatch.setattr(kv_formats.QuantizedPool, "rotate", refuse)
    monkeypatch.setattr(kv_formats.QuantizedPool, "unrotate", refuse)
    assert_close(backend.prepare(plan).attend(query, k, v, 0.125, 0), ref, torch.float32)


def kivi_pools(lengths, num_kv, head_dim, dtype, gen, open_capacity=2):
    """KIVI pools holding ``lengths`` tokens per row written through KiviPool.write (full blocks sealed, the
    last partial block of each row in an open slot; the store grows past ``open_capacity``)."""
    bs = kv_formats.KIVI_BLOCK_SIZE
    num_blocks, tables, lens = shared_tables(lengths, bs, gen, shared=0)
    k = KiviPool.new(True, num_kv, num_blocks, bs, head_dim, dtype, "cpu", open_capacity)
    v = KiviPool.new(False, num_kv, num_blocks, bs, head_dim, dtype, "cpu", open_capacity)
    for row, n in enumerate(lengths):
        slots = torch.tensor([int(tables[row, j // bs]) * bs + j % bs for j in range(n)], dtype=torch.int64)
        for pool in (k, v):
            pool.write(torch.randn(n, num_kv, head_dim, generator=gen).to(dtype), slots, torch.arange(n))
    return k, v, tables, lens


@pytest.mark.parametrize("dtype", DTYPES)
def test_kivi_sealed_and_open_blocks(backend, dtype):
    gen = torch.Generator().manual_seed(5)
    k, v, tables, lens = kivi_pools([0, 7, 32, 70, 100], 2, 64, dtype, gen)
    assert int((k.open.block_slot >= 0).sum()) == 3, "rows of 7, 70 and 100 tokens end in open blocks"
    query = torch.randn(5, 8, 64, generator=gen).to(dtype)
    out = backend.decode_attention(query, k, v, tables, lens, 0.125, 0)
    assert_close(out, quantized_torch.decode_attention(query, k, v, tables, lens, 0.125, 0), dtype)
    # Copy-on-write of row 3's open block into a spare block that row 2 then reads as its second block.
    src = int(tables[3, 2])
    dst = sorted(set(range(k.data.shape[1])) - set(tables.flatten().tolist()))[0]      # a spare block
    for pool in (k, v):
        pool.data[:, dst], pool.scales[:, dst] = pool.data[:, src], pool.scales[:, src]
        pool.copy_open([(src, dst)])
    tables2 = torch.cat([tables, torch.zeros(5, 1, dtype=torch.int32)], 1)
    tables2[2, 1] = dst
    lens2 = lens.clone()
    lens2[2] = 32 + 70 - 64
    query_pos = torch.arange(int(lens2[2]) - 4, int(lens2[2]), dtype=torch.int32).repeat(5, 1)
    query_pos[[0, 1, 3, 4]] = -1
    q4 = torch.randn(5, 8, 4, 64, generator=gen).to(dtype)
    out = backend.extend_attention(q4, k, v, tables2, lens2, query_pos, 0.125, 0)
    assert_close(out, quantized_torch.extend_attention(q4, k, v, tables2, lens2, query_pos, 0.125, 0), dtype)


# Rows (tokens stored before the step, tokens of the step), decode rows first, and where each query's own block
# is: 0 an open slot; 1 sealed from its slot by the step (open before); 2 after a write of 30 that seals block 0
# (open before) and opens block 1; 3 a fresh prompt of 70 (blocks 0, 1 started and sealed by the write, block 2
# open); 4 blocks sealed earlier, block 2 open; 5 shares row 4's sealed blocks 0 and 1 and holds a CoW copy of
# its open block 2; 6 block 1 (8 rows before) sealed by the step. Every row's block 0 holds a sink.
KIVI_STEP = [(33, 1), (31, 1), (10, 30), (0, 70), (70, 5), (70, 3), (40, 24)]


def kivi_step(num_q, num_kv, head_dim, dtype, seed, rotation=None):
    """KIVI pools after earlier writes (one per row) and the step's one packed write, and the step's plan and
    queries: (k, v, plan, query [T, Hq, D]). ``rotation``: the value pool's R (its rows are taken as stored)."""
    from hf_paged.blocks import BlockTable
    from hf_paged.plan import packed_plan
    bs = kv_formats.KIVI_BLOCK_SIZE
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(b + n) // bs) for b, n in KIVI_STEP]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [order[sum(need[:r]):sum(need[:r + 1])] for r in range(len(need))]
    tables[5][:2] = tables[4][:2]                               # shared sealed blocks (a forked prefix)
    k, v = (KiviPool.new(is_key, num_kv, num_blocks, bs, head_dim, dtype, "cpu", 2, rotation=None if is_key else rotation)
            for is_key in (True, False))

    def write(rows_tokens):
        slots = torch.tensor([tables[r][p // bs] * bs + p % bs for r, p in rows_tokens], dtype=torch.int64)
        positions = torch.tensor([p for _, p in rows_tokens])
        for pool in (k, v):                                    # GQA heads differ in magnitude; keys get outliers
            x = torch.randn(len(slots), num_kv, head_dim, generator=gen) * torch.logspace(-0.5, 0.5, num_kv).view(1, -1, 1)
            x[:, :, 3] += 4 * pool.is_key
            pool.write(x.to(dtype), slots, positions)

    for row, (before, _) in enumerate(KIVI_STEP):
        if before and row != 5:
            write([(row, p) for p in range(before)])
    src, dst = tables[4][2], tables[5][2]
    for pool in (k, v):                                        # copy-on-write of row 4's open block for row 5
        pool.data[:, dst], pool.scales[:, dst] = pool.data[:, src], pool.scales[:, src]
        pool.copy_open([(src, dst)])
    write([(row, p) for row, (before, new) in enumerate(KIVI_STEP) for p in range(before, before + new)])
    entries = [(BlockTable(tables[r], b + n), b, n) for r, (b, n) in enumerate(KIVI_STEP)]
    plan = packed_plan(entries, bs, torch.device("cpu"))
    query = torch.randn(plan.num_tokens, num_q, head_dim, generator=gen).to(dtype)
    return k, v, plan, query


@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("heads", [(8, 2), (3, 1), (2, 2)], ids=["gqa4", "gqa3", "mha"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kivi_reads_follow_the_position_rule(backend, dtype, heads, window):
    """The kernel equals the PyTorch path on a packed step over every source of a KIVI row; dropping the
    step's fresh rows or the sinks changes both (the test sees them)."""
    (num_q, num_kv), head_dim = heads, 64
    k, v, plan, query = kivi_step(num_q, num_kv, head_dim, dtype, seed=num_q * 10 + window)
    assert k.open.num_held == 5 and k.sink.num_held == 6, "rows 0, 2, 3, 4, 5 hold open blocks; 6 distinct block 0s"
    assert len(k.fresh.blocks) == 5, "sealed by the step: rows 1 and 2's block 0, row 3's blocks 0 and 1, row 6's block 1"
    out = backend.prepare(plan).attend(query, k, v, 0.125, window)
    ref = ta.TorchBackend().prepare(plan).attend(query, k, v, 0.125, window)
    assert_close(out, ref, dtype)
    for pool in (k, v):
        pool.fresh.clear()
    without_fresh = backend.prepare(plan).attend(query, k, v, 0.125, window)
    assert_close(without_fresh, ta.TorchBackend().prepare(plan).attend(query, k, v, 0.125, window), dtype)
    assert (without_fresh.float() - out.float()).abs().max() > 1e-2, "own blocks sealed by the step read in full"
    for pool in (k, v):
        pool.sink.block_slot.fill_(-1)
    without_sinks = backend.prepare(plan).attend(query, k, v, 0.125, window)
    assert_close(without_sinks, ta.TorchBackend().prepare(plan).attend(query, k, v, 0.125, window), dtype)
    if window == 0:
        assert (without_sinks.float() - without_fresh.float()).abs().max() > 1e-2, "row 0 of block 0 from the sink"


@pytest.mark.parametrize("head_dim", [80, 96])
def test_kivi_head_dims_other_than_powers_of_two(backend, head_dim):
    """head_dim 80 and 96 take value groups of 40 and 48 (``KiviFormat.value_group``): the kernel's scalar and
    vector row decodes, against the PyTorch path."""
    assert kv_formats.KIVI.value_group(head_dim) == head_dim // 2
    k, v, plan, query = kivi_step(4, 2, head_dim, torch.float32, seed=head_dim,
                                  rotation=kv_formats.rotation_matrix(head_dim))
    assert v.scales.shape[-1] == 2 * 2, "two value groups per row: a scale and a minimum each"
    scale = head_dim ** -0.5
    assert_close(backend.prepare(plan).attend(query, k, v, scale, 0),
                 ta.TorchBackend().prepare(plan).attend(query, k, v, scale, 0), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kivi_rotated_values_are_unrotated_by_the_kernel(backend, monkeypatch, dtype):
    """KIVI stores values rotated and keys not: the kernel unrotates each output row itself and leaves the
    query as it is (no PyTorch rotation per layer), equal to the PyTorch path's query-as-is, output-unrotated."""
    rotation = kv_formats.rotation_matrix(64)
    k, v, plan, query = kivi_step(8, 2, 64, dtype, seed=4, rotation=rotation)
    ref = ta.TorchBackend().prepare(plan).attend(query, k, v, 0.125, 0)
    unrotated = KiviPool(v.data, v.scales, v.fmt, v.head_dim, None, False, v.open, v.sink, v.fresh)
    rotated_out = ta.TorchBackend().prepare(plan).attend(query, k, unrotated, 0.125, 0)
    assert (rotated_out.float() - ref.float()).abs().max() > 0.1, "the output's unrotation changes it"

    def refuse(*args):
        raise AssertionError("rotated in PyTorch")
    monkeypatch.setattr(kv_formats.QuantizedPool, "rotate", refuse)
    monkeypatch.setattr(kv_formats.QuantizedPool, "unrotate", refuse)
    out = backend.prepare(plan).attend(query, k, v, 0.125, 0)
    if dtype == torch.float32:
        assert_close(out, ref, dtype)
    else:   # the PyTorch path rounds the rotated output to the dtype, then unrotates and rounds again; the
        # kernel unrotates the float sums and rounds once: they differ by up to a few ulps of the largest element
        atol = 4 * torch.finfo(dtype).eps * float(ref.float().abs().max())
        torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)


# -- routing and refusals -----------------------------------------------------------------------------
def test_quantised_pools_reach_the_quantised_op(backend, monkeypatch):
    calls = []
    real = backend.quant_op
    routed = cpu_backend.CpuKernelBackend(backend.op)
    routed.quant_op = lambda *args: calls.append(args[10:12]) or real(*args)
    gen = torch.Generator().manual_seed(1)
    num_blocks, tables, lens = shared_tables([9, 20], 8, gen)
    for name in FORMATS:
        k, v = (quantised_pool(kv_formats.FORMATS[name], (2, num_blocks, 8, 64), gen) for _ in range(2))
        routed.decode_attention(torch.randn(2, 4, 64), k, v, tables, lens, 0.1)
    assert calls == [(cpu_backend.FORMAT_IDS[n],) * 2 for n in FORMATS]
    k, v, tables, lens = kivi_pools([40], 1, 64, torch.float32, gen)
    routed.decode_attention(torch.randn(1, 2, 64), k, v, tables, lens, 0.1)
    assert calls[-1] == (cpu_backend.KIVI_KEY_ID, cpu_backend.KIVI_VALUE_ID)
    calls.clear()           # open slots in another dtype than the query: the PyTorch path, not refused
    out = routed.decode_attention(torch.randn(1, 2, 64, dtype=torch.bfloat16), k, v, tables, lens, 0.1)
    assert not calls and out.dtype == torch.bfloat16
    # a format without kernel code (every format has some now: take nvfp4's away): the PyTorch path's result
    monkeypatch.setattr(cpu_backend, "FORMAT_IDS", {n: i for n, i in cpu_backend.FORMAT_IDS.items() if n != "nvfp4"})
    num_blocks, tables, lens = shared_tables([9, 20], 8, gen)
    k, v = (quantised_pool(kv_formats.FORMATS["nvfp4"], (2, num_blocks, 8, 64), gen) for _ in range(2))
    query = torch.randn(2, 4, 64)
    out = routed.decode_attention(query, k, v, tables, lens, 0.1)
    assert not calls
    torch.testing.assert_close(out, quantized_torch.decode_attention(query, k, v, tables, lens, 0.1))


def test_refusals_name_the_problem(backend):
    gen = torch.Generator().manual_seed(2)
    k = quantised_pool(kv_formats.FORMATS["int8"], (2, 4, 8, 64), gen)
    tables, rows, pos = torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    query = torch.randn(1, 4, 64)
    op = backend.quant_op
    with pytest.raises(RuntimeError, match="k_format 9 unknown"):
        op(query, k.data, k.scales, k.data, k.scales, tables, rows, pos, 0.1, 0, 9, 0)
    with pytest.raises(RuntimeError, match="bytes per row, not head_dim"):
        op(query, k.data, k.scales, k.data, k.scales, tables, rows, pos, 0.1, 0, 0, 3)
    with pytest.raises(RuntimeError, match="must divide head_dim"):
        op(query, k.data, k.scales.repeat(1, 1, 1, 3).contiguous(), k.data, k.scales, tables, rows, pos, 0.1, 0, 0, 0)
    with pytest.raises(RuntimeError, match="outside the pool"):
        op(query, k.data, k.scales, k.data, k.scales, tables + 9, rows, pos, 0.1, 0, 0, 0)


# -- the quantising write -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FORMATS)
def test_write_quantises_as_kv_formats(backend, name, dtype):
    """Without rotation the codes and scales equal quantized_torch.write_kv's bit for bit (slots -1 skipped,
    strided states, awkward values: zero rows, outliers, ties, fp8 subnormals)."""
    fmt = kv_formats.FORMATS[name]
    gen = torch.Generator().manual_seed(4)
    n, heads, d, bs, blocks = 23, 3, 64, 8, 6
    x = (torch.randn(heads, n, d, generator=gen) * torch.logspace(-3, 3, n).view(1, -1, 1)).transpose(0, 1)
    x[0, 0], x[1, 1, :16], x[2, 2, 5] = 0, 0.75, 1e4
    x[3, 0, 1::2] = torch.linspace(-126.5, 125.5, d // 2).round() + 0.5
    x[3, 0, 0] = 127.0                                      # int8 scale 1: exact halves, round to even
    x = x.to(dtype)
    slots = torch.randperm(blocks * bs, generator=gen)[:n]
    slots[[4, 9]] = -1
    ours = [kv_formats.QuantizedPool.zeros(fmt, heads, blocks, bs, d, "cpu") for _ in range(2)]
    ref = [kv_formats.QuantizedPool.zeros(fmt, heads, blocks, bs, d, "cpu") for _ in range(2)]
    backend.write_kv(ours[0], ours[1], x, x.flip(0), slots)
    quantized_torch.write_kv(ref[0], ref[1], x, x.flip(0), slots)
    for mine, theirs in zip(ours, ref):
        assert torch.equal(mine.data, theirs.data) and torch.equal(mine.scales.view(torch.int16), theirs.scales.view(torch.int16))


def test_nvfp4_write_rounds_ties_to_the_even_code(backend):
    """Rows built so that x / step lands exactly on every e2m1 midpoint (row scale 2^-11, group scale 128: step
    2^-4), both signs, beside a zero group and a group whose e4m3 scale is subnormal: the C++ write's codes
    equal kv_formats' bit for bit, and a tie goes to the even code (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 ->
    2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), never -0."""
    fmt = kv_formats.FORMATS["nvfp4"]
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    row = torch.zeros(64)
    row[0] = 1.3125                                          # the row's amax: 2688 * 2^-11
    row[16:23], row[23:30], row[30] = mids / 16, -mids / 16, 0.375   # group 1: step 2^-4 (amax 6 * step)
    row[48:64] = torch.linspace(-1, 1, 16) * 6 * 2.0 ** -19  # group 3: e4m3 group scale 2^-8, a subnormal
    x = torch.stack([row, -row]).view(2, 1, 64)
    ours, ref = (kv_formats.QuantizedPool.zeros(fmt, 1, 1, 2, 64, "cpu") for _ in range(2))
    backend.write_kv(ours, ours, x, x, torch.tensor([0, 1]))
    quantized_torch.write_kv(ref, ref, x, x, torch.tensor([0, 1]))
    assert torch.equal(ours.data, ref.data) and torch.equal(ours.scales.view(torch.int16), ref.scales.view(torch.int16))
    codes = torch.stack([ours.data[0, 0, 0, :32] & 15, ours.data[0, 0, 0, :32] >> 4], -1).flatten()
    assert codes[16:23].tolist() == [0, 2, 2, 4, 4, 6, 6] and codes[23:30].tolist() == [0, 10, 10, 12, 12, 14, 14]
    assert codes[32:48].eq(0).all(), "a zero group: codes 0"
    values = kv_formats.dequantize(fmt, ours.data, ours.scales, torch.float32)[0, 0, 0]
    assert ours.data[0, 0, 0, 32 + 3] == 2, "the subnormal e4m3 code of 2^-8"
    assert torch.allclose(values[48:], row[48:], rtol=0.25, atol=2.0 ** -20)


@pytest.mark.parametrize("d", [64, 80], ids=["hadamard", "orthogonal"])
@pytest.mark.parametrize("name", FORMATS)
def test_write_rotates_as_the_pytorch_path(backend, name, d):
    """With the rotation fused into the write: the stored rows dequantise to the PyTorch path's (which
    rotates with a matmul first) within one scale unit (an int code step; less than an fp8 step near the
    top of the range), and almost all codes are equal."""
    fmt = kv_formats.FORMATS[name]
    gen = torch.Generator().manual_seed(6)
    n, heads, bs, blocks = 40, 2, 16, 4
    rotation = kv_formats.rotation_matrix(d)
    x = torch.randn(n, heads, d, generator=gen)
    slots = torch.randperm(blocks * bs, generator=gen)[:n]
    ours = [kv_formats.QuantizedPool.zeros(fmt, heads, blocks, bs, d, "cpu", rotation) for _ in range(2)]
    ref = [kv_formats.QuantizedPool.zeros(fmt, heads, blocks, bs, d, "cpu", rotation) for _ in range(2)]
    backend.write_kv(ours[0], ours[1], x, -x, slots)
    quantized_torch.write_kv(ref[0], ref[1], ref[0].rotate(x), ref[1].rotate(-x), slots)
    for mine, theirs in zip(ours, ref):
        a = kv_formats.dequantize(fmt, mine.data, mine.scales, torch.float32)
        b = kv_formats.dequantize(fmt, theirs.data, theirs.scales, torch.float32)
        unit = theirs.scales[..., :fmt.num_scales(d) // (2 if fmt.asymmetric else 1)].float().amax()
        assert (a - b).abs().max() <= unit, "one scale unit at most"
        assert (mine.data != theirs.data).float().mean() < 0.01, "codes differ only at rounding boundaries"


def test_write_refuses_what_it_cannot_store(backend):
    k = kv_formats.QuantizedPool.zeros(kv_formats.FORMATS["int8"], 2, 4, 8, 64, "cpu")
    x = torch.randn(3, 2, 64)
    with pytest.raises(RuntimeError, match="outside the pool's 32 slots"):
        backend.write_op(x, x, torch.tensor([0, 1, 32]), k.data, k.scales, k.data, k.scales, 0, 0, None)
    with pytest.raises(RuntimeError, match="has no row encoder"):
        backend.write_op(x, x, torch.tensor([0, 1, 2]), k.data, k.scales, k.data, k.scales, 4, 0, None)
    with pytest.raises(RuntimeError, match="KV heads"):
        backend.write_op(torch.randn(3, 3, 64), torch.randn(3, 3, 64), torch.tensor([0, 1, 2]), k.data, k.scales,
                         k.data, k.scales, 0, 0, None)


def test_kivi_pools_on_the_cpu_use_the_kernel_backend(backend, monkeypatch):
    """KVPools hand KIVI pools on the CPU to the selected backend (the kernel's), and to the PyTorch path when
    the kernel is switched off (HF_PAGED_CPU_KERNEL=0)."""
    from tiny_models import make_model

    from hf_paged.cache import KVPools
    config = make_model("llama").config
    for env, kind in (("1", cpu_backend.CpuKernelBackend), ("0", ta.TorchBackend)):
        monkeypatch.setenv(cpp_build.KERNEL_ENV, env)
        pools = KVPools(config, kv_format=kv_formats.kv_format("kivi"))
        pools.allocate_pools(4, kv_formats.KIVI_BLOCK_SIZE, torch.float32, torch.device("cpu"))
        assert isinstance(pools.backend, kind)


def scale_search_rows(n: int, heads: int, d: int, seed: int) -> torch.Tensor:
    """fp32 [n, heads, d] rows for the fp8 scale search's edge cases: magnitudes from fp32 subnormals to
    1e37 (the fixed-point error's two power-of-two factors at both ends of the exponent range), a lone
    element, equal magnitudes and rows already on the code grid (candidates tie or one is exact: the
    smallest j must win everywhere), negative zeros, a row that only the subnormal codes' rounding decides,
    rows at the edges of the AVX-512 search's division by reciprocal (kv_encode_cpu.h divide_by_reciprocal:
    elements down to 2^-50 under scales just above 2^-50, scales on both sides of 2^50, an element just under
    2^-50 beside others that would allow it), and Gaussian rows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, d, generator=gen)
    for i, magnitude in enumerate((1e-40, 1e-39, 1e-30, 1e-12, 1e12, 1e30, 1e37)):
        x[i] *= magnitude
    x[7] = 0
    x[7, :, 3] = -2.5
    x[8] = torch.where(torch.rand(heads, d, generator=gen) < 0.5, -1.0, 1.0) * 0.3
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)]
    x[9] = grid[torch.randint(len(grid), (heads, d), generator=gen)] * 2.0 ** -5
    x[9, :, 0] = 448 * 2.0 ** -5
    x[10, :, ::2] = -0.0
    # e4m3: 532 = 448 * 1.1875 is on the grid under candidates 0 (scale 1.1875) and 13 (scale 2.078125, 532 =
    # 256 * 2.078125) only; the small half is 2^-9 (the smallest subnormal code) under 13 but 1.75 * 2^-9 under 0,
    # so candidate 13 wins through the codes' subnormal rounding alone (rounded as a normal, 1.75 * 2^-9 is exact
    # and candidate 0 would tie and win).
    x[11, :, : d // 2] = 532.0
    x[11, :, d // 2:] = 2.0 ** -9 * 2.078125
    signs = torch.where(torch.rand(heads, d, generator=gen) < 0.5, -1.0, 1.0)
    log_uniform = lambda low, high: signs * 2.0 ** (low + (high - low) * torch.rand(heads, d, generator=gen))  # noqa: E731
    x[12] = log_uniform(-50, -40)                 # every element >= 2^-50, the scales from ~2^-49
    x[12, :, 0] = 2.0 ** -50
    x[13] = log_uniform(40, 58)                   # e4m3: amax / code_max 2^49.6, candidates on both sides of 2^50
    x[13, :, 1] = 448 * 2.0 ** 49.6
    x[15] = log_uniform(48, 65)                   # the same for e5m2
    x[15, :, 1] = 57344 * 2.0 ** 49.6
    x[14] = log_uniform(-44, -36)
    x[14, :, 2] = 2.0 ** -50 * 0.999              # one element just under 2^-50: the row divides
    return x


@pytest.mark.parametrize("d", [64, 80, 256])
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_write_searches_the_fp8_scale_as_kv_formats(backend, name, d):
    """The fused write's scale search (kv_encode_cpu.h encode8_searched) picks the PyTorch codec's scale and
    codes bit for bit on its edge cases, and the searched scale is not just amax / code_max. Head dims: the
    AVX-512 search's early stop checks every 32 elements, so 80 (5 vectors) and 256 (16) end between and at them."""
    fmt = kv_formats.FORMATS[name]
    n, heads, bs, blocks = 16, 2, 8, 3
    x = scale_search_rows(n, heads, d, seed=7)
    slots = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(8))[:n]
    ours = [kv_formats.QuantizedPool.zeros(fmt, heads, blocks, bs, d, "cpu") for _ in range(2)]
    ref = [kv_formats.QuantizedPool.zeros(fmt, heads, blocks, bs, d, "cpu") for _ in range(2)]
    backend.write_kv(ours[0], ours[1], x, -x.flip(0), slots)
    quantized_torch.write_kv(ref[0], ref[1], x, -x.flip(0), slots)
    for mine, theirs in zip(ours, ref):
        assert torch.equal(mine.data, theirs.data)
        assert torch.equal(mine.scales.view(torch.int16), theirs.scales.view(torch.int16))
    plain = (x.abs().amax(-1) / fmt.code_max).to(torch.bfloat16)
    stored = ours[0].scales.view(heads, -1)[:, slots].transpose(0, 1)
    assert (stored != torch.where(plain > 0, plain, torch.ones_like(plain))).any(), "the search never moved"


def test_division_by_reciprocal_is_exact_on_every_mantissa(backend):
    """The fp8 search divides through a reciprocal and one correction (Markstein's theorem); exhaustively: every
    fp32 mantissa over every bf16 one gives x / s bit for bit (-1: a scalar build, without AVX-512 or AVX2, which
    divides)."""
    want = 0 if torch.ops.hf_paged_cpu.codec_lanes() > 1 else -1
    assert torch.ops.hf_paged_cpu.exact_division_failures() == want


def test_the_search_rounds_every_normal_fp8_magnitude_as_the_codec(backend):
    """The vector search (AVX-512 or AVX2) rounds normal magnitudes by Veltkamp's splitting instead of integer
    steps; exhaustively: every fp32 in e4m3's and e5m2's normal range rounds as fp8_rounded (-1: a scalar build)."""
    want = 0 if torch.ops.hf_paged_cpu.codec_lanes() > 1 else -1
    assert torch.ops.hf_paged_cpu.fp8_rounding_failures() == want


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """kv_codec_cpu.h hadamard_row's scalar loop in PyTorch (fp32, the same additions in the same order)."""
    x = x.clone()
    d, h = x.shape[-1], 1
    while h < d:
        y = x.view(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = y[..., 0, :].clone(), y[..., 1, :].clone()
        y[..., 0, :], y[..., 1, :] = a + b, a - b
        h *= 2
    return x * (1.0 / d ** 0.5)


@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])
def test_rotation_takes_the_fast_transform_only_for_the_hadamard_matrix(backend, d):
    """The kernel's query/output rotation (rotate_row): kv_formats.rotation_matrix(d) is recognised (is_hadamard)
    and rotated by the fast transform, bit for bit the scalar loop's (SIMD builds included); a matrix that
    differs in one entry (sign, last bits, NaN) takes the general product, which equals x @ R within rounding."""
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(9, d, generator=gen) * torch.logspace(-3, 3, 9).view(-1, 1)
    rotation = kv_formats.rotation_matrix(d)
    for transposed in (False, True):
        got, hadamard = torch.ops.hf_paged_cpu.rotate_rows(x, rotation, transposed)
        assert hadamard
        assert torch.equal(got, walsh_hadamard(x))
    scale = float(rotation[0, 0])
    for i, j, value in ((d - 1, d - 1, -rotation[d - 1, d - 1]), (3, d // 2 + 1, rotation[3, d // 2 + 1] * (1 + 2 ** -20)),
                        (0, d - 5, float("nan")), (d // 2, 0, scale * 2)):
        other = rotation.clone()
        other[i, j] = value
        got, hadamard = torch.ops.hf_paged_cpu.rotate_rows(x, other, False)
        assert not hadamard, (i, j)
        if value == value:                                       # (NaN: only that it is not taken)
            torch.testing.assert_close(got, x @ other, rtol=1e-5, atol=1e-5 * float(x.abs().max()))
