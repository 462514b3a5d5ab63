"""Building hf_paged's C++ CPU extensions (``cuda/*.cpp``) through torch's extension loader, and the
environment switches that steer them.

``build_extension`` compiles, or loads from torch's extension cache (``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), one extension under a name that hashes its sources, headers, flags, torch's
and Python's versions and the CPU's features. Four things it guards against that torch's loader does not:
a cached library cut short (a full disk, a killed link: torch loads it and the process dies of SIGBUS) is
found by its ELF header and built again; a build killed while it held torch's lock file (SIGKILL, a notebook
kernel restarted, a deadline's kill) left that file behind, and torch then waits for it forever: builds are
serialised by a kernel lock instead (``flock``, released when its holder dies), under which a torch lock file
can only be a dead build's, so it is removed; the key's flags are never handed to torch as a list it may extend
(it appends its own link flags in place, which renamed every later build of the process); and a build that
failed is not tried again in the same process (each attempt cost a full compile and a warning).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import re
import struct
import sys
from importlib import resources
from pathlib import Path

import torch

log = logging.getLogger("hf_paged.backends")
KERNEL_ENV = "HF_PAGED_CPU_KERNEL"
ARCH_ENV = "HF_PAGED_CPU_ARCH"     # the builds' -march (default native): e.g. x86-64-v3 for an AVX2 build
# -fopenmp: at::parallel_for is inline OpenMP in torch's headers (serial without it); the extension then
# needs libgomp.so.1, which resolves to the copy torch has already loaded (one OpenMP runtime, torch's threads).
LDFLAGS = ("-fopenmp",)
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_switch(name: str, default: bool) -> bool:
    """An on/off environment variable: 1 / true / yes / on or 0 / false / no / off (any case), unset or empty
    for ``default``; any other value raises ValueError naming them."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _ON or value in _OFF:
        return value in _ON
    raise ValueError(f"{name}={os.environ[name]!r}: use 1 (on) or 0 (off), or unset it")


def kernel_enabled() -> bool:
    """``$HF_PAGED_CPU_KERNEL`` (default on): the CPU attention kernel, else the PyTorch path."""
    return env_switch(KERNEL_ENV, True)


def march() -> str:
    """The C++ extensions' ``-march``: ``HF_PAGED_CPU_ARCH`` (default ``native``: all that this CPU has). Another
    value builds what an older CPU runs (``x86-64-v3``: AVX2 + FMA, ``x86-64``: the scalar paths), to run or time
    the kernels' other code paths on this machine. Read when a process first builds or loads an extension; a
    process keeps the build it loaded."""
    arch = os.environ.get(ARCH_ENV, "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", arch):
        raise ValueError(f"{ARCH_ENV}={arch!r} is not a -march value "
                         "(e.g. native, x86-64-v3, x86-64, armv8.2-a+fp16)")
    return arch


def cflags() -> list[str]:
    """Both C++ extensions' compiler flags (``-march`` from ``march()``)."""
    return ["-O3", f"-march={march()}", "-fopenmp", "-fno-math-errno", "-std=c++17"]


def cpu_features() -> str:
    """The CPU's feature flags (the build uses -march=native, so a build is only valid on alike CPUs)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_extension(prefix: str, sources: tuple[str, ...], headers: tuple[str, ...] = (), flags=None,
                    what: str = "the CPU paged-attention kernel") -> None:
    """Build (or load from torch's extension cache) the C++ ``sources`` of ``hf_paged.cuda`` into this process.
    Raises RuntimeError with the compiler's complaint when it cannot be built (tried once per process and build:
    a later call raises the same error at once). ``flags``: the compiler's, default ``cflags()``."""
    failure = _built(prefix, tuple(sources), tuple(headers), tuple(cflags() if flags is None else flags), what)
    if failure is not None:
        raise RuntimeError(failure)


