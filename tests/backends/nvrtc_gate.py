"""NVRTC compile gate with no GPU: NVRTC from pip wheels, loaded through ctypes.

Kernels of hf_paged.backends.kernel_registry are compiled to cubin for sm_80 and sm_90 by each NVRTC
(oldest supported 12.x, newest 12.x, 13.x) with the options CuPy's RawModule passes in production
(production_options: -ftz=true, C++17, -arch=sm_XX, ...), the cubin's entry symbols are compared with
the registry, and registers / shared memory / spills are read from ptxas's verbose log; sass_gate.py
disassembles the same cubins. Which modules (see plan()):
the model-dtype modules and cache ops on every (NVRTC, arch); the 20 quantised modules (4 formats x 5
head dims, 120 kernels: five times the model-dtype ones, ~4 min of compiling on 2 cores per pair) all
on the newest pair (13.0, sm_90), and one each, rotating formats and head dims, on the other five pairs.
$HF_PAGED_NVRTC_FULL=1 (or --full) compiles every module on every pair.

    python tests/backends/nvrtc_gate.py [--full]   # prints the table, writes nvrtc_report.json in the cache

The wheels are installed on first use with ``pip install --no-deps --target`` into
$HF_PAGED_NVRTC_CACHE (default ~/.cache/hf_paged/nvrtc).
"""
from __future__ import annotations

import ctypes
import functools
import json
import multiprocessing
import os
import re
import struct
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from hf_paged.backends import kernel_registry as reg

ARCHS = ("sm_80", "sm_90")
FULL_ENV = "HF_PAGED_NVRTC_FULL"
NEWEST = ("13.0", "sm_90")      # compiles every module
# The quantised module each other (NVRTC, arch) compiles: every format on sm_80 and on each NVRTC,
# and int4 at head dim 80 (its 8-byte code loads) on the oldest pair.
QUANTISED_SPOT_CHECKS = {("12.4", "sm_80"): ("int4", 80), ("12.4", "sm_90"): ("fp8e5m2", 256),
                         ("12.9", "sm_80"): ("fp8e5m2", 96), ("12.9", "sm_90"): ("int8", 128),
                         ("13.0", "sm_80"): ("fp8e4m3", 64)}
# name: (pip requirements, nvrtc library, builtins library to preload, include dir), relative to the target
TOOLKITS = {
    "12.4": (("nvidia-cuda-nvrtc-cu12==12.4.127", "nvidia-cuda-runtime-cu12==12.4.127"),
             "nvidia/cuda_nvrtc/lib/libnvrtc.so.12", "nvidia/cuda_nvrtc/lib/libnvrtc-builtins.so.12.4",
             "nvidia/cuda_runtime/include"),
    "12.9": (("nvidia-cuda-nvrtc-cu12==12.9.86", "nvidia-cuda-runtime-cu12==12.9.79"),
             "nvidia/cuda_nvrtc/lib/libnvrtc.so.12", "nvidia/cuda_nvrtc/lib/libnvrtc-builtins.so.12.9",
             "nvidia/cuda_runtime/include"),
    "13.0": (("nvidia-cuda-nvrtc==13.0.88", "nvidia-cuda-runtime==13.0.96"),
             "nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cu13/lib/libnvrtc-builtins.so.13.0",
             "nvidia/cu13/include"),
}


def cache_root() -> Path:
    return Path(os.environ.get("HF_PAGED_NVRTC_CACHE", Path.home() / ".cache" / "hf_paged" / "nvrtc"))


def install(name: str) -> Path:
    """The toolkit's folder, pip-installing its wheels there first if needed."""
    return pip_target(name, TOOLKITS[name][0], TOOLKITS[name][1])


def pip_target(name: str, requirements, marker: str) -> Path:
    """cache_root()/name holding ``requirements`` (``pip install --no-deps --target``), installed
    unless done before (``.complete``) or the file ``marker`` is already there."""
    target = cache_root() / name
    if (target / ".complete").exists() or (target / marker).exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    *requirements], check=True)
    (target / ".complete").touch()
    return target


