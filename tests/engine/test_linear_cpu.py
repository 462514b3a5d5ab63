"""The engine's float32 linear kernel (cuda/linear_cpu.cpp, torch.ops.hf_paged_fused.linear): every output is
the sequential fused multiply-add over k, bit for bit, whatever the batch, the thread count and the ISA it
was built for; packing pads panels with zeros; bad arguments are refused by name. Its bfloat16 form (built
for AVX-512 BF16): the pairwise VDPBF16PS sum, rows independent of their batch."""
from __future__ import annotations

import platform
import struct

import pytest
import torch


from hf_paged.backends import cpp_build
from hf_paged.engine.cpu_ops import load_fused_ops


@pytest.fixture(scope="module")
def ops():
    try:
        return load_fused_ops()
    except RuntimeError as err:          # no compiler: the engine falls back to oneDNN, nothing to test here
        pytest.skip(str(err))


def sequential_fma(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """acc = fma(x[:, k], w[:, k], acc) for k = 0..K-1 in float32, then + bias: each product is exact in float64
    and the sum rounded once to float32 (differs from a true fma only by a double rounding, ~2^-29 per step)."""
    acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32)
    for k in range(x.shape[1]):
        acc = (x[:, k, None].double() * weight[None, :, k].double() + acc.double()).float()
    return acc if bias is None else acc + bias


# AVX-512: up to 14 rows a panel is read once (the kernel's Stream::kSingle), 15-224 rows by 2-16 row blocks that
# stream the next panel (kShared), more by more blocks (kCompute); the last panel of a call streams nothing ahead.
# AVX2: 1-3 rows kSingle, 4-15 kShared, 16+ kCompute with its own tile (6 rows x 16 columns, slice by slice).
@pytest.mark.parametrize("rows,n,k,bias", [(1, 64, 64, False), (13, 100, 37, True), (14, 96, 70, False),
                                           (15, 33, 16, True), (29, 200, 64, True), (64, 32, 9, False),
                                           (240, 70, 33, True)])
def test_linear_is_the_sequential_fma_sum(ops, rows, n, k, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = ops.linear(x, ops.pack_linear(w), b, n)
    assert torch.equal(got, sequential_fma(x, w, b))


def test_packing_pads_the_last_panel_with_zeros(ops):
    w = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)
    packed = ops.pack_linear(w)
    assert packed.shape == (2, 3, 32)
    assert torch.equal(packed[0], w[:32].t()) and torch.equal(packed[1, :, :8], w[32:].t())
    assert not packed[1, :, 8:].any()


