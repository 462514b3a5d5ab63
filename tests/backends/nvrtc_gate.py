"""NVRTC compile gate with no GPU: NVRTC from pip wheels, loaded through ctypes.

Every kernel of hf_paged.backends.kernel_registry is compiled to cubin for sm_80 and sm_90 by each NVRTC
(oldest supported 12.x, newest 12.x, 13.x), the cubin's entry symbols are compared with the registry,
and registers / shared memory / spills are read from ptxas's verbose log.

    python tests/backends/nvrtc_gate.py        # prints the table, writes nvrtc_report.json in the cache

The wheels are installed on first use with ``pip install --no-deps --target`` into
$HF_PAGED_NVRTC_CACHE (default ~/.cache/hf_paged/nvrtc).
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from hf_paged.backends import kernel_registry as reg

ARCHS = ("sm_80", "sm_90")
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
    target = cache_root() / name
    if (target / ".complete").exists() or (target / TOOLKITS[name][1]).exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    *TOOLKITS[name][0]], check=True)
    (target / ".complete").touch()
    return target


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
                   r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?", re.S)


@dataclass
class Usage:
    registers: int
    stack: int
    spill_stores: int
    spill_loads: int
    static_smem: int


@dataclass
class GateResult:
    entries: dict = field(default_factory=dict)    # (toolkit, arch, unit) -> set of entry names
    usage: dict = field(default_factory=dict)      # (toolkit, arch, kernel) -> Usage


def units() -> list[tuple[str, tuple[str, ...]]]:
    """(source, defines) compiled by the gate: the production modules (attention per head dim, cache ops)."""
    # The reduce kernels (attention source, head dim 0) live in every attention module: not a unit.
    return sorted({(spec.source, spec.defines) for spec in reg.all_kernels()
                   if spec.head_dim or spec.source != reg.ATTENTION_SOURCE})


def run_gate(toolkits=tuple(TOOLKITS), archs=ARCHS, jobs: int = 2) -> GateResult:
    compilers = [Nvrtc(name) for name in toolkits]
    jobs_list = [(c, arch, unit) for c in compilers for arch in archs for unit in units()]

    def one(job):
        compiler, arch, (source, defines) = job
        options = [f"--gpu-architecture={arch}", f"-I{compiler.include}", "--ptxas-options=-v",
                   *defines]
        cubin, log = compiler.compile(reg.kernel_source(source), options)
        return job, cubin_entries(cubin), log

    result = GateResult()
    with ThreadPoolExecutor(jobs) as pool:
        for (compiler, arch, (source, defines)), entries, log in pool.map(one, jobs_list):
            result.entries[(compiler.name, arch, source + "".join(defines))] = entries
            for m in _INFO.finditer(log):
                kernel, _, stack, stores, loads, regs, smem = m.groups()
                result.usage[(compiler.name, arch, kernel)] = Usage(int(regs), int(stack), int(stores),
                                                                    int(loads), int(smem or 0))
    return result


def format_table(result: GateResult) -> str:
    """One row per kernel, one column per (arch, NVRTC): registers and spill bytes (stores + loads)
    as ``regs/spill``."""
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
                     " ".join(f"{'%d/%d' % cells[(row, arch, tk)]:>12}" for arch, tk in columns))
    return "\n".join(lines)


if __name__ == "__main__":
    res = run_gate()
    print(format_table(res))
    report = cache_root() / "nvrtc_report.json"
    report.write_text(json.dumps({"|".join(k): vars(v) for k, v in res.usage.items()}, indent=1))
    (cache_root() / "nvrtc_report.txt").write_text(format_table(res) + "\n")
    print(f"wrote {report}")
