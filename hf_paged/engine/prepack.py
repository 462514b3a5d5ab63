"""Weights prepacked once for the engine's CPU steps: its linear layers without per-call re-layout.

On the CPU most of a forward is the linear layers, and at decode steps a forward streams every weight from
memory once. float32 weights go to ``cuda/linear_cpu.cpp`` (``torch.ops.hf_paged_fused.linear``: panels of 32
output columns streamed with prefetch, registers for up to 14 rows; see its header for why not oneDNN and
for its summation order, which makes a row's result independent of the batch it came in) for steps of up to
``LIBRARY_ROWS`` rows (every step on AMD CPUs, where MKL is the slower: ``library_rows``), and larger steps
(prefill chunks) to MKL's sgemm: through a second copy of the weights in
MKL's packed layout for steps of exactly the engine's token budget (``prefill_rows``; every full prefill step),
else ``F.linear`` on the modules' weights (the same sgemm, packing the weight per call); bfloat16 weights
to the kernel's bf16 form where it is built (AVX-512 BF16) and the CPU has no AMX (``kernel_takes``), else to
oneDNN's ``_linear_pointwise`` where oneDNN has bf16 kernels (AVX-512 BF16 / AMX), and float32 ones too
when the extension cannot be built. Torch's default ``F.linear`` re-lays the weight out for every call.
Measured on SmolLM2-135M's 30 layers and LM head (2 threads, Xeon with AVX-512 and AMX, 2026-12-05,
``python -m bench linear``): 1.15-1.29x oneDNN's prepacked fp32 matmul at 1-64 rows, 1.07x at 128,
0.96x at 512. MKL's packed copy at 512 rows: 1.07-1.10x ``F.linear`` on the grouped weights, 1.35x at 192
(``_PrefillPack``); end to end 1.07x on prompts up to 1,024 tokens, 1.02x on the short workload.

Siblings: with ``group_siblings`` (the engine sets it when its fused forwards run, which ask for it through
``sibling_outputs``), a module's q/k/v projections and an MLP's gate/up projections are packed as one
weight (their rows concatenated; the outputs are the same numbers, one call instead of three or two).

``PrepackedLinears(model)`` packs every plain ``nn.Linear`` on the CPU (float32, and bfloat16 where oneDNN
has bf16 kernels) once; the packed copies belong to it (extra memory = those weights, logged).
``with packed.installed():`` gives those modules an instance ``forward`` using them and removes it on exit,
so the model is untouched outside the block. A module whose weight or bias was replaced or changed in
place since packing (``_version``), or that is called with another dtype, device or with grad, runs plain
``F.linear``, and so does a call outside the owner's forwards (``running``: another thread's plain forward while
the block is open). The engine enters it around its steps unless ``enforce_eager=True``. When the copies would take
more than half of the memory available, nothing is packed (with a warning).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import torch
import torch.nn.functional as F

from ..hugepages import MIN_BYTES, collapse_onto_huge_pages, huge_page_buffer
from .config import available_bytes
from .cpu_bf16 import cpu_flags, cpu_vendor
from .cpu_ops import load_fused_ops

log = logging.getLogger("hf_paged.engine")


class SharedForwards:
    """Instance-level ``forward``s set on modules while at least one block is inside ``installed``.

    Invariant: the forwards are set by the first block to enter and removed by the last to leave (nested
    and concurrent blocks share one installation); a module whose ``forward`` was replaced meanwhile by
    someone else keeps that replacement. Each forward object names its module as ``.module``."""

    def __init__(self):
        self._lock = threading.Lock()
        self._users = 0
        self._installed: list = []
        self._running = threading.local()     # .depth: this thread's forwards of the owner in progress

    @contextlib.contextmanager
    def installed(self, pick):
        """``pick()`` -> the forwards to set, asked once per installation."""
        with self._lock:
            if self._users == 0:
                self._installed = list(pick())
                for forward in self._installed:
                    forward.shared = self
                    forward.module.forward = forward
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    for forward in self._installed:
                        if forward.module.__dict__.get("forward") is forward:
                            del forward.module.forward
                    self._installed = []

    @contextlib.contextmanager
    def running(self):
        """The block is one of the owner's own forwards (an engine step) in this thread: only there do the
        installed forwards apply. Installed for a whole session, they also see the forwards that others run
        meanwhile (another thread's plain forward, the caller's own between a stream's steps), which get the
        modules' own forwards: the default path's result, with its attention mask."""
        depth = getattr(self._running, "depth", 0)
        self._running.depth = depth + 1
        try:
            yield
        finally:
            self._running.depth = depth

    def running_here(self) -> bool:
        return getattr(self._running, "depth", 0) > 0


class InstalledForward:
    """Base of the instance forwards a SharedForwards sets; ``shared``: the one that set it (None: called
    directly, e.g. by a test)."""
    shared: SharedForwards | None = None

    def here(self) -> bool:
        """Whether this call is inside one of the owner's forwards (``SharedForwards.running``)."""
        shared = self.shared
        return shared is None or shared.running_here()


def prepack_available(dtype: torch.dtype) -> bool:
    """Whether this torch build has oneDNN's prepacked linear for ``dtype`` on this CPU."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def _version(t: torch.Tensor) -> int:
    """The tensor's in-place version counter; -1 for inference tensors (they keep none)."""
    return -1 if t.is_inference() else t._version


def _packable(module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module) is torch.nn.Linear and type(weight) in (torch.Tensor, torch.nn.Parameter)
            and weight.device.type == "cpu" and prepack_available(weight.dtype)
            and not hasattr(module, "_hf_hook")          # accelerate-offloaded modules move their weights
            # A forward set on the instance (compressed-tensors' quantising forward) is someone else's: packing
            # would bypass it while installed and delete it on exit.
            and "forward" not in module.__dict__)


