"""The CPU kernel extension's other ISA builds: the same sources built for AVX2 + FMA and for plain x86-64
(the codec's scalar paths) compile, dequantise every row format as kv_formats does (bit for bit where a value
is one product; within 1 ulp where the SIMD path fuses a multiply-add), and write the native build's codes.
The native build (-march=native) is what the other tests run; on an AVX-512 machine this is what keeps the
AVX2 code paths (nvfp4's table lookup, the 8-lane nibble blocks) built and right."""
from __future__ import annotations

import platform
from importlib import resources

import pytest
import torch

from hf_paged import kv_formats
from hf_paged.backends import cpu_backend


@pytest.fixture(scope="module")
def native():
    try:
        cpu_backend.load_kernel()
    except RuntimeError as err:
        pytest.skip(f"CPU kernel not built: {err}")
    return torch.ops.hf_paged_cpu


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the ISA variants are x86-64 builds")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "scalar"])
def test_other_isa_builds_read_and_write_as_the_native_one(native, tmp_path, march):
    if march == "x86-64-v3" and not {"avx2", "fma"} <= set(cpu_backend._cpu_features().split()):
        pytest.skip("this CPU cannot run an AVX2 build")
    from torch.utils import cpp_extension
    name = f"hfp_cpu_{march.replace('-', '_')}"
    folder = resources.files("hf_paged.cuda")
    for file in cpu_backend.SOURCES + cpu_backend.HEADERS:
        (tmp_path / file).write_text((folder / file).read_text().replace("hf_paged_cpu", name))
    cpp_extension.load(name=name, sources=[str(tmp_path / f) for f in cpu_backend.SOURCES],
                       extra_cflags=["-O2", f"-march={march}", "-fopenmp", "-std=c++17"], extra_ldflags=["-fopenmp"],
                       build_directory=str(tmp_path), is_python_module=False)
    variant = getattr(torch.ops, name)
    assert variant.codec_lanes() == (8 if march == "x86-64-v3" else 1)
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
        variant.write_kv_quant(states, -states, slots, mine[0].data, mine[0].scales, mine[1].data, mine[1].scales,
                               fid, fid, None)
        native.write_kv_quant(states, -states, slots, theirs[0].data, theirs[0].scales, theirs[1].data,
                              theirs[1].scales, fid, fid, None)
        for a, b in zip(mine, theirs):
            assert torch.equal(a.data, b.data) and torch.equal(a.scales.view(torch.int16), b.scales.view(torch.int16))
