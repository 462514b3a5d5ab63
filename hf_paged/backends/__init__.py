"""Attention backends, one per device and process: the PyTorch path (``torch_backend.TorchBackend``, the
reference, and the CPU fallback), the CPU kernel (``cpu_backend``, ``paged_attention_cpu.cpp`` reading
K/V in place) and the CUDA kernels (``cuda_backend``, launching the ``.cu`` sources of ``hf_paged/cuda``
listed in ``kernel_registry``). Every backend follows the protocol of ``step`` (write_kv, copy_blocks,
prepare -> a Step whose ``attend`` each layer calls).

``HF_PAGED_FORCE_TORCH=1`` keeps CUDA tensors on the PyTorch path; ``HF_PAGED_CPU_KERNEL=0`` keeps CPU
tensors on it.
"""
from __future__ import annotations

import functools
import logging
import threading

import torch

from .cpp_build import KERNEL_ENV, env_switch, kernel_enabled
from .step import Step, Workspace
from .torch_backend import TorchBackend

FORCE_TORCH_ENV = "HF_PAGED_FORCE_TORCH"
log = logging.getLogger("hf_paged.backends")


def backend_kind(device: torch.device) -> str:
    """Which backend serves tensors on ``device`` under the current environment: "cuda", "cpu_kernel" or
    "torch"."""
    if device.type == "cuda" and not env_switch(FORCE_TORCH_ENV, False):
        return "cuda"
    if device.type == "cpu" and kernel_enabled():
        return "cpu_kernel"
    return "torch"


def select_backend(device: torch.device):
    """The backend for tensors on ``device``: the one this process keeps for that device and kind, built
    on the first call (cupy is imported only then; the CPU kernel is built then, or the PyTorch path
    serves with a warning when it cannot be)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _process_backends().get(device, backend_kind(device))


class BackendRegistry:
    """Backends by (device, kind), built once. Kernel modules, compiled CPU ops and the fast kernels'
    first-use checks live on the backend objects, so keeping one per device is what makes a second
    cache, ``generate`` call or engine on that device load nothing and check nothing again."""

    def __init__(self, build=None):
        self._build = build or build_backend      # kind -> a new backend
        self._lock = threading.Lock()
        self._backends: dict[tuple[torch.device, str], object] = {}

    def get(self, device: torch.device, kind: str):
        with self._lock:
            key = (device, kind)
            if key not in self._backends:
                self._backends[key] = self._build(kind)
            return self._backends[key]


@functools.cache
def _process_backends() -> BackendRegistry:
    """The process's registry (created on first use, not at import): the one deliberate process-wide
    cache of hf_paged, since compiled kernel modules are per process."""
    return BackendRegistry()


def build_backend(kind: str):
    """A new backend of ``kind`` ("cuda", "cpu_kernel", "torch"); a CPU kernel that cannot be built
    gives the PyTorch path, with a warning."""
    if kind == "cuda":
        from . import cuda_backend  # noqa: PLC0415  (optional dependency, imported on demand)
        return cuda_backend.make_backend()
    if kind == "cpu_kernel":
        from . import cpu_backend  # noqa: PLC0415
        try:
            return cpu_backend.make_backend()
        except RuntimeError as err:
            log.warning("%s; using the PyTorch path (set %s=0 to skip the build)", err, KERNEL_ENV)
    return TorchBackend()


__all__ = ["FORCE_TORCH_ENV", "BackendRegistry", "Step", "TorchBackend", "Workspace", "backend_kind",
           "build_backend", "select_backend"]