def production_options(arch: str, include: Path, defines=()) -> list[str]:
    """The NVRTC options of the production build, in CuPy's order, plus ptxas's verbose log.

    hf_paged.backends.cuda_backend builds ``cupy.RawModule(code, options=(*defines, -I<CUDA
    headers>), backend="nvrtc")``; CuPy 14.2 then compiles with (cupy/_core/core.pyx
    ``assemble_cupy_compiler_options``, cupy/cuda/compiler.py ``_compile_with_cache_cuda`` and
    ``_compile_using_nvrtc_no_warning``): its bundled CCCL include dirs, the caller's options,
    ``--std=c++17`` (none given), ``-I<cupy/_core/include>``, ``-I<CUDA headers>``, ``-ftz=true``,
    ``-arch=sm_XX`` (a cubin, as the arch is within the NVRTC's range and CUPY_COMPILE_WITH_PTX is
    unset) and ``--device-as-default-execution-space``. Left out: the CCCL and cupy include dirs (no
    CuPy wheel here; the kernels include only cuda_fp16.h / cuda_bf16.h, found under ``include``), and
    the second -I of the same CUDA header dir. ``--ptxas-options=-v`` only adds the register/spill
    log; it does not change the code."""
    return [*defines, f"-I{include}", "--std=c++17", "-ftz=true", f"-arch={arch}",
            "--device-as-default-execution-space", "--ptxas-options=-v"]


class Nvrtc:
    def __init__(self, name: str):
        root = install(name)
        _, lib, builtins, include = TOOLKITS[name]
        ctypes.CDLL(str(root / builtins), mode=ctypes.RTLD_GLOBAL)
        self.lib = ctypes.CDLL(str(root / lib))
        self.include = root / include
        self.name = name
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        self.version = f"{major.value}.{minor.value}"

    def compile(self, source: str, options: list[str]) -> tuple[bytes, str]:
        """(cubin, log); raises RuntimeError with the log on failure."""
        lib = self.lib
        prog = ctypes.c_void_p()
        _check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernels.cu", 0, None, None), "create")
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            rc = lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            log_text = log.value.decode(errors="replace")
            if rc:
                raise RuntimeError(f"NVRTC {self.version} failed ({' '.join(options)}):\n{log_text}")
            lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            cubin = ctypes.create_string_buffer(size.value)
            _check(lib.nvrtcGetCUBIN(prog, cubin), "cubin")
            return cubin.raw, log_text
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"nvrtc {what}: error {rc}")


def cubin_entries(cubin: bytes) -> set[str]:
    """Kernel entry points of a cubin: the names of its `.text.<kernel>` sections (ELF64)."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    strtab_off = headers[shstrndx][4]

    def name(offset):
        end = cubin.index(b"\0", strtab_off + offset)
        return cubin[strtab_off + offset:end].decode()

    return {name(h[0])[len(".text."):] for h in headers if name(h[0]).startswith(".text.")}


_INFO = re.compile(r"Compiling entry function '(\w+)' for '(sm_\d+)'.*?"
                   r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads.*?"
                   r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?", re.DOTALL)


@dataclass
class Usage:
    registers: int
    stack: int
    spill_stores: int
    spill_loads: int
    static_smem: int


@dataclass
class GateResult:
    entries: dict = field(default_factory=dict)    # (toolkit, arch, module) -> set of entry names
    usage: dict = field(default_factory=dict)      # (toolkit, arch, kernel) -> Usage
    cubins: dict = field(default_factory=dict)     # (toolkit, arch, module) -> cubin bytes


def units() -> list[tuple[str, int, str]]:
    """The production modules, (source, head dim, format tag) as KernelSpec.module: attention per head
    dim and KV format, cache ops."""
    # Kernels of head dim 0 in an attention source (reduce, merge) live in every module of that source:
    # not a unit.
    return sorted({spec.module for spec in reg.all_kernels() if spec.head_dim or spec.source == reg.CACHE_SOURCE})


def plan(toolkits=tuple(TOOLKITS), archs=ARCHS, full: bool | None = None) -> list[tuple[str, str, tuple]]:
    """(toolkit, arch, module) compiled: see the module docstring."""
    full = os.environ.get(FULL_ENV) == "1" if full is None else full
    jobs = []
    for toolkit in toolkits:
        for arch in archs:
            spot = QUANTISED_SPOT_CHECKS.get((toolkit, arch))
            jobs += [(toolkit, arch, unit) for unit in units()
                     if full or (toolkit, arch) == NEWEST or not unit[2] or (unit[2], unit[1]) == spot]
    return jobs


def run_gate(toolkits=tuple(TOOLKITS), archs=ARCHS, jobs: int = 2, full: bool | None = None) -> GateResult:
    """Compiles plan()'s modules in ``jobs`` processes (NVRTC serialises compiles within a process)."""
    for name in toolkits:
        install(name)
    result = GateResult()
    context = multiprocessing.get_context("spawn")    # no fork of a process holding torch's threads
    with ProcessPoolExecutor(jobs, mp_context=context) as pool:
        for (toolkit, arch, module), cubin, log in pool.map(compile_job, plan(toolkits, archs, full)):
            result.entries[(toolkit, arch, module)] = cubin_entries(cubin)
            result.cubins[(toolkit, arch, module)] = cubin
            result.usage.update({(toolkit, arch, k): u for k, u in usage_from_log(log).items()})
    return result


