"""Weights prepacked for the CPU's matmul library: the engine's linear layers through oneDNN.

On the CPU most of a forward is the linear layers. Torch's default ``F.linear`` re-lays the weight out
for every call; oneDNN's ``_linear_pointwise`` takes a weight reordered once into its blocked layout.
Measured on SmolLM2-135M's layer shapes (2 threads, AMD EPYC with AVX2, 2026-12-01), one decoder layer's
seven linears: 1.7-2.4x faster at 8-32 tokens, 2.2x at 1 token, equal at 512. This is the part of
inductor's CPU "freezing" that pays here, without its start-up cost (88-115 s per token-count bucket on
this machine for SmolLM2). Fusing sibling linears (q/k/v, gate/up) into one packed matmul was tried and
measured no faster end to end, so it is not done.

``PrepackedLinears(model)`` packs every plain ``nn.Linear`` on the CPU (float32, and bfloat16 where oneDNN
has bf16 kernels) once; the packed copies belong to it (extra memory = those weights, logged).
``with packed.installed():`` gives those modules an instance ``forward`` using them and removes it on exit,
so the model is untouched outside the block. A module whose weight was replaced or changed in place since
packing (``weight._version``), or that is called with another dtype, device or with grad, runs plain
``F.linear``. The engine enters it around its steps unless ``enforce_eager=True``. When the copies would take
more than half of the memory available, nothing is packed (with a warning).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch
import torch.nn.functional as F

from .config import available_bytes

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

    @contextlib.contextmanager
    def installed(self, pick):
        """``pick()`` -> the forwards to set, asked once per installation."""
        with self._lock:
            if self._users == 0:
                self._installed = list(pick())
                for forward in self._installed:
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


class _PackedLinear:
    """The forward of one nn.Linear over its packed weight (falls back to F.linear when it cannot apply)."""

    def __init__(self, module: torch.nn.Linear):
        self.module = module
        self.weight, self.version = module.weight, _version(module.weight)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        if (m.weight is not self.weight or _version(m.weight) != self.version or x.dtype != self.weight.dtype
                or x.device.type != "cpu" or (torch.is_grad_enabled() and (x.requires_grad or m.weight.requires_grad))):
            return F.linear(x, m.weight, m.bias)
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, m.bias, "none", [], "")
        return out.view(*x.shape[:-1], m.out_features)


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

    def __init__(self, model: torch.nn.Module):
        start = time.perf_counter()
        unpack_pending_weights(model)
        modules = [m for m in model.modules() if _packable(m)]
        need = sum(m.weight.numel() * m.weight.element_size() for m in modules)
        available = available_bytes()
        if need > available // 2:       # the copies must not crowd out the KV pool or push the machine to swap
            log.warning("not prepacking the linear weights: the copies need %.0f MiB and %.0f MiB is available "
                        "(at most half of it is used); the engine runs plain F.linear (enforce_eager=True skips this "
                        "check)", need / 2**20, available / 2**20)
            modules = []
        self.layers: list[_PackedLinear] = [_PackedLinear(m) for m in modules]
        self._forwards = SharedForwards()
        self.seconds = time.perf_counter() - start
        self.bytes = sum(p.packed.numel() * p.packed.element_size() for p in self.layers)
        log.info("prepacked %d linear layers for oneDNN in %.2f s (%.0f MiB beside the model's weights; "
                 "enforce_eager=True skips this)", len(self.layers), self.seconds, self.bytes / 2**20)

    def installed(self):
        """The packed forwards for the block (nested and concurrent blocks share one installation)."""
        return self._forwards.installed(lambda: self.layers)
