"""Import CuPy for the CUDA kernels; when it is missing or mismatched, say which package to install.

Two extras carry it (pyproject.toml):

    pip install "hf-paged[cuda]"     cupy-cuda12x + CUDA 12 headers (nvidia-cuda-runtime-cu12); runs on
                                     CUDA 12 and CUDA 13 drivers
    pip install "hf-paged[cuda13]"   cupy-cuda13x + CUDA 13 headers (nvidia-cuda-runtime); needs a CUDA 13
                                     driver (cuDriverGetVersion >= 13000)

The CuPy wheels all install the same ``cupy`` module, so two of them at once overwrite each other's files;
cupy-cuda11x is below what the kernels support. Both are refused before ``import cupy`` with the
commands that fix them. NVRTC compiles the kernels against ``cuda_fp16.h``; :func:`cuda_include_dirs`
finds it, preferring headers of CuPy's own CUDA major. Nothing here runs at import.
"""
from __future__ import annotations

import ctypes
import importlib
import os
import re
import sys
from importlib import metadata
from pathlib import Path

# distribution -> CUDA major it is built for (None: built from source against a local toolkit)
CUPY_DISTRIBUTIONS = {"cupy-cuda11x": 11, "cupy-cuda12x": 12, "cupy-cuda13x": 13, "cupy": None}
SUPPORTED_MAJORS = (12, 13)
EXTRAS = {
    12: 'pip install "hf-paged[cuda]" (cupy-cuda12x + CUDA 12 headers; runs on CUDA 12 and 13 drivers)',
    13: 'pip install "hf-paged[cuda13]" (cupy-cuda13x + CUDA 13 headers; needs a CUDA 13 driver)',
}
HEADER_WHEELS = {12: "nvidia-cuda-runtime-cu12", 13: "nvidia-cuda-runtime"}
FORCE_TORCH_HINT = "Or set HF_PAGED_FORCE_TORCH=1 to use the PyTorch path."
_VERSION_DEFINE = re.compile(r"#define\s+(?:CUDART_VERSION|CUDA_VERSION)\s+(\d+)")


def installed_cupy() -> dict[str, str]:
    """{distribution: version} of every CuPy distribution installed (importlib.metadata)."""
    found = {}
    for name in CUPY_DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def driver_version() -> int | None:
    """The CUDA version the installed driver supports (e.g. 13000 for 13.0), or None when unknown.

    Asks libcuda's ``cuDriverGetVersion`` (allowed before ``cuInit``; needs no GPU context), else
    CuPy's runtime if it is already imported."""
    names = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value > 0:
            return version.value
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            return int(cupy.cuda.runtime.driverGetVersion()) or None
        except Exception:  # noqa: BLE001 - no driver / no device: unknown, not an error here
            return None
    return None


def _version_text(version: int | None) -> str:
    return "unknown" if version is None else f"{version // 1000}.{version % 1000 // 10}"


def install_advice(driver: int | None) -> str:
    """The install command(s) for a machine whose driver supports CUDA ``driver`` (None: unknown)."""
    if driver is None:
        return f"{EXTRAS[12]}, or on a CUDA 13 driver {EXTRAS[13]} (driver version unread; nvidia-smi shows it)"
    if driver >= 13000:
        return f"{EXTRAS[13]} or {EXTRAS[12]} (this driver supports CUDA {_version_text(driver)})"
    if driver >= 12000:
        return f"{EXTRAS[12]} (this driver supports CUDA {_version_text(driver)})"
    return (f"update the NVIDIA driver (it supports CUDA {_version_text(driver)}; the kernels need CUDA 12 or "
            f"newer: driver >= 525 for CUDA 12, >= 580 for CUDA 13), then {EXTRAS[12]}")


def diagnose(installed: dict[str, str], driver: int | None) -> str | None:
    """What is wrong with these CuPy distributions on this driver, or None. Pure: tested directly."""
    listed = ", ".join(f"{name} {version}" for name, version in sorted(installed.items()))
    if len(installed) > 1:
        return (f"several CuPy packages are installed ({listed}); they all install the same `cupy` module "
                f"and overwrite each other's files. Remove them all (pip uninstall -y "
                f"{' '.join(sorted(installed))}), then install one: {install_advice(driver)}.")
    if "cupy-cuda11x" in installed:
        return (f"{listed} is installed, but hf_paged's kernels need CuPy for CUDA "
                f"{' or '.join(map(str, SUPPORTED_MAJORS))}: pip uninstall -y cupy-cuda11x, then "
                f"{install_advice(driver)}.")
    if "cupy-cuda13x" in installed and driver is not None and driver < 13000:
        return (f"{listed} is installed, but this CUDA driver supports only CUDA {_version_text(driver)} "
                f"(cupy-cuda13x needs 13.0 or newer): pip uninstall -y cupy-cuda13x, then "
                f"{install_advice(driver)}; or update the NVIDIA driver (>= 580).")
    return None