def compile_job(job: tuple[str, str, tuple]) -> tuple[tuple, bytes, str]:
    """(job, cubin, ptxas log) of one (toolkit, arch, module) of plan(), built as in production."""
    toolkit, arch, (source, head_dim, fmt) = job
    compiler = _compiler(toolkit)
    options = production_options(arch, compiler.include, reg.KernelSpec("", source, head_dim, fmt).defines)
    cubin, log = compiler.compile(reg.kernel_source(source), options)
    return job, cubin, log


def compile_edited(job: tuple[str, str, tuple], old: str, new: str, *more: tuple[str, str]) -> tuple[tuple, bytes, str]:
    """As compile_job, with every ``old`` replaced by ``new`` in the module's expanded source, then each
    further (old, new) pair of ``more`` (negative controls: the production kernel without some of its
    instructions). Each ``old`` must occur."""
    toolkit, arch, (source, head_dim, fmt) = job
    text = reg.kernel_source(source)
    for before, after in ((old, new), *more):
        if before not in text:
            raise ValueError(f"compile_edited: {before!r} is not in {source}'s expanded source")
        text = text.replace(before, after)
    compiler = _compiler(toolkit)
    options = production_options(arch, compiler.include, reg.KernelSpec("", source, head_dim, fmt).defines)
    cubin, log = compiler.compile(text, options)
    return job, cubin, log


def compile_source(toolkit: str, arch: str, source: str) -> tuple[bytes, str]:
    """(cubin, ptxas log) of a standalone source, built with the production options."""
    compiler = _compiler(toolkit)
    return compiler.compile(source, production_options(arch, compiler.include))


def isolated(fn, *args):
    """fn(*args) in a fresh spawned process. NVRTC leaves its thread's C locale at "C" (seen with 12.x and
    13.0 loaded through ctypes), which turns Python's preferred encoding into ASCII for everything the
    caller runs afterwards (open() and read_text() of UTF-8 files then fail): compile off the test process."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


@functools.cache
def _compiler(name: str) -> Nvrtc:
    return Nvrtc(name)      # one per toolkit and process: loading the library is not free


def usage_from_log(log: str) -> dict[str, Usage]:
    """Kernel -> registers, stack, spills and static shared memory, from ptxas's verbose log."""
    usage = {}
    for m in _INFO.finditer(log):
        kernel, _, stack, stores, loads, regs, smem = m.groups()
        usage[kernel] = Usage(int(regs), int(stack), int(stores), int(loads), int(smem or 0))
    return usage


def format_table(result: GateResult) -> str:
    """One row per kernel, one column per (arch, NVRTC): registers and spill bytes (stores + loads)
    as ``regs/spill`` ("." where that pair did not compile the kernel)."""
    columns = sorted({(arch, toolkit) for toolkit, arch, _ in result.usage})
    cells: dict = {}
    for (toolkit, arch, kernel), u in result.usage.items():
        dim = re.search(r"_d(\d+)$", kernel)
        row = (re.sub(r"_d\d+$", "", kernel), int(dim.group(1)) if dim else 0)
        regs, spill = cells.get((row, arch, toolkit), (0, 0))
        cells[(row, arch, toolkit)] = (max(regs, u.registers), spill + u.spill_stores + u.spill_loads)
    head = f"{'kernel':<24}{'dim':>4} " + " ".join(f"{arch + ' ' + tk:>12}" for arch, tk in columns)
    lines = [head + "   (registers/spill bytes)"]
    for row in sorted({r for r, _, _ in cells}):
        lines.append(f"{row[0]:<24}{row[1] or '-':>4} " +
                     " ".join(f"{'{}/{}'.format(*cells[(row, arch, tk)]) if (row, arch, tk) in cells else '.':>12}"
                              for arch, tk in columns))
    return "\n".join(lines)


if __name__ == "__main__":
    res = run_gate(full=True if "--full" in sys.argv[1:] else None)
    print(format_table(res))
    report = cache_root() / "nvrtc_report.json"
    report.write_text(json.dumps({"|".join(k): vars(v) for k, v in res.usage.items()}, indent=1))
    (cache_root() / "nvrtc_report.txt").write_text(format_table(res) + "\n")
    print(f"wrote {report}")