@pytest.mark.parametrize("dtype,rows,k", [(torch.float32, 45, 80), (torch.bfloat16, 300, 81)], ids=["f32", "bf16"])
def test_a_row_gives_the_same_bits_alone_in_any_batch_and_with_any_threads(ops, dtype, rows, k):
    if dtype == torch.bfloat16 and not ops.linear_bf16_available():
        pytest.skip("this build has no bf16 kernel (AVX-512 BF16)")
    gen = torch.Generator().manual_seed(5)
    w, b = torch.randn(96, k, generator=gen).to(dtype), torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    packed = ops.pack_linear(w)
    threads = torch.get_num_threads()
    try:
        batch = ops.linear(x, packed, b, 96)
        torch.set_num_threads(1)
        single_thread = ops.linear(x, packed, b, 96)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, single_thread)
    for i in (0, 13, 14, rows // 2, rows - 1):
        assert torch.equal(ops.linear(x[i:i + 1], packed, b, 96)[0], batch[i])
        assert torch.equal(ops.linear(x[i:i + 20], packed, b, 96)[0], batch[i])


def test_rows_with_a_stride_and_no_rows(ops):
    w = torch.randn(40, 24)
    wide = torch.randn(7, 30)
    x = wide[:, :24]                                    # row stride 30
    assert torch.equal(ops.linear(x, ops.pack_linear(w), None, 40), ops.linear(x.contiguous(), ops.pack_linear(w), None, 40))
    assert ops.linear(torch.empty(0, 24), ops.pack_linear(w), None, 40).shape == (0, 40)


def test_bad_arguments_are_refused_by_name(ops):
    w = torch.randn(40, 24)
    packed = ops.pack_linear(w)
    with pytest.raises(RuntimeError, match="x must be a float32"):
        ops.linear(torch.randn(2, 24, dtype=torch.float64), packed, None, 40)
    with pytest.raises(RuntimeError, match="packed must be pack_linear's"):
        ops.linear(torch.randn(2, 24), packed, None, 70)
    with pytest.raises(RuntimeError, match="packed must be pack_linear's"):
        ops.linear(torch.randn(2, 25), packed, None, 40)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.linear(torch.randn(2, 24), packed, torch.randn(39), 40)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the ISA variants are x86-64 builds")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "scalar"])
def test_every_isa_build_gives_the_same_bits(ops, tmp_path, march):
    """The same source built for AVX2 + FMA and for plain x86-64 (its scalar std::fma path) agrees with the
    native build bit for bit (the kernel's invariant: one summation order on every CPU)."""
    if march == "x86-64-v3" and not {"avx2", "fma"} <= set(cpp_build.cpu_features().split()):
        pytest.skip("this CPU cannot run an AVX2 build")
    from importlib import resources

    from torch.utils import cpp_extension
    folder = resources.files("hf_paged.cuda")
    path = tmp_path / "linear_variant.cpp"
    name = f"hfp_linear_{march.replace('-', '_')}"
    path.write_text((folder / "linear_cpu.cpp").read_text().replace("hf_paged_fused", name))
    (tmp_path / "linear_cpu_micro.h").write_text((folder / "linear_cpu_micro.h").read_text())
    cpp_extension.load(name=name, sources=[str(path)], extra_cflags=["-O2", f"-march={march}", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], build_directory=str(tmp_path), is_python_module=False)
    variant = getattr(torch.ops, name)
    assert variant.linear_hardware_fma() == (march == "x86-64-v3")     # plain x86-64: std::fma is libm's
    gen = torch.Generator().manual_seed(11)
    w, b, x = torch.randn(100, 70, generator=gen), torch.randn(100, generator=gen), torch.randn(31, 70, generator=gen)
    assert torch.equal(variant.pack_linear(w), ops.pack_linear(w))
    assert torch.equal(variant.linear(x, variant.pack_linear(w), b, 100), ops.linear(x, ops.pack_linear(w), b, 100))


# --- bfloat16 (built for a CPU with AVX-512 BF16) ---

def pairwise_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """VDPBF16PS as the SDM defines it, pair by pair in order: acc += x[2j+1] w[2j+1], then acc += x[2j] w[2j],
    each product exact in float32 (8-bit significands) and each sum rounded to float32; then + bias, rounded
    to bf16 as torch rounds. (On Gaussian data the even-first and single-rounding orders give the same bf16
    outputs: this pins the packing, pairing, odd K and bias, not the instruction's last bit.)"""
    xf, wf, k = x.float(), weight.float(), x.shape[1]
    acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32)
    for j in range(0, k, 2):
        for i in (j + 1, j):
            if i < k:
                acc = (acc.double() + xf[:, i, None].double() * wf[None, :, i].double()).float()
    return (acc if bias is None else acc + bias.float()).bfloat16()


@pytest.fixture(scope="module")
def bf16_ops(ops):
    if not ops.linear_bf16_available():
        pytest.skip("this build has no bf16 kernel (the compiler's target lacks AVX-512 BF16): bf16 stays on oneDNN")
    return ops


def test_the_native_build_has_hardware_fma(ops):
    """Every CPU this runs on in practice (x86 since AVX2, aarch64) gets FMA instructions from -march=native;
    the engine's float32 linears use the kernel only then (prepack.kernel_takes)."""
    flags = set(cpp_build.cpu_features().split())
    if cpp_build.march() != "native" or (platform.machine() == "x86_64" and "fma" not in flags):
        pytest.skip("not a native build on a CPU with FMA")
    assert ops.linear_hardware_fma()


