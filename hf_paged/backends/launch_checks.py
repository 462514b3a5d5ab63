"""Checks before a kernel launch: grid, block and shared memory against the device's limits, tensors on
the launch's device and aligned as the kernel loads them, scalars that travel as int32.

Pure Python (torch only for tensor attributes and device properties), so the same checks run before a
CuPy launch on a GPU and in the CPU tests' recording launcher. A failed check raises ``ValueError``
naming the kernel, the value, the limit and, where the caller gives one, where the value came from and
the knob that changes it::

    check_launch("hfp_extend_bf16_d128", (8, 1, 70000), (128, 1, 1), 40960, limits,
                 explain={"grid.z": "query tokens 280000 / 4 per CTA; chunk the prompt"})
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch

KIB = 1024
# Opt-in dynamic shared memory per block by compute capability (CUDA C Programming Guide, "Technical
# Specifications per Compute Capability"): what cudaFuncSetAttribute(MaxDynamicSharedMemorySize) allows.
SHARED_OPTIN_BY_CC = MappingProxyType({
    (7, 0): 96 * KIB, (7, 2): 96 * KIB, (7, 5): 64 * KIB,
    (8, 0): 163 * KIB, (8, 6): 99 * KIB, (8, 7): 163 * KIB, (8, 9): 99 * KIB,
    (9, 0): 227 * KIB,
    (10, 0): 227 * KIB, (10, 3): 227 * KIB, (12, 0): 99 * KIB,
})
DEFAULT_SHARED = 48 * KIB          # without opt-in, every architecture since sm_30
_ARCH = re.compile(r"sm_(\d+?)(\d)[a-z]?")
# Why a kernel needs an alignment, for the error message.
_ALIGNMENT_REASONS = MappingProxyType({16: "loaded as 16-byte vectors", 8: "loaded as 8-byte words",
                                       4: "read as 4-byte words", 2: "read as 2-byte elements"})


@dataclass(frozen=True)
class DeviceLimits:
    """What one launch may ask of a device.

    max_grid: blocks per grid dimension (x, y, z); max_block: threads per block dimension;
    max_threads_per_block: threads of a whole block; max_shared_optin: dynamic shared memory per block
    after opt-in (bytes); default_shared: without opt-in; sm_count: streaming multiprocessors.
    """

    max_shared_optin: int
    sm_count: int
    max_grid: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
    max_block: tuple[int, int, int] = (1024, 1024, 64)
    max_threads_per_block: int = 1024
    default_shared: int = DEFAULT_SHARED
    arch: str = ""

    @classmethod
    def for_arch(cls, arch: str, sm_count: int) -> DeviceLimits:
        """Limits of an architecture named like ``"sm_90"`` (for tests and planning without a device)."""
        match = _ARCH.fullmatch(arch)
        cc = (int(match.group(1)), int(match.group(2))) if match else None
        if cc not in SHARED_OPTIN_BY_CC:
            known = ", ".join(f"sm_{a}{b}" for a, b in SHARED_OPTIN_BY_CC)
            raise ValueError(f"DeviceLimits.for_arch: unknown architecture {arch!r}; known: {known}")
        return cls(max_shared_optin=SHARED_OPTIN_BY_CC[cc], sm_count=int(sm_count), arch=arch)

    @classmethod
    def for_device(cls, device: torch.device | int | str) -> DeviceLimits:
        """Limits of a CUDA device, from ``torch.cuda.get_device_properties`` (the opt-in shared memory
        from ``shared_memory_per_block_optin`` where torch reports it, else by compute capability)."""
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"DeviceLimits.for_device: {device} is not a CUDA device")
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        cc = (props.major, props.minor)
        optin = getattr(props, "shared_memory_per_block_optin", None)
        if not optin:
            same_major = [v for (major, _), v in SHARED_OPTIN_BY_CC.items() if major == cc[0]]
            optin = SHARED_OPTIN_BY_CC.get(cc, min(same_major, default=DEFAULT_SHARED))
        threads = getattr(props, "max_threads_per_block", None) or 1024
        return cls(max_shared_optin=int(optin), sm_count=int(props.multi_processor_count),
                   max_threads_per_block=int(threads), arch=f"sm_{cc[0]}{cc[1]}")


def _as_int(kernel_name: str, what: str, value) -> int:
    """An integer launch value as a Python int (numpy integers accepted; floats and bools refused)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{kernel_name}: {what} = {value!r} ({type(value).__name__}) must be an integer")  # noqa: TRY004 (every refused launch: ValueError)
    return int(value)