# On Intel CPUs, steps of more rows than this (prefill chunks) run hf_paged's float32 kernel's modules through
# F.linear: the library's blocked GEMM (which copies blocks of x into its own layout) keeps its speed among an
# engine step's other ops, where the kernel, reading x in place, measured 14% slower on 512-row steps (SmolLM2,
# 2 threads, AVX-512 Xeon, 2026-12-05; 4% in isolation). At up to 128 rows the kernel is 1.1-1.4x the library.
LIBRARY_ROWS = 128
# "1": the library (float32: MKL over LIBRARY_ROWS rows; bf16: oneDNN), "0": hf_paged's kernel for every step
LIBRARY_ENV = "HF_PAGED_LIBRARY_GEMM"


def library_forced() -> bool | None:
    """``$HF_PAGED_LIBRARY_GEMM``: True ("1", the library), False ("0", hf_paged's kernel), None (unset: chosen by
    CPU); any other value raises, naming the two."""
    forced = os.environ.get(LIBRARY_ENV)
    if forced is not None and forced not in ("0", "1"):
        raise ValueError(f"{LIBRARY_ENV}={forced!r}: use 1 (the library's GEMM: MKL for float32 steps over "
                         f"{LIBRARY_ROWS} rows, oneDNN for bf16) or 0 (hf_paged's kernel for every step), or unset it "
                         "(chosen by CPU vendor)")
    return None if forced is None else forced == "1"


def library_rows(vendor: str | None = None, flags: set[str] | None = None) -> int | None:
    """Rows over which float32 steps go to the library's GEMM (torch's MKL sgemm), or None: hf_paged's kernel
    takes steps of every size. MKL picks its optimised code by CPU vendor: on AMD it ran well below the kernel
    (AMD EPYC Zen 4, AVX-512, SmolLM2's 30 layers, 2 threads, 2026-12-06, ``python -m bench linear``: MKL's
    packed copy 1.35x and F.linear 1.28x the kernel's time at 512 rows, 1.9x at 128; the engine with the kernel
    for every step 1.15x on the short workload and 1.21x with prompts up to 1,024 tokens), and on the same CPU
    with everything built for / limited to AVX2 (the stand-in for Zen 2 / Zen 3; ``HF_PAGED_CPU_ARCH=x86-64-v3``,
    ``MKL_ENABLE_INSTRUCTIONS=AVX2``, ``ONEDNN_MAX_CPU_ISA=AVX2``): F.linear 1.24x / 1.19x / 1.09x the kernel's
    time at 128 / 256 / 512 rows, MKL's packed copy 1.34x / 1.26x / 1.17x; on a real Zen 3 (AVX2 only, 2026-12-07,
    after the AVX2 tile's fix) oneDNN 1.06-1.08x the kernel's time at 128-512 rows. So on AMD CPUs with AVX-512 or
    AVX2 + FMA the kernel takes every step (and a row's result never depends on the step it came in). Elsewhere (Intel,
    or a vendor not reported) the library over ``LIBRARY_ROWS``. ``$HF_PAGED_LIBRARY_GEMM`` = 1 /
    0 forces either way; ``vendor`` and ``flags``: /proc/cpuinfo's (read when None)."""
    forced = library_forced()
    if forced is not None:
        return LIBRARY_ROWS if forced else None
    vendor = cpu_vendor() if vendor is None else vendor
    flags = (cpu_flags() if flags is None else flags) or set()
    kernel_isa = "avx512f" in flags or {"avx2", "fma"} <= flags
    return None if vendor == "AuthenticAMD" and kernel_isa else LIBRARY_ROWS