def test_bf16_kernel_follows_the_cpu(ops):
    """Built with -march=native, the bf16 kernel is there exactly where the CPU has AVX-512 BF16; built for a
    generic x86-64 level (HF_PAGED_CPU_ARCH), never (none of them has AVX-512 BF16)."""
    march = cpp_build.march()
    if march == "native":
        assert ops.linear_bf16_available() == ("avx512_bf16" in cpp_build.cpu_features().split())
    elif march in ("x86-64", "x86-64-v2", "x86-64-v3"):
        assert not ops.linear_bf16_available()
    else:
        pytest.skip(f"whether {march} has AVX-512 BF16 is not known to this test")


@pytest.mark.parametrize("rows,n,k,bias", [(1, 64, 64, False), (14, 100, 37, True), (15, 33, 16, True),
                                           (29, 200, 65, True), (240, 70, 33, False), (3, 32, 1, True)])
def test_bf16_linear_is_the_pairwise_sum(bf16_ops, rows, n, k, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k, generator=gen).bfloat16(), torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    got = bf16_ops.linear(x, bf16_ops.pack_linear(w), b, n)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert torch.equal(got, pairwise_bf16(x, w, b))


def c10_bf16_bits(value: float) -> int:
    """c10::BFloat16(float)'s bits: round to nearest even on the float32 bits, any NaN to 0x7FC0."""
    if value != value:
        return 0x7FC0
    u = struct.unpack("<I", struct.pack("<f", value))[0]
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def test_bf16_outputs_round_as_c10_does_denormals_and_nans_too(bf16_ops):
    """The epilogue rounds 16 outputs at a time (VCVTNEPS2BF16, which flushes denormals and keeps NaN payloads);
    vectors holding either go through c10's scalar rounding: denormal sums kept, every NaN 0x7FC0, as torch's
    scalar conversion gives (its vectorised .bfloat16() gives other NaN bits). x = 0, so each output is its bias."""
    odd = [0x0001, 0x8003, 0x007F, 0xFFC1, 0x7F81, 0x3F80, 0x0000, 0x8000]
    bits = odd * 2 + [0x3F80 + i for i in range(16)] + odd[:5]       # one vector with odd lanes, one without, a tail
    b = torch.tensor([v - 65536 if v > 32767 else v for v in bits], dtype=torch.int16).view(torch.bfloat16)
    n = len(bits)
    w = torch.randn(n, 6).bfloat16()
    got = bf16_ops.linear(torch.zeros(3, 6).bfloat16(), bf16_ops.pack_linear(w), b, n)
    want = [c10_bf16_bits(0.0 + float(v)) for v in b.float().tolist()]
    for row in got.view(torch.int16).tolist():
        assert [v & 0xFFFF for v in row] == want


def test_bf16_packing_pairs_k_per_column(bf16_ops):
    w = torch.arange(40 * 3, dtype=torch.float32).view(40, 3).bfloat16()
    packed = bf16_ops.pack_linear(w)
    assert packed.shape == (2, 2, 64) and packed.dtype == torch.bfloat16
    pairs = packed.view(2, 2, 32, 2)                    # [panel, pair, column, k of the pair]
    assert torch.equal(pairs[0, 0, :, 0], w[:32, 0]) and torch.equal(pairs[0, 0, :, 1], w[:32, 1])
    assert torch.equal(pairs[0, 1, :, 0], w[:32, 2]) and not pairs[:, 1, :, 1].any()     # K = 3: a zero pair half
    assert torch.equal(pairs[1, 0, :8, 0], w[32:, 0]) and not pairs[1, :, 8:].any()


def test_bf16_arguments_of_another_dtype_are_refused(bf16_ops):
    w = torch.randn(40, 24).bfloat16()
    packed = bf16_ops.pack_linear(w)
    with pytest.raises(RuntimeError, match="packed must be pack_linear's BFloat16"):
        bf16_ops.linear(torch.randn(2, 24).bfloat16(), bf16_ops.pack_linear(w.float()), None, 40)
    with pytest.raises(RuntimeError, match="bias must be a contiguous BFloat16"):
        bf16_ops.linear(torch.randn(2, 24).bfloat16(), packed, torch.randn(40), 40)