@functools.lru_cache(maxsize=None)
def _built(prefix: str, sources: tuple[str, ...], headers: tuple[str, ...], flags: tuple[str, ...],
           what: str) -> str | None:
    """Build and load; None, or why it failed. Memoised: an extension is loaded into a process once (torch's
    op registry is the process's), and a failed build is not repeated there."""
    from torch.utils import cpp_extension  # noqa: PLC0415  (pulls in setuptools; only when building)
    folder = resources.files("hf_paged.cuda")
    name = build_name(prefix, sources, headers, flags)
    log.info("building or loading %s, %s (built once per machine, 20-60 s on 2 cores; cached by torch)", what, name)
    try:
        with _build_lock(name), resources.as_file(folder) as path:   # the sources include their headers from it
            _drop_if_cut_short(name)
            cpp_extension.load(name=name, sources=[str(path / n) for n in sources], extra_cflags=list(flags),
                               extra_ldflags=list(LDFLAGS), is_python_module=False, verbose=False)
    except Exception as err:    # compiler missing or failing: the caller decides whether to fall back
        return f"could not build {what} ({', '.join(sources)}): {err}"
    log.info("%s loaded", name)
    return None


def build_name(prefix: str, sources: tuple[str, ...], headers: tuple[str, ...], flags: tuple[str, ...]) -> str:
    """The extension's name in torch's cache: ``prefix`` + a hash of its sources, headers, flags, torch's and
    Python's versions and the CPU's features (a change to any of them is another build)."""
    folder = resources.files("hf_paged.cuda")
    texts = [(folder / name).read_text() for name in sources + headers]
    key = "\0".join([*texts, " ".join([*flags, *LDFLAGS]), torch.__version__, sys.version, cpu_features()])
    return prefix + hashlib.sha1(key.encode()).hexdigest()[:12]


@contextlib.contextmanager
def _build_lock(name: str):
    """Hold build ``name``'s kernel lock (``flock`` on a file beside torch's build): one process builds a name at a
    time, and the lock is released when its holder exits, however it dies. Under it no live process of ours
    holds torch's lock file (``lock``), so one found there was left by a killed build: removed, or torch would
    wait on it forever. Without ``fcntl`` (not POSIX) or a build directory torch can tell, torch's lock alone."""
    from torch.utils import cpp_extension  # noqa: PLC0415
    handle = None
    try:
        import fcntl  # noqa: PLC0415
        folder = Path(cpp_extension._get_build_directory(name, verbose=False))
        handle = open(folder / "hf_paged_build.flock", "w")      # noqa: SIM115  (closed below)
    except Exception:                       # another OS or torch: nothing to lock with
        pass
    if handle is None:
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)  # waits while another process builds this name
        except OSError as err:              # a file system without locks: torch's lock alone
            log.info("no build lock for %s (%s): a killed build's lock file would stay", name, err)
            yield
            return
        stale = folder / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build of %s that was killed (torch would wait on it forever)",
                        stale, name)
            stale.unlink(missing_ok=True)
        yield                               # the lock goes with the handle's close (or the process)


def _drop_if_cut_short(name: str) -> None:
    """Delete the cached library of build ``name`` when it is shorter than its ELF header says (torch would
    load it as up to date, and the process would die of SIGBUS), so that it is built again."""
    from torch.utils import cpp_extension  # noqa: PLC0415
    try:
        library = Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so"
    except Exception:                       # another torch: nothing to check against
        return
    if library.is_file() and not _whole_elf(library):
        log.warning("the cached build %s is damaged (cut short): building it again", library)
        library.unlink()


def _whole_elf(path: Path) -> bool:
    """Whether ``path`` is a 64-bit little-endian ELF file at least as long as its section header table's end
    (the table is the file's last part; a truncated file ends before it)."""
    with open(path, "rb") as f:
        header = f.read(64)
    if len(header) < 64 or header[:4] != b"\x7fELF":
        return False
    if header[4:6] != b"\x02\x01":          # 32-bit or big-endian: not checked
        return True
    shoff, = struct.unpack_from("<Q", header, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", header, 0x3A)
    return path.stat().st_size >= shoff + shentsize * shnum