def mkl_packing_available() -> bool:
    """Whether this torch build has MKL's packed float32 GEMM (``torch.ops.mkl._mkl_linear``)."""
    return (torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkl, "_mkl_linear") and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))


class _PrefillPack:
    """MKL's packed copy of a float32 weight for steps of exactly ``rows`` rows (the engine's token budget,
    which every full prefill step spends): ``F.linear`` packs the weight into MKL's layout on every call, and
    on SmolLM2's shapes at 512 rows that packing is 8-10% of a layer's linear time (``python -m bench linear``).
    The product is MKL's sgemm either way, so the same bits as ``F.linear`` on the module(s).

    Invariant: ``product`` is called with exactly ``rows`` rows. ``_mkl_linear`` reads its third argument only
    for the output's size when the rows match the packing (and computes an unpacked ``F.linear`` with it
    otherwise), so a zero-stride stand-in of the weight's shape replaces the concatenated weight of a group,
    which would otherwise be kept as a second copy."""

    def __init__(self, weight: torch.Tensor, rows: int):
        self.rows = rows
        self.weight = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        self.shape_of = weight.new_zeros(()).expand(weight.shape)

    def product(self, flat: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if flat.shape[0] != self.rows:           # never: the callers check (see the invariant)
            raise ValueError(f"MKL's packed weight is for {self.rows} rows, got {flat.shape[0]}")
        return torch.ops.mkl._mkl_linear(flat, self.weight, self.shape_of, bias, self.rows)


class _Packed:
    """One packed weight: a module's, or sibling modules' (same input) with their rows concatenated.
    ``sizes``: each module's output features, in order; ``ops``: hf_paged's kernel where it takes this weight's
    dtype (``kernel_takes``, decided by the caller), or None for oneDNN;
    ``prefill``: a ``_PrefillPack`` of the same weight for library-sized steps of the engine's token budget;
    ``library_rows``: steps of more rows go to the library (``library_rows()``; None: never)."""

    def __init__(self, modules: tuple[torch.nn.Linear, ...], ops, prefill_rows: int | None = None,
                 library_rows: int | None = LIBRARY_ROWS):
        self.modules = modules
        self.params = [(m.weight, _version(m.weight), m.bias, None if m.bias is None else _version(m.bias))
                       for m in modules]
        weight = torch.cat([m.weight.detach() for m in modules]) if len(modules) > 1 else modules[0].weight.detach()
        has_bias = modules[0].bias is not None
        self.bias = torch.cat([m.bias.detach() for m in modules]).contiguous() if has_bias else None
        self.sizes = [m.out_features for m in modules]
        self.n, self.dtype = sum(self.sizes), weight.dtype
        self.ops = ops
        # the library's GEMM is MKL's float32 sgemm: bf16 never goes there
        self.library_rows = library_rows if weight.dtype == torch.float32 else None
        self.packed = (self.ops.pack_linear(weight) if self.ops is not None
                       else torch.ops.mkldnn._reorder_linear_weight(weight, None))
        self.prefill = _PrefillPack(weight, prefill_rows) if self.ops is not None and prefill_rows else None

    def current(self) -> bool:
        """Packed numbers are the modules' current parameters (none replaced or changed in place)."""
        for m, (weight, version, bias, bias_version) in zip(self.modules, self.params):
            if (m.weight is not weight or _version(weight) != version or m.bias is not bias
                    or (bias is not None and _version(bias) != bias_version)):
                return False
        return True

    def applies(self, x: torch.Tensor) -> bool:
        """Packed numbers are the modules' current parameters and x is what the packed op takes."""
        if x.dtype != self.dtype or x.device.type != "cpu" or not self.current():
            return False
        return not (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w, *_ in self.params)))

    def library_sized(self, x: torch.Tensor) -> bool:
        """Whether x has more rows than the kernel takes (``library_rows``): F.linear on each module then."""
        return self.ops is not None and self.library_rows is not None and x.numel() > self.library_rows * x.shape[-1]

    def _prefill_sized(self, x: torch.Tensor) -> bool:
        return self.prefill is not None and x.numel() == self.prefill.rows * x.shape[-1]

    def outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each module's output on x [..., K]: views of one packed product, or ``F.linear`` per module when
        ``library_sized(x)`` (unless MKL's copy is for x's rows)."""
        flat = x.reshape(-1, x.shape[-1])
        if self._prefill_sized(x):
            out = self.prefill.product(flat, self.bias)
        elif self.library_sized(x):
            return tuple(F.linear(x, m.weight, m.bias) for m in self.modules)
        else:
            out = self.product(flat)
        out = out.view(*x.shape[:-1], self.n)
        return (out,) if len(self.sizes) == 1 else out.split(self.sizes, -1)

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        """The packed product of rows ``flat`` [rows, K] -> [rows, n] (the caller has checked ``applies`` and
        that they are not ``library_sized``)."""
        if self.ops is not None:
            return self.ops.linear(flat if flat.stride(-1) == 1 else flat.contiguous(), self.packed, self.bias, self.n)
        return torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")

    def output(self, x: torch.Tensor, index: int = 0) -> torch.Tensor:
        """Module ``index``'s output on x, contiguous: ``F.linear`` on its own weight when ``library_sized(x)``,
        else its columns of the packed product. (The caller has checked ``applies``.)"""
        if self.library_sized(x) and not (len(self.modules) == 1 and self._prefill_sized(x)):
            m = self.modules[index]          # (a group's member alone: not the whole group's product)
            return F.linear(x, m.weight, m.bias)
        out = self.outputs(x)[index]
        return out if out.is_contiguous() else out.contiguous()


class _PackedLinear(InstalledForward):
    """The forward of one nn.Linear over its packed weight (F.linear when that cannot apply). A member of a
    sibling group computes the group's product and keeps its own columns: correct, but the fused forwards
    call the group once for all members instead (``sibling_outputs``)."""

    def __init__(self, module: torch.nn.Linear, packed: _Packed, index: int = 0):
        self.module, self.packed, self.index = module, packed, index

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.here() and self.packed.applies(x)):
            return F.linear(x, self.module.weight, self.module.bias)
        return self.packed.output(x, self.index)


def sibling_outputs(modules: tuple, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """Each of ``modules``' outputs on x (views of one product) when they are one packed group, installed
    and applicable to x; else None (call the modules). The caller answers for the modules' hooks."""
    forward = modules[0].__dict__.get("forward")
    packed = getattr(forward, "packed", None)
    if packed is None or packed.modules != modules or not forward.here() or not packed.applies(x):
        return None
    return packed.outputs(x)