def _dims(kernel_name: str, what: str, dims) -> tuple[int, int, int]:
    if isinstance(dims, (int, np.integer)) and not isinstance(dims, (bool, np.bool_)):
        dims = (dims,)
    if not isinstance(dims, Sequence) or not 1 <= len(dims) <= 3:
        raise ValueError(f"{kernel_name}: {what} = {dims!r} must be 1 to 3 integers (x, y, z)")
    values = [_as_int(kernel_name, f"{what}.{'xyz'[i]}", d) for i, d in enumerate(dims)]
    return tuple(values + [1] * (3 - len(values)))


def _suffix(explain: Mapping[str, str] | None, key: str, default: str) -> str:
    text = (explain or {}).get(key) or default
    return f" ({text})" if text else ""


def check_launch(kernel_name: str, grid, block, shared_mem, limits: DeviceLimits,
                 explain: Mapping[str, str] | None = None) -> None:
    """Refuse a launch the device would reject (or run wrongly): every grid and block dimension an
    integer in [1, limit], threads per block and dynamic shared memory (bytes) within ``limits``.

    explain: optional text per checked quantity ("grid.x", "grid.y", "grid.z", "block", "shared_mem"):
    where the value came from and the knob that lowers it, appended to the error.
    """
    grid = _dims(kernel_name, "grid", grid)
    block = _dims(kernel_name, "block", block)
    shared_mem = _as_int(kernel_name, "shared_mem", shared_mem)
    for axis, value, limit in zip("xyz", grid, limits.max_grid):
        key = f"grid.{axis}"
        if value < 1:
            raise ValueError(f"{kernel_name}: {key} = {value} must be at least 1 (an empty launch should be "
                             f"skipped by the caller){_suffix(explain, key, '')}")
        if value > limit:
            raise ValueError(f"{kernel_name}: {key} = {value} exceeds the device limit {limit}"
                             f"{_suffix(explain, key, 'the caller must tile this dimension')}")
    for axis, value, limit in zip("xyz", block, limits.max_block):
        if not 1 <= value <= limit:
            raise ValueError(f"{kernel_name}: block.{axis} = {value} is outside the device limits [1, {limit}]"
                             f"{_suffix(explain, 'block', '')}")
    threads = block[0] * block[1] * block[2]
    if threads > limits.max_threads_per_block:
        raise ValueError(f"{kernel_name}: {threads} threads per block exceed the device limit "
                         f"{limits.max_threads_per_block}{_suffix(explain, 'block', '')}")
    if shared_mem < 0:
        raise ValueError(f"{kernel_name}: shared_mem = {shared_mem} must not be negative")
    if shared_mem > limits.max_shared_optin:
        arch = f" ({limits.arch})" if limits.arch else ""
        raise ValueError(f"{kernel_name}: shared_mem = {shared_mem} bytes exceeds the device's opt-in maximum "
                         f"{limits.max_shared_optin}{arch}"
                         f"{_suffix(explain, 'shared_mem', 'fewer query rows per CTA (GQA group, tokens per CTA)')}")


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cuda" and (a.index is None or b.index is None):
        current = torch.cuda.current_device()
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index


def check_tensors(kernel_name: str, device: torch.device | str,
                  tensors: Mapping[str, tuple[torch.Tensor | None, int]]) -> None:
    """Every tensor of ``tensors`` (name -> (tensor or None, alignment in bytes)) on ``device`` and its
    first element's address a multiple of the alignment (16 for what a kernel loads as 16-byte
    vectors, 4 for int32 tables). ``None`` entries (optional arguments) are skipped."""
    device = torch.device(device)
    for name, (tensor, alignment) in tensors.items():
        if tensor is None:
            continue
        if not _same_device(tensor.device, device):
            raise ValueError(f"{kernel_name}: {name} is on {tensor.device} but the launch is on {device}; "
                             f"move it to {device} (the pools' device)")
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"{kernel_name}: alignment {alignment} of {name} must be a power of two")
        offset = tensor.data_ptr() % alignment
        if offset:
            reason = _ALIGNMENT_REASONS.get(alignment, f"read in {alignment}-byte units")
            raise ValueError(f"{kernel_name}: {name} at address {tensor.data_ptr():#x} is {offset} bytes past a "
                             f"{alignment}-byte boundary (address % {alignment} = {offset}) but is {reason}; "
                             f"pass a tensor whose storage starts aligned (a .clone() of a view with a "
                             f"storage offset)")


INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


def check_int32_range(name: str, value, knob: str = "") -> np.int32:
    """``value`` as the numpy int32 a kernel argument needs, refusing what int32 cannot hold."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} = {value!r} ({type(value).__name__}) must be an integer (int32 kernel argument)")  # noqa: TRY004
    value = int(value)
    if not INT32_MIN <= value <= INT32_MAX:
        hint = f"; {knob}" if knob else ""
        raise ValueError(f"{name} = {value} does not fit the kernels' int32 argument "
                         f"[{INT32_MIN}, {INT32_MAX}]{hint}")
    return np.int32(value)
