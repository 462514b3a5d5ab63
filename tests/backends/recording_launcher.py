"""A launcher for CudaBackend that records launches instead of running them, and checks each one.

    launcher = RecordingLauncher(DeviceLimits.for_arch("sm_90", sm_count=132))
    CudaBackend(launcher).extend_attention(...)       # nothing runs; every launch is checked
    launcher.launches[-1].grid                          # what a GPU would have been asked to do

Each launch is checked independently of whatever CudaBackend checks itself:
- grid, block and shared memory by ``launch_checks.check_launch`` against the limits given;
- the arguments against the kernel's ``extern "C"`` signature, read from the ``.cu`` source: one numpy
  scalar per parameter, of the parameter's C type (pointers as ``numpy.uint64``, ``int`` as int32,
  ``long long`` as int64, ``float`` as float32);
- every pointer nonzero (unless documented optional, ``OPTIONAL_POINTERS``; nulls are recorded) and a
  multiple of its element size, and of 16 bytes for the tensors the kernels load as 16-byte vectors
  (``VECTOR_POINTERS``).
On the ``meta`` device tensors have no addresses (``data_ptr()`` is 0): the pointer checks are skipped.

Also ``untouched_tensor``: a tensor of any size backed by an anonymous ``MAP_NORESERVE`` mapping, so only
the pages something writes become memory (for inputs the recorder never reads, and for huge KV pools).
Test infrastructure only; never imported by the package.
"""
from __future__ import annotations

import mmap
import re
import sys
from dataclasses import dataclass

import numpy as np
import torch

from hf_paged.backends import kernel_registry as reg
from hf_paged.backends.launch_checks import DeviceLimits, check_launch

# Pointer parameters a launch may pass as null: the split-K scratch of decode (used when splits > 1).
OPTIONAL_POINTERS = frozenset({"part_out", "part_lse"})
# Parameters the kernels read or write in 16-byte words (cuda/attention.cu: PlainHead/QuantHead stage,
# load_rows; the launch-safety item).
VECTOR_POINTERS = frozenset({"out", "query", "k_pool", "v_pool", "k_codes", "v_codes"})
_C_TYPES = {"int": np.int32, "long long": np.int64, "float": np.float32, "unsigned": np.uint32,
            "unsigned int": np.uint32, "unsigned long long": np.uint64}
_ELEMENT_BYTES = {"int": 4, "long long": 8, "unsigned long long": 8, "float": 4, "unsigned": 4,
                  "unsigned int": 4, "unsigned char": 1, "hfp_bf16": 2, "HFP_T(f16)": 2, "HFP_T(bf16)": 2,
                  "HFP_T(f32)": 4}
_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+void\s+')
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)   # Python < 3.13 lacks the name (Linux value)


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str          # the C type without const/__restrict__/'*', macro arguments substituted
    pointer: bool


@dataclass(frozen=True)
class Launch:
    name: str
    device: torch.device
    grid: tuple
    block: tuple
    shared_mem: int
    args: tuple
    params: tuple[Param, ...]
    null_pointers: tuple[str, ...]     # optional pointers passed as null

    def arg(self, name: str):
        """The argument passed for parameter ``name``."""
        return self.args[[p.name for p in self.params].index(name)]


