"""The CPU kernel extension's other ISA builds: the same sources built for AVX2 + FMA, for plain x86-64 (the
codec's scalar paths) and for AVX2 + AVX-512F without AVX-512BW compile, dequantise every row format as
kv_formats does (bit for bit where a value is one product; within 1 ulp where the SIMD path fuses a
multiply-add), and write the native build's codes and rotate as it does, bit for bit.
The native build (-march=native) is what the other tests run; on an AVX-512 machine this is what keeps the
AVX2 code paths (nvfp4's table lookup, the 8-lane nibble blocks, fp8's F16C read and its 8-lane scale
search) built and right."""
from __future__ import annotations

import platform
from importlib import resources

import pytest
import torch

from hf_paged import kv_formats
from hf_paged.backends import cpu_backend
from hf_paged.backends import cpp_build


@pytest.fixture(scope="module")
def native():
    try:
        cpu_backend.load_kernel()
    except RuntimeError as err:
        pytest.skip(f"CPU kernel not built: {err}")
    return torch.ops.hf_paged_cpu


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the ISA variants are x86-64 builds")
@pytest.mark.parametrize("flags,lanes", [(["-march=x86-64-v3"], 8), (["-march=x86-64"], 1),
                                         (["-march=x86-64-v3", "-mavx512f"], 8)],
                         ids=["avx2", "scalar", "avx512f-without-bw"])
def test_other_isa_builds_read_and_write_as_the_native_one(native, tmp_path, flags, lanes):
    """avx512f-without-bw: the writes' AVX-512F paths (kv_encode_cpu.h, the Hadamard transform) beside the codec's
    AVX2 reads (its 16-lane paths need AVX-512BW too)."""
    needs = {"avx2", "fma"} | ({"avx512f"} if "-mavx512f" in flags else set())
    if lanes > 1 and not needs <= set(cpp_build.cpu_features().split()):
        pytest.skip(f"this CPU cannot run a {' '.join(flags)} build")
    from torch.utils import cpp_extension
    name = "hfp_cpu_" + "_".join(f.lstrip("-").replace("march=", "").replace("-", "_") for f in flags)
    folder = resources.files("hf_paged.cuda")
    for file in cpu_backend.SOURCES + cpu_backend.HEADERS:
        (tmp_path / file).write_text((folder / file).read_text().replace("hf_paged_cpu", name))
    cpp_extension.load(name=name, sources=[str(tmp_path / f) for f in cpu_backend.SOURCES],
                       extra_cflags=["-O2", *flags, "-fopenmp", "-std=c++17"], extra_ldflags=["-fopenmp"],
                       build_directory=str(tmp_path), is_python_module=False)
    variant = getattr(torch.ops, name)
    assert variant.codec_lanes() == lanes
    gen = torch.Generator().manual_seed(5)
    for fmt_name, fid in cpu_backend.FORMAT_IDS.items():
        fmt = kv_formats.FORMATS[fmt_name]
        x = torch.randn(37, 64, generator=gen) * torch.logspace(-4, 3, 37).view(-1, 1)
        x[0] = 0
        codes, scales = kv_formats.quantize(fmt, x)
        ref = kv_formats.dequantize(fmt, codes, scales, torch.float32)
        for simd in (True, False):
            got = variant.dequantize_rows(codes, scales, fid, 64, simd)
            if fmt.asymmetric:
                torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))
            else:
                assert torch.equal(got, ref), (fmt_name, simd)
        states = torch.randn(20, 3, 64, generator=gen)
        slots = torch.randperm(32, generator=gen)[:20]
        mine, theirs = ([kv_formats.QuantizedPool.zeros(fmt, 3, 4, 8, 64, "cpu") for _ in range(2)] for _ in range(2))
        for rotation in (None, kv_formats.rotation_matrix(64)):       # the Hadamard transform on write
            variant.write_kv_quant(states, -states, slots, mine[0].data, mine[0].scales, mine[1].data,
                                   mine[1].scales, fid, fid, rotation)
            native.write_kv_quant(states, -states, slots, theirs[0].data, theirs[0].scales, theirs[1].data,
                                  theirs[1].scales, fid, fid, rotation)
            for a, b in zip(mine, theirs):
                assert torch.equal(a.data, b.data) and torch.equal(a.scales.view(torch.int16), b.scales.view(torch.int16))
    for d in (64, 128):                                               # the query/output rotation, bit for bit
        x, hadamard = torch.randn(5, d, generator=gen), kv_formats.rotation_matrix(d)
        for transposed in (False, True):
            assert torch.equal(variant.rotate_rows(x, hadamard, transposed)[0],
                               native.rotate_rows(x, hadamard, transposed)[0])


def test_the_arch_knob_sets_march_and_refuses_what_is_not_one(monkeypatch):
    monkeypatch.delenv(cpp_build.ARCH_ENV, raising=False)
    assert "-march=native" in cpp_build.cflags()
    monkeypatch.setenv(cpp_build.ARCH_ENV, " x86-64-v3 ")
    assert "-march=x86-64-v3" in cpp_build.cflags() and "-march=native" not in cpp_build.cflags()
    monkeypatch.setenv(cpp_build.ARCH_ENV, "armv8.2-a+fp16+dotprod")
    assert "-march=armv8.2-a+fp16+dotprod" in cpp_build.cflags()
    monkeypatch.setenv(cpp_build.ARCH_ENV, "native -O0")
    with pytest.raises(ValueError, match="HF_PAGED_CPU_ARCH"):
        cpp_build.cflags()
