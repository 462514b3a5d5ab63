"""Attention backends: the PyTorch path (``torch_backend``, the reference, and the CPU fallback), the
CPU kernel (``cpu_backend``, ``paged_attention_cpu.cpp`` reading K/V in place) and the CUDA kernels
(``cuda_backend``, launching the ``.cu`` sources of ``hf_paged/cuda`` listed in ``kernel_registry``).

A backend is any object with the four functions of ``torch_backend`` — ``write_kv``, ``copy_blocks``,
``decode_attention``, ``extend_attention`` — same signatures and pool layout; ``step.prepare_step``
binds it to one forward's plan. ``HF_PAGED_FORCE_TORCH=1`` keeps CUDA tensors on the PyTorch path;
``HF_PAGED_CPU_KERNEL=0`` keeps CPU tensors on it.
"""
from __future__ import annotations

import logging
import os

import torch

from . import torch_backend
from .step import PreparedStep, prepare_step

FORCE_TORCH_ENV = "HF_PAGED_FORCE_TORCH"
log = logging.getLogger("hf_paged.backends")


def select_backend(device: torch.device):
    """The backend for tensors on ``device``. cupy is imported only when a CUDA kernel first runs; the CPU
    kernel is built on the first call that wants it (the PyTorch path when it cannot be, with a warning)."""
    if device.type == "cuda" and os.environ.get(FORCE_TORCH_ENV, "") not in ("1", "true", "yes"):
        from . import cuda_backend  # noqa: PLC0415  (optional dependency, imported on demand)
        return cuda_backend.make_backend()
    if device.type == "cpu":
        from . import cpu_backend  # noqa: PLC0415  (its build imports torch.utils.cpp_extension)
        if cpu_backend.kernel_enabled():
            try:
                return cpu_backend.make_backend()
            except RuntimeError as err:
                log.warning("%s; using the PyTorch path (set %s=0 to skip the build)", err, cpu_backend.KERNEL_ENV)
    return torch_backend


__all__ = ["FORCE_TORCH_ENV", "PreparedStep", "prepare_step", "select_backend", "torch_backend"]
