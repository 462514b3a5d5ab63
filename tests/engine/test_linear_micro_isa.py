"""The float32 linear micro-kernel (cuda/linear_cpu_micro.h) built for every ISA it has a path for gives the
sequential fused multiply-add's bits (tests/engine/linear_micro_check.cpp): AVX-512 (native, where the CPU has
it), AVX2 + FMA, plain x86-64 (std::fma), and aarch64's NEON, cross-compiled and run under qemu-user. The
kernel's results then do not depend on the CPU, which the engine's batch invariance and the prefix cache's
equality rest on. Each build also reports the tile it chose, so a path that silently fell back is caught."""
from __future__ import annotations

import platform
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import pytest


from hf_paged.backends import cpp_build

HARNESS = Path(__file__).with_name("linear_micro_check.cpp")
# (compiler, -march, runner prefix or None for the host, expected "lanes= rows= vecs= compute=")
BUILDS = {
    "avx512": ("g++", "native", None, "lanes=16 rows=14 vecs=2 compute=14x2"),
    "avx2": ("g++", "x86-64-v3", None, "lanes=8 rows=3 vecs=4 compute=6x2"),
    "scalar": ("g++", "x86-64", None, "lanes=8 rows=4 vecs=2 compute=4x2"),
    "neon": ("aarch64-linux-gnu-g++", "armv8-a", "qemu-aarch64-static", "lanes=4 rows=5 vecs=4 compute=5x4"),
}


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_each_isa_build_gives_the_sequential_fma_bits(tmp_path, build):
    compiler, march, runner, tile = BUILDS[build]
    if build == "neon" and platform.machine() == "aarch64":
        compiler, march, runner = "g++", "native", None      # on an ARM host: its own compiler, run directly
    flags = set(cpp_build.cpu_features().split())
    if build != "neon" and platform.machine() != "x86_64":
        pytest.skip("the x86 builds run on an x86-64 host")
    if build == "avx512" and "avx512f" not in flags:
        pytest.skip("this CPU has no AVX-512F")
    if build == "avx2" and not {"avx2", "fma"} <= flags:
        pytest.skip("this CPU cannot run an AVX2 build")
    missing = [tool for tool in (compiler, runner) if tool and shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (Debian: g++-aarch64-linux-gnu, qemu-user-static)")
    binary = tmp_path / f"check_{build}"
    with resources.as_file(resources.files("hf_paged.cuda")) as folder:
        static = ["-static"] if runner else []            # qemu-user then needs no aarch64 libraries
        built = subprocess.run([compiler, "-O3", f"-march={march}", "-std=c++17", "-ffp-contract=off", *static,
                                "-I", str(folder), str(HARNESS), "-o", str(binary)],
                               capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    ran = subprocess.run([runner, str(binary)] if runner else [str(binary)], capture_output=True, text=True,
                         timeout=300)
    assert ran.returncode == 0 and ran.stdout.strip() == f"ok {tile}", ran.stdout[-3000:] + ran.stderr[-1000:]
