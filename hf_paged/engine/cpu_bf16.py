"""Whether this CPU computes bfloat16 natively, and what the engine says when it does not.

The engine runs a bfloat16 model as it is (weights and activations bf16, the fused ops and oneDNN's
matmuls accumulating in float32). That is fast only where the CPU has bf16 instructions: AVX-512 BF16
(``avx512_bf16``) or AMX (``amx_bf16`` with ``amx_tile``). Elsewhere (e.g. AVX2-only CPUs) PyTorch converts
every bf16 operand to float32 and back, so bf16 halves the weight memory but costs speed (README, "bf16 on
the CPU"). The dtype stays the caller's choice (``--dtype`` / the model's dtype); the engine only warns.
"""
from __future__ import annotations

from pathlib import Path

import torch

NATIVE_FLAGS = ("avx512_bf16", "amx_bf16")      # either suffices; amx_bf16 comes with amx_tile


def _cpuinfo_field(key: str, cpuinfo: str | Path) -> tuple[bool, str | None]:
    """(whether /proc/cpuinfo could be read, the first processor's ``key`` field or None)."""
    try:
        lines = Path(cpuinfo).read_text().splitlines()
    except OSError:
        return False, None
    return True, next((line.partition(":")[2] for line in lines if line.startswith(key)), None)


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str] | None:
    """The first processor's flags from /proc/cpuinfo; None where the file is absent (not Linux)."""
    readable, flags = _cpuinfo_field("flags", cpuinfo)
    return set((flags or "").split()) if readable else None


def cpu_vendor(cpuinfo: str | Path = "/proc/cpuinfo") -> str | None:
    """The first processor's ``vendor_id`` from /proc/cpuinfo (``GenuineIntel``, ``AuthenticAMD``, ...); None
    where the file or the field is absent (not Linux, not x86)."""
    vendor = _cpuinfo_field("vendor_id", cpuinfo)[1]
    return vendor.strip() if vendor is not None else None


def native_bf16(flags: set[str] | None = None) -> bool:
    """Whether the CPU has bf16 instructions. ``flags``: /proc/cpuinfo's (read when None); without them
    (not Linux) oneDNN's own answer stands in."""
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return any(f in flags for f in NATIVE_FLAGS)


def bf16_warning(dtype: torch.dtype, device: torch.device, flags: set[str] | None = None) -> str | None:
    """The warning for a bfloat16 model on a CPU without bf16 instructions; None when there is nothing to
    say (another dtype, another device, or a CPU that has them)."""
    if dtype != torch.bfloat16 or device.type != "cpu" or native_bf16(flags):
        return None
    return (f"bfloat16 model on a CPU without bf16 instructions (none of {', '.join(NATIVE_FLAGS)} in "
            f"/proc/cpuinfo; PyTorch's CPU capability: {torch.backends.cpu.get_cpu_capability()}): every bf16 "
            "op is emulated through float32 and oneDNN's prepacked bf16 linears are unavailable, so bf16 halves "
            "the weight memory but runs slower than float32 here (README, 'bf16 on the CPU'). Load the model "
            "in float32 (hf-paged serve --dtype float32, or dtype=torch.float32) for speed.")