def packed_group(modules: tuple) -> _Packed | None:
    """The installed packed weight of exactly ``modules`` (one module, or a sibling group) with their current
    parameters, or None."""
    packed = getattr(modules[0].__dict__.get("forward"), "packed", None)
    return packed if packed is not None and packed.modules == tuple(modules) and packed.current() else None


SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))     # attention, MLP


def _sibling_groups(model: torch.nn.Module) -> list[tuple[torch.nn.Linear, ...]]:
    """Groups of packable linears that read the same input and can be one weight (same input size and
    dtype, biases all present or all absent)."""
    groups = []
    for module in model.modules():
        for names in SIBLINGS:
            members = tuple(getattr(module, n, None) for n in names)
            if all(m is not None and _packable(m) for m in members) and \
                    len({(m.in_features, m.weight.dtype, m.bias is None) for m in members}) == 1:
                groups.append(members)
    return groups


def unpack_pending_weights(model: torch.nn.Module) -> None:
    """Unpack a compressed-tensors checkpoint now if it has not run yet. Its linears hold packed codes
    until a forward pre-hook of the model unpacks them on the first forward, and that unpacking re-wraps each
    module's ``forward``, which fails on a packed forward installed in its place; done first, packing sees
    the float weights (and skips the modules whose forward compressed-tensors set, see ``_packable``)."""
    quantizer = getattr(model, "hf_quantizer", None)
    if getattr(model, "ct_decompress_hook", None) is not None and hasattr(quantizer, "compressor"):
        quantizer.compressor.decompress_model(model)


