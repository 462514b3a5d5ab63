"""Run the CUDA kernels of cuda/ on the CPU: build them with the shim (shim/shim.h) into shared
libraries, launch them through ctypes with the same arguments the GPU path passes to CuPy.

    backend = shim_backend(schedule="warp_ahead")   # CudaBackend over CPU torch tensors
    backend.decode_attention(query, k_pool, v_pool, block_tables, context_lens, scale)

Test infrastructure only; never imported by the package.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import numpy as np

from hf_paged.backends import kernel_registry as reg
from hf_paged.backends.cuda_backend import CudaBackend
from hf_paged.backends.launch_checks import DeviceLimits

HERE = Path(__file__).resolve().parent
SHIM_DIR = HERE / "shim"
CUDA_DIR = Path(str(resources.files("hf_paged.cuda")))
SCHEDULES = {"in_order": 0, "reverse": 1, "random": 2, "warp_ahead": 3}
CACHE_ENV = "HF_PAGED_SHIM_CACHE"
FLAGS = ("-x", "c++", "-std=c++17", "-O1", "-fPIC", "-shared", "-w")
SANITIZE_ENV = "HF_PAGED_SHIM_SANITIZE"  # e.g. "thread" or "address,undefined"
SOURCES_ENV = "HF_PAGED_SHIM_SOURCES"    # another copy of cuda/ (the mutation check uses it)


class KernelError(RuntimeError):
    """A kernel run by the shim failed a check (race symptom, divergence, out-of-range shared memory)."""


class LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_longlong),
                ("schedule", ctypes.c_int), ("seed", ctypes.c_int)]


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or Path(tempfile.gettempdir()) / f"hf_paged_shim_{os.getuid()}"
    return Path(root)


def module_units(head_dims=reg.HEAD_DIMS) -> list[tuple[str, int, str]]:
    """Registry modules (source, head dim, format tag) of each library built by default: model-dtype
    attention (attention.cu and fast_attention.cu) per head dim, cache ops once. Quantised attention modules: quantised_units."""
    return ([(reg.ATTENTION_SOURCE, d, "") for d in head_dims] + [(reg.FAST_SOURCE, d, "") for d in head_dims]
            + [(reg.CACHE_SOURCE, 0, "")])


def quantised_units(head_dims=reg.HEAD_DIMS, formats=tuple(reg.KV_FORMAT_TAGS.values())) -> list[tuple[str, int, str]]:
    """Attention modules of quantised formats (each format's kernels for one head dim)."""
    return [(reg.ATTENTION_SOURCE, d, f) for f in formats for d in reg.kv_format_head_dims(f) if d in head_dims]


class ShimLibraries(dict):
    """{module: library path}. A module not built yet is built on first lookup with the same options,
    so tests pay only for the modules they launch (the quantised ones are many)."""

    def __init__(self, paths: dict, options: dict):
        super().__init__(paths)
        self.options = options

    def __missing__(self, unit):
        self.update(build(units=[unit], **self.options))
        return self[unit]


def build(sanitize: str | None = None, sources_dir: Path | None = None, jobs: int = 2,
          head_dims=reg.HEAD_DIMS, units=None) -> ShimLibraries:
    """Compile the modules (cached by a hash of the sources, shim and flags); {module: path}, a module
    being the registry's (source, head dim, format tag). units: the modules (default: module_units of
    head_dims). sanitize: g++ -fsanitize= value (load the runtime with LD_PRELOAD; see test_sanitizers.py)."""
    sanitize = sanitize if sanitize is not None else os.environ.get(SANITIZE_ENV, "")
    sources_dir = Path(sources_dir or os.environ.get(SOURCES_ENV) or CUDA_DIR)
    options = {"sanitize": sanitize, "sources_dir": sources_dir, "jobs": jobs}
    flags = list(FLAGS) + ([f"-fsanitize={sanitize}", "-g", "-fno-omit-frame-pointer"] if sanitize else [])
    text = b"".join(p.read_bytes() for p in sorted(sources_dir.glob("*.cu*")) + sorted(SHIM_DIR.glob("*.h")))
    digest = hashlib.sha256(text + " ".join(flags).encode()).hexdigest()[:16]
    out_dir = cache_dir() / digest
    out_dir.mkdir(parents=True, exist_ok=True)

    def one(unit):
        source, dim, fmt = unit
        lib = out_dir / f"{Path(source).stem}_{dim}_{fmt or 'model'}.so"
        if not lib.exists():
            tmp = lib.with_suffix(f".{os.getpid()}.tmp")
            cmd = ["g++", *flags, "-include", str(SHIM_DIR / "shim.h"), f"-I{SHIM_DIR}", f"-I{sources_dir}",
                   *reg.KernelSpec("", source, dim, fmt).defines, str(sources_dir / source), "-o", str(tmp)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"shim build failed: {' '.join(cmd)}\n{proc.stderr[-4000:]}")
            tmp.replace(lib)
        return unit, lib

    with ThreadPoolExecutor(jobs) as pool:
        return ShimLibraries(dict(pool.map(one, module_units(head_dims) if units is None else units)), options)


class ShimLauncher:
    """Launcher for CudaBackend that runs kernels in the CPU shim (arguments: numpy scalars)."""

    def __init__(self, libraries: dict, schedule: str = "in_order", seed: int = 0, sms: int = 4):
        self.paths = libraries          # a ShimLibraries builds missing modules on first use
        self.libs: dict = {}
        self.schedule = schedule
        self.seed = seed
        self.sms = sms
        self.launches: list[str] = []   # names launched, for tests that check which kernels ran

    def sm_count(self, device) -> int:
        return self.sms

    def device_limits(self, device) -> DeviceLimits:
        """An H200's limits (the shim runs whatever it is given; the backend checks against these)."""
        return DeviceLimits.for_arch("sm_90", self.sms)

    def library(self, spec: reg.KernelSpec):
        if spec.module not in self.libs:
            self.libs[spec.module] = ctypes.CDLL(str(self.paths[spec.module]))
        return self.libs[spec.module]

    def launch(self, spec, device, grid, block, args, shared_mem: int) -> None:
        if device.type != "cpu":
            raise ValueError(f"the shim runs kernels on CPU tensors, got {device}")
        lib = self.library(spec)
        fn = getattr(lib, spec.name + "__launch")
        fn.restype = ctypes.c_int
        cells = [np.array(a) for a in args]           # each argument's bytes, kept alive for the call
        if any(c.dtype == object or c.ndim for c in cells):
            raise TypeError(f"{spec.name}: kernel arguments must be numpy scalars, got {args}")
        argv = (ctypes.c_void_p * len(cells))(*[c.ctypes.data for c in cells])
        sizes = (ctypes.c_longlong * len(cells))(*[c.nbytes for c in cells])
        cfg = LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_mem,
                           SCHEDULES[self.schedule], self.seed)
        self.launches.append(spec.name)
        if fn(ctypes.byref(cfg), argv, sizes, len(cells)):
            lib.cudashim_last_error.restype = ctypes.c_char_p
            raise KernelError(f"{spec.name}: {lib.cudashim_last_error().decode()}")


def shim_backend(libraries: dict | None = None, schedule: str = "in_order", seed: int = 0,
                 partition_size: int | None = None, sms: int = 4, fast_kernels: bool = True) -> CudaBackend:
    """A backend object (write_kv, copy_blocks, decode_attention, extend_attention) over CPU tensors
    that runs the real kernels through the shim; usable as PagedCache(..., backend=...)."""
    return CudaBackend(ShimLauncher(libraries or build(), schedule, seed, sms), partition_size, fast_kernels)
