"""Both CPU extensions' C++ sources compile for aarch64 (Graviton, Ampere, Apple silicon under Linux), where
neither x86 intrinsics nor their headers exist: every source is compiled to an object file by a cross compiler,
as torch's extension loader would on such a machine, for plain ARMv8-A and for ARMv8.2-A with fp16 and dot
products. (Before this test, an unguarded <immintrin.h> in fused_ops_cpu.cpp failed the fused ops' build on
any ARM CPU, and with it the linear kernel and the lean layers.) The linear kernel's std::fma is one
instruction there (FP_FAST_FMAF), so the engine keeps float32 linears on the kernel.

Needs ``aarch64-linux-gnu-g++`` (Debian: ``apt-get install g++-aarch64-linux-gnu``; CI installs it)."""
from __future__ import annotations

import shutil
import platform
import subprocess
import sysconfig
from importlib import resources
from pathlib import Path

import pytest
import torch

from hf_paged.backends import cpu_backend
from hf_paged.engine import cpu_ops

CROSS = "aarch64-linux-gnu-g++"


@pytest.fixture(scope="module")
def compiler():
    path = shutil.which(CROSS)
    if path is None:
        pytest.skip(f"no {CROSS} on this machine (Debian: apt-get install g++-aarch64-linux-gnu)")
    return path


def _compile(compiler: str, source: Path, march: str, out: Path, extra: tuple[str, ...] = ()) -> str:
    include = Path(torch.__file__).parent / "include"
    cmd = [compiler, "-c", "-O1", f"-march={march}", "-fopenmp", "-fno-math-errno", "-std=c++17", "-fPIC",
           "-I", str(include), "-I", str(include / "torch/csrc/api/include"), "-I", sysconfig.get_paths()["include"],
           "-I", str(source.parent), *extra, str(source), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return "" if done.returncode == 0 else done.stderr[-4000:]


@pytest.mark.parametrize("march", ["armv8-a", "armv8.2-a+fp16+dotprod"])
@pytest.mark.parametrize("name", sorted(set(cpu_backend.SOURCES) | set(cpu_ops.SOURCES)))
def test_every_cpu_source_compiles_for_aarch64(compiler, tmp_path, name, march):
    with resources.as_file(resources.files("hf_paged.cuda")) as folder:
        errors = _compile(compiler, Path(folder) / name, march, tmp_path / f"{name}.o")
    assert not errors, f"{name} does not compile for {march}:\n{errors}"
    assert (tmp_path / f"{name}.o").stat().st_size > 0


def test_the_linear_kernel_has_hardware_fma_on_aarch64(compiler, tmp_path):
    """linear_hardware_fma() is true for an aarch64 build: FP_FAST_FMAF is defined there."""
    probe = tmp_path / "probe.cpp"
    probe.write_text("#include <cmath>\n#ifndef FP_FAST_FMAF\n#error no FP_FAST_FMAF\n#endif\nint x;\n")
    assert not _compile(compiler, probe, "armv8-a", tmp_path / "probe.o")
    host = shutil.which("g++")
    if platform.machine() == "x86_64" and host:     # the probe tells: a plain x86-64 build has no FMA
        assert _compile(host, probe, "x86-64", tmp_path / "probe_x86.o")