class RecordingLauncher:
    """CudaBackend's launcher protocol (``launch``, ``sm_count``); records, checks, runs nothing."""

    def __init__(self, limits: DeviceLimits, optional_pointers=OPTIONAL_POINTERS, vector_pointers=VECTOR_POINTERS):
        self.limits = limits
        self.optional_pointers = frozenset(optional_pointers)
        self.vector_pointers = frozenset(vector_pointers)
        self.launches: list[Launch] = []
        self._signatures: dict[str, list[tuple[re.Pattern, list[str]]]] = {}

    def sm_count(self, device) -> int:
        return self.limits.sm_count

    def device_limits(self, device) -> DeviceLimits:
        return self.limits

    def launch(self, spec: reg.KernelSpec, device, grid, block, args, shared_mem: int) -> None:
        device = torch.device(device)
        params = self.signature(spec)
        launch = Launch(spec.name, device, tuple(grid), tuple(block), shared_mem, tuple(args), params,
                        tuple(p.name for p, a in zip(params, args) if p.pointer and isinstance(a, np.uint64) and a == 0
                              and p.name in self.optional_pointers))
        self.launches.append(launch)
        check_launch(spec.name, grid, block, shared_mem, self.limits)
        self._check_args(launch)

    # -- argument checks ----------------------------------------------------------------------
    def _check_args(self, launch: Launch) -> None:
        name, params, args = launch.name, launch.params, launch.args
        if len(args) != len(params):
            raise AssertionError(f"{name}: {len(args)} arguments for {len(params)} parameters "
                                 f"({', '.join(p.name for p in params)})")
        for p, a in zip(params, args):
            want = np.uint64 if p.pointer else _C_TYPES.get(p.ctype)
            if want is not None and type(a) is not want:
                raise AssertionError(f"{name}: parameter {p.name} ({p.ctype}{'*' if p.pointer else ''}) got "
                                     f"{type(a).__name__} {a!r}; expected numpy.{want.__name__}")
            if not p.pointer or launch.device.type == "meta":
                continue
            address = int(a)
            if address == 0:
                if p.name not in self.optional_pointers:
                    raise AssertionError(f"{name}: pointer {p.name} is null (not an optional parameter)")
                continue
            align = max(_ELEMENT_BYTES.get(p.ctype, 1), 16 if p.name in self.vector_pointers else 1)
            if address % align:
                raise AssertionError(f"{name}: pointer {p.name} = {address:#x} is not {align}-byte aligned "
                                     f"(address % {align} = {address % align})")

    # -- signatures from the source -----------------------------------------------------------
    def signature(self, spec: reg.KernelSpec) -> tuple[Param, ...]:
        """The parameters of ``spec``'s entry point, from its ``extern "C"`` definition in cuda/."""
        if spec.source not in self._signatures:
            self._signatures[spec.source] = list(_entries(reg.kernel_source(spec.source)))
        for pattern, raw in self._signatures[spec.source]:
            match = pattern.fullmatch(spec.name)
            if match:
                return tuple(_param(text, match.groupdict()) for text in raw)
        raise AssertionError(f"{spec.name}: no extern \"C\" __global__ entry in cuda/{spec.source} matches this "
                             f"name; RecordingLauncher reads parameter names and types from the entry points")


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    return re.sub(r"//[^\n]*", "", text)


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis group opening at ``text[start] == '('``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    raise ValueError("unbalanced parentheses in a kernel signature")


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p.strip() for p in parts + [cur] if p.strip()]


def _entries(source: str) -> list[tuple[re.Pattern, list[str]]]:
    """(name regex, raw parameter texts) of every extern "C" kernel, most literal names first; a
    macro-built name like ``hfp_decode_##TN##_d##D`` becomes a regex whose groups (TN, D) are
    substituted into the types, and a name that is a macro argument (``NAME``) matches any name."""
    text = _strip_comments(source).replace("\\\n", " ")
    found = []
    for m in _ENTRY.finditer(text):
        i = m.end()
        if text.startswith("__launch_bounds__", i):
            i = _balanced(text, text.index("(", i))
        name_match = re.compile(r"\s*([\w#]+)\s*").match(text, i)
        open_paren = name_match.end()
        close = _balanced(text, open_paren)
        pieces = name_match.group(1).split("##")
        wildcard = "[A-Za-z0-9]+" if len(pieces) > 1 else r"\w+"
        regex = "".join(f"(?P<{p}>{wildcard})" if re.fullmatch(r"[A-Z][A-Z0-9_]*", p) else re.escape(p)
                        for p in pieces)
        found.append((re.compile(regex), _split_top(text[open_paren + 1:close - 1]),
                      sum(len(p) for p in pieces if not p.isupper())))
    return [(pattern, raw) for pattern, raw, _ in sorted(found, key=lambda e: -e[2])]


def _param(text: str, macro_args: dict) -> Param:
    name = re.findall(r"\w+", text)[-1]
    ctype = text[:text.rindex(name)]
    pointer = "*" in ctype
    ctype = re.sub(r"\b(const|__restrict__)\b|\*", " ", ctype)
    for key, value in macro_args.items():
        ctype = re.sub(rf"\b{key}\b", value, ctype)
    return Param(name, " ".join(ctype.split()).replace("( ", "(").replace(" )", ")"), pointer)


def untouched_tensor(shape, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of ``shape`` over an anonymous private ``MAP_NORESERVE`` mapping: zeros on read,
    no memory until written (page by page), freed with the tensor. Linux only (``OSError`` elsewhere or
    when the kernel refuses the mapping)."""
    if not sys.platform.startswith("linux"):
        raise OSError("untouched_tensor needs Linux (MAP_NORESERVE)")
    numel = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    nbytes = max(numel * torch.empty((), dtype=dtype).element_size(), 1)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)   # the tensor keeps the mapping