def import_cupy(require_headers: bool = True):
    """The ``cupy`` module, checked; raises ImportError with the command that fixes what is wrong.

    Refused: no CuPy, several CuPy distributions at once, cupy-cuda11x, cupy-cuda13x on a driver older
    than CUDA 13, and (``require_headers``) no ``cuda_fp16.h`` for NVRTC. Every message ends with the
    HF_PAGED_FORCE_TORCH=1 escape."""
    installed = installed_cupy()
    driver = driver_version()
    problem = diagnose(installed, driver)
    if problem:
        raise ImportError(f"hf_paged's CUDA kernels: {problem} {FORCE_TORCH_HINT}")
    try:
        cupy = importlib.import_module("cupy")
    except ImportError as exc:
        if installed:
            listed = ", ".join(f"{n} {v}" for n, v in installed.items())
            raise ImportError(f"hf_paged's CUDA kernels: {listed} is installed but `import cupy` failed "
                              f"({exc}). Reinstall it: {install_advice(driver)}. {FORCE_TORCH_HINT}") from exc
        raise ImportError(f"hf_paged's CUDA kernels need CuPy, which is not installed: "
                          f"{install_advice(driver)}. {FORCE_TORCH_HINT}") from exc
    if require_headers:
        major = cupy_cuda_major(cupy)
        if not cuda_include_dirs(major):
            wheel = HEADER_WHEELS.get(major, " or ".join(HEADER_WHEELS.values()))
            raise ImportError(f"hf_paged's CUDA kernels need the CUDA headers (cuda_fp16.h) for NVRTC and "
                              f"none were found ($CUDA_PATH/include, /usr/local/cuda/include, the pip wheels "
                              f"nvidia/cu13/include and nvidia/cuda_runtime/include): pip install {wheel}, or "
                              f"{install_advice(driver)}. {FORCE_TORCH_HINT}")
    return cupy


def cupy_cuda_major(cupy) -> int | None:
    """The CUDA major CuPy was built for (its runtime version), else the one its distribution names."""
    try:
        return int(cupy.cuda.runtime.runtimeGetVersion()) // 1000
    except Exception:  # noqa: BLE001 - a fake or broken cupy: fall back to the distribution name
        majors = [CUPY_DISTRIBUTIONS[name] for name in installed_cupy() if CUPY_DISTRIBUTIONS[name]]
        return majors[0] if len(majors) == 1 else None


def header_version(include_dir: Path) -> int | None:
    """CUDART_VERSION (or CUDA_VERSION) of the headers in ``include_dir``, e.g. 12090; None if unread."""
    for name in ("cuda_runtime_api.h", "cuda.h"):
        try:
            match = _VERSION_DEFINE.search((include_dir / name).read_text(errors="replace"))
        except OSError:
            continue
        if match:
            return int(match.group(1))
    return None


def cuda_include_dirs(cuda_major: int | None = None) -> list[str]:
    """The folder holding cuda_fp16.h, as a one-element list (empty when none): $CUDA_PATH, then
    /usr/local/cuda, then the pip wheels (nvidia/cu13/include, nvidia/cuda_runtime/include).

    With ``cuda_major`` (CuPy's, see :func:`cupy_cuda_major`), folders whose headers are of that major
    come first, in the same order, since NVRTC 12 may not parse CUDA 13 headers and the reverse."""
    candidates = [Path(p) / "include" for p in (os.environ.get("CUDA_PATH"), "/usr/local/cuda") if p]
    try:
        import nvidia  # noqa: PLC0415  (namespace package of the pip CUDA wheels)
        for root in map(Path, nvidia.__path__):
            candidates += [root / "cu13" / "include", root / "cuda_runtime" / "include"]
    except ImportError:
        pass
    found = [c for c in candidates if (c / "cuda_fp16.h").is_file()]
    if cuda_major is not None:
        found.sort(key=lambda c: (header_version(c) or 0) // 1000 != cuda_major)   # stable: order kept
    return [str(c) for c in found][:1]