class PrepackedLinears:
    """Packed copies of a model's CPU linear weights (see the module doc)."""

    def __init__(self, model: torch.nn.Module, group_siblings: bool = False, prefill_rows: int | None = None):
        start = time.perf_counter()
        unpack_pending_weights(model)
        groups = _sibling_groups(model) if group_siblings else []
        grouped = {id(m) for g in groups for m in g}
        units = groups + [(m,) for m in model.modules() if _packable(m) and id(m) not in grouped]
        need = sum(m.weight.numel() * m.weight.element_size() for unit in units for m in unit)
        available = available_bytes()
        if need > available // 2:       # the copies must not crowd out the KV pool or push the machine to swap
            log.warning("not prepacking the linear weights: the copies need %.0f MiB and %.0f MiB is available "
                        "(at most half of it is used); the engine runs plain F.linear (enforce_eager=True skips this "
                        "check)", need / 2**20, available / 2**20)
            units = []
        ops = _linear_ops() if any(m.weight.dtype in KERNEL_DTYPES for unit in units for m in unit) else None
        dtypes = {m.weight.dtype for unit in units for m in unit}
        # once per dtype the model has (each check reads the environment and cpuinfo, and warns where it says no)
        takes = {dtype for dtype in KERNEL_DTYPES if dtype in dtypes and kernel_takes(ops, dtype)}
        self.library_rows = library_rows() if ops is not None else None
        prefill = self._prefill_units(model, units, ops, prefill_rows, self.library_rows, available - need)
        packed = [_Packed(unit, ops if unit[0].weight.dtype in takes else None,
                          prefill_rows if id(unit) in prefill else None, self.library_rows) for unit in units]
        _onto_huge_pages([p for p in packed if p.ops is not None])
        _collapse_onednn([p for p in packed if p.ops is None])
        self.layers: list[_PackedLinear] = [_PackedLinear(m, p, i) for p in packed for i, m in enumerate(p.modules)]
        self._forwards = SharedForwards()
        self.seconds = time.perf_counter() - start
        self.bytes = sum(p.packed.numel() * p.packed.element_size() for p in packed)
        # MKL's buffers are opaque: counted as the weights they copy (measured within 2% on SmolLM2)
        self.prefill_bytes = sum(4 * m.weight.numel() for p in packed if p.prefill is not None for m in p.modules)
        # what the kernel runs: the dtypes of the units packed for it (none: all through oneDNN)
        kernel_dtypes = sorted({str(p.modules[0].weight.dtype).removeprefix("torch.") for p in packed
                                if p.ops is not None})
        route = "oneDNN" if not kernel_dtypes else (
            f"{' and '.join(kernel_dtypes)} through hf_paged's kernel"
            + (", the others through oneDNN" if any(p.ops is None for p in packed) else "") + ", "
            + ("every step" if self.library_rows is None else f"steps over {self.library_rows} rows through MKL's sgemm")
            + f" (${LIBRARY_ENV})")
        log.info("prepacked %d linear layers (%d sibling groups; %s) in %.2f s (%.0f MiB beside the model's "
                 "weights%s; enforce_eager=True skips this)", len(self.layers), len(groups), route, self.seconds,
                 (self.bytes + self.prefill_bytes) / 2**20,
                 f", {self.prefill_bytes / 2**20:.0f} MiB of them MKL's copies for {prefill_rows}-token steps"
                 if prefill else "")

    @staticmethod
    def _prefill_units(model, units: list, ops, rows: int | None, library: int | None, spare: int) -> set[int]:
        """ids of the float32 units that get MKL's packed copy for steps of ``rows`` rows (``_PrefillPack``):
        all but the LM head (it sees the sampled rows only), when the steps are library-sized, this torch has
        MKL and the copies fit in half of the memory left (counted at 4/3 of their weights: MKL's buffer size is
        its own business; SmolLM2's measured 1.02x)."""
        if ops is None or rows is None or library is None or rows <= library or not mkl_packing_available():
            return set()
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        chosen = [u for u in units if u[0].weight.dtype == torch.float32 and head not in u]
        need = sum(4 * m.weight.numel() for u in chosen for m in u) * 4 // 3
        if need > spare // 2:
            log.warning("no MKL copies of the linear weights for %d-token steps: they need %.0f MiB and %.0f MiB is "
                        "left after the other packed copies (at most half of it is used); prefill steps run F.linear",
                        rows, need / 2**20, spare / 2**20)
            return set()
        return {id(u) for u in chosen}

    def installed(self):
        """The packed forwards for the block (nested and concurrent blocks share one installation)."""
        return self._forwards.installed(lambda: self.layers)

    def running(self):
        """The block is an engine step's forward in this thread (``SharedForwards.running``)."""
        return self._forwards.running()


