"""Choosing the attention backend: CUDA kernels for CUDA tensors, the PyTorch path otherwise.

A backend is any object (usually a module) with the four functions of ``torch_attention``:
``write_kv``, ``copy_blocks``, ``decode_attention`` and ``extend_attention``, same signatures and
same pool layout. ``HF_PAGED_FORCE_TORCH=1`` keeps CUDA tensors on the PyTorch path, for comparison.
"""
from __future__ import annotations

import os

import torch

from . import torch_attention

FORCE_TORCH_ENV = "HF_PAGED_FORCE_TORCH"


def select_backend(device: torch.device):
    """The backend for tensors on ``device``. cupy is imported only when a CUDA kernel first runs."""
    if device.type == "cuda" and os.environ.get(FORCE_TORCH_ENV, "") not in ("1", "true", "yes"):
        from . import cuda_backend  # noqa: PLC0415  (optional dependency, imported on demand)
        return cuda_backend.make_backend()
    return torch_attention
