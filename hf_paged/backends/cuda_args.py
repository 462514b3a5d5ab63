"""Host-side arguments of the CUDA kernels: pointers, and the checks that pools are laid out as the
kernels read them (``hf_paged/kv_formats.py`` for quantised pools, ``torch_backend`` for the rest)."""
from __future__ import annotations

import numpy as np
import torch

from ..kv_formats import QuantizedPool
from . import kernel_registry as reg


def ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def check_pools(k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    if k_pool.shape != v_pool.shape or k_pool.dtype != v_pool.dtype:
        raise ValueError(f"k_pool {tuple(k_pool.shape)} {k_pool.dtype} and v_pool {tuple(v_pool.shape)} "
                         f"{v_pool.dtype} differ")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("pools must be contiguous [Hkv, num_blocks, block_size, D] tensors")


def check_quantized_pools(k_pool: QuantizedPool, v_pool) -> str:
    """Both pools quantised alike, laid out as kv_formats.py says; returns the format's kernel tag."""
    if not isinstance(v_pool, QuantizedPool) or v_pool.fmt != k_pool.fmt or v_pool.shape != k_pool.shape:
        raise ValueError(f"k_pool ({k_pool.fmt.name} {k_pool.shape}) and v_pool "
                         f"({getattr(getattr(v_pool, 'fmt', None), 'name', type(v_pool).__name__)} "
                         f"{tuple(v_pool.shape)}) differ: both must be QuantizedPools of one format and shape")
    tag = reg.kv_format_tag(k_pool.fmt)
    heads, blocks, block_size, head_dim = k_pool.shape
    k_pool.fmt.check_head_dim(head_dim)
    want = {"data": ((heads, blocks, block_size, k_pool.fmt.code_bytes(head_dim)), torch.uint8),
            "scales": ((heads, blocks, block_size, k_pool.fmt.num_scales(head_dim)), torch.bfloat16)}
    for pool in (k_pool, v_pool):
        for name, (shape, dtype) in want.items():
            t = getattr(pool, name)
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"QuantizedPool.{name} must be a contiguous {dtype} tensor {list(shape)} "
                                 f"(hf_paged/kv_formats.py), got {t.dtype} {list(t.shape)}"
                                 f"{'' if t.is_contiguous() else ' (not contiguous)'}")
        if pool.data.data_ptr() % 16:      # the attention kernels read codes in 16-byte words
            raise ValueError("QuantizedPool.data storage must be 16-byte aligned")
    return tag


def pool_tensors(k_pool, v_pool) -> dict:
    """The pools' tensors and the alignment the kernels read them with (16-byte words; bf16 scales)."""
    if isinstance(k_pool, QuantizedPool):
        return {"k_codes": (k_pool.data, 16), "k_scales": (k_pool.scales, 2), "v_codes": (v_pool.data, 16),
                "v_scales": (v_pool.scales, 2)}
    return {"k_pool": (k_pool, 16), "v_pool": (v_pool, 16)}


def copy_word(tile_bytes: int, pools: list[torch.Tensor]) -> int:
    """Bytes per word copy_blocks moves: the largest of 16, 4, 1 dividing a (head, block) tile and
    every pool's address (16 for model-dtype pools and, at block sizes 8/16/32, for codes and scales)."""
    return next(w for w in (16, 4, 1) if tile_bytes % w == 0 and all(p.data_ptr() % w == 0 for p in pools))
