"""Attention backends: the PyTorch path (``torch_backend``, CPU and the reference) and the CUDA kernels
(``cuda_backend``, launching the ``.cu`` sources of ``hf_paged/cuda`` listed in ``kernel_registry``).

A backend is any object with the four functions of ``torch_backend`` — ``write_kv``, ``copy_blocks``,
``decode_attention``, ``extend_attention`` — same signatures and pool layout; ``step.prepare_step``
binds it to one forward's plan. ``HF_PAGED_FORCE_TORCH=1`` keeps CUDA tensors on the PyTorch path.
"""
from __future__ import annotations

import os

import torch

from . import torch_backend
from .step import PreparedStep, prepare_step

FORCE_TORCH_ENV = "HF_PAGED_FORCE_TORCH"


def select_backend(device: torch.device):
    """The backend for tensors on ``device``. cupy is imported only when a CUDA kernel first runs."""
    if device.type == "cuda" and os.environ.get(FORCE_TORCH_ENV, "") not in ("1", "true", "yes"):
        from . import cuda_backend  # noqa: PLC0415  (optional dependency, imported on demand)
        return cuda_backend.make_backend()
    return torch_backend


__all__ = ["FORCE_TORCH_ENV", "PreparedStep", "prepare_step", "select_backend", "torch_backend"]