def _onto_huge_pages(packed: list[_Packed]) -> None:
    """The kernel's packed weights moved into one buffer on huge pages (``hf_paged.hugepages``; a decode step
    streams them all), each at a 64-byte boundary, one weight copied at a time (the peak is one weight more)."""
    sizes = [-(-p.packed.nbytes // 64) * 64 for p in packed]          # bytes: 64-byte steps
    if not packed or sum(sizes) < MIN_BYTES:
        return
    buffer, offset = huge_page_buffer(sum(sizes), torch.uint8), 0
    for p, size in zip(packed, sizes):
        dst = buffer[offset:offset + p.packed.nbytes].view(p.packed.dtype).view(p.packed.shape)
        p.packed = dst.copy_(p.packed)
        offset += size


def _collapse_onednn(packed: list[_Packed]) -> None:
    """oneDNN's packed weights (bf16) onto huge pages where they lie (``collapse_onto_huge_pages``): oneDNN
    allocates them itself. SmolLM2's bf16 linears, 2 threads: 0.88-0.90x the time at 1-32 rows."""
    if not packed or not hasattr(torch.ops.mkldnn, "data_ptr") or not hasattr(torch.ops.mkldnn, "_nbytes"):
        return
    try:
        ranges = [(torch.ops.mkldnn.data_ptr(p.packed), torch.ops.mkldnn._nbytes(p.packed)) for p in packed]
    except RuntimeError as err:        # a torch whose ops take other tensors: only the speed differs
        log.debug("oneDNN's packed weights stay on their pages: %s", err)
        return
    if sum(n for _, n in ranges) >= MIN_BYTES:
        log.debug("%d MiB of oneDNN's packed weights collapsed onto huge pages",
                  collapse_onto_huge_pages(ranges) >> 20)


KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def kernel_takes(ops, dtype: torch.dtype, flags: set[str] | None = None) -> bool:
    """Whether hf_paged's linear kernel (``ops``, or None) packs weights of ``dtype``: float32 where its build has
    hardware FMA (every x86 CPU with AVX2 or AVX-512, aarch64; not a plain x86-64 build); bfloat16
    where the extension was built for a CPU with AVX-512 BF16 and the CPU has no AMX (else oneDNN's bf16
    matmul). On an AMD EPYC Zen 4 (AVX-512 BF16, no AMX; SmolLM2's 30 layers + LM head, 2 threads, 2026-12-06,
    ``python -m bench linear --dtype bfloat16``) the kernel took 0.60-0.66x the time of oneDNN's (siblings grouped)
    at 1-14 rows, 0.78-0.84x at 24-64, 0.95-0.99x at 128-512; on a Xeon with AMX an
    earlier bf16 kernel of the same kind ran at 0.47x oneDNN's speed at 32 rows (AMX's tiles). $HF_PAGED_LIBRARY_GEMM
    = 1 / 0 forces oneDNN / the kernel (where built); ``flags``: /proc/cpuinfo's (read when None)."""
    if ops is None or dtype not in KERNEL_DTYPES:
        return False
    if dtype == torch.float32:
        if not ops.linear_hardware_fma():
            from ..backends.cpp_build import ARCH_ENV, march  # noqa: PLC0415  (only for this message)
            log.warning("hf_paged's linear kernel was built without hardware FMA (-march=%s, %s), where its sums "
                        "would be emulated: float32 linears go through oneDNN", march(), ARCH_ENV)
            return False
        return True
    if not ops.linear_bf16_available():
        return False
    forced = library_forced()
    if forced is not None:
        return not forced
    flags = cpu_flags() if flags is None else flags
    return not (flags and "amx_bf16" in flags)


def _linear_ops():
    """The linear kernel (``cpu_ops``), or None (oneDNN then packs float32 and bf16) when it cannot be built."""
    try:
        return load_fused_ops()
    except RuntimeError as err:
        log.warning("hf_paged's CPU linear kernel unavailable, float32 linears go through oneDNN: %s", err)
        return None
