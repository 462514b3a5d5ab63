"""The one table of CUDA kernels: names, what they support, how they are built and sized.

Every ``extern "C"`` entry point in ``cuda/*.cu`` is listed here (the NVRTC compile gate checks that
the compiled ``.entry`` symbols equal :func:`all_kernels`). Both launch paths, CuPy on a GPU and the
CPU shim in ``tests/backends``, take names, build options and shared-memory sizes from this module.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

import torch

HEAD_DIMS = (64, 80, 96, 128, 256)
BLOCK_SIZES = (8, 16, 32)   # a runtime power of two in the kernels; these are the tested ones
DTYPE_TAGS = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
MAX_GROUP = 32            # query heads per KV head (decode puts a whole group in one CTA)
MAX_ROWS = 32             # query rows (heads x tokens) per extend CTA
THREADS = 128             # threads per block of every kernel (hfp::kThreads)
ATTENTION_SOURCE = "attention.cu"
CACHE_SOURCE = "cache_ops.cu"


@dataclass(frozen=True)
class KernelSpec:
    """One entry point. ``module`` names the compiled unit it lives in: attention kernels are built
    per head dim with all dtypes (block size is a runtime argument); cache kernels all together."""

    name: str
    source: str
    head_dim: int = 0       # 0: any

    @property
    def module(self) -> tuple[str, int]:
        return (self.source, self.head_dim)

    @property
    def defines(self) -> tuple[str, ...]:
        """Preprocessor options selecting this kernel's module (see the end of attention.cu)."""
        return (f"-DHFP_ONLY_HEAD_DIM={self.head_dim}",) if self.source == ATTENTION_SOURCE else ()


def decode_kernel(tag: str, head_dim: int) -> KernelSpec:
    return KernelSpec(f"hfp_decode_{tag}_d{head_dim}", ATTENTION_SOURCE, head_dim)


def extend_kernel(tag: str, head_dim: int) -> KernelSpec:
    return KernelSpec(f"hfp_extend_{tag}_d{head_dim}", ATTENTION_SOURCE, head_dim)


def reduce_kernel(tag: str, head_dim: int) -> KernelSpec:
    """The split-K merge; compiled into every attention module, so it is looked up in the caller's."""
    return KernelSpec(f"hfp_decode_reduce_{tag}", ATTENTION_SOURCE, head_dim)


def write_kv_kernel(tag: str) -> KernelSpec:
    return KernelSpec(f"hfp_write_kv_{tag}", CACHE_SOURCE)


COPY_BLOCKS = KernelSpec("hfp_copy_blocks", CACHE_SOURCE)


def all_kernels() -> list[KernelSpec]:
    """Every entry point, each once (the reduce kernels under head dim 0)."""
    tags = list(DTYPE_TAGS.values())
    specs = [KernelSpec(f"hfp_decode_reduce_{t}", ATTENTION_SOURCE) for t in tags]
    for d in HEAD_DIMS:
        specs += [decode_kernel(t, d) for t in tags] + [extend_kernel(t, d) for t in tags]
    return specs + [write_kv_kernel(t) for t in tags] + [COPY_BLOCKS]


def dtype_tag(dtype: torch.dtype) -> str:
    try:
        return DTYPE_TAGS[dtype]
    except KeyError:
        raise ValueError(f"hf_paged CUDA kernels: dtype {dtype} is not supported; supported: "
                         f"{', '.join(str(d) for d in DTYPE_TAGS)}") from None


def check_attention_shape(dtype: torch.dtype, head_dim: int, block_size: int, num_q_heads: int,
                          num_kv_heads: int) -> str:
    """Validate a pool/query shape against the table; returns the dtype tag."""
    tag = dtype_tag(dtype)
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"hf_paged CUDA kernels: head_dim {head_dim} is not supported; supported: "
                         f"{HEAD_DIMS}. Set HF_PAGED_FORCE_TORCH=1 to use the PyTorch path.")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"hf_paged CUDA kernels: block_size {block_size} is not supported; supported: "
                         f"{BLOCK_SIZES} (PagedCache block_size).")
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"hf_paged CUDA kernels: {num_q_heads} query heads is not a multiple of "
                         f"{num_kv_heads} KV heads.")
    if num_q_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(f"hf_paged CUDA kernels: {num_q_heads // num_kv_heads} query heads per KV head "
                         f"exceeds the supported maximum {MAX_GROUP}.")
    return tag


def tile_tokens(head_dim: int, elem_bytes: int) -> int:
    """Keys per shared-memory tile (mirror of hfp::tile_tokens in attention.cu)."""
    per_tile = 16384 // (head_dim * elem_bytes)
    return 128 if per_tile >= 128 else 64 if per_tile >= 64 else 32 if per_tile >= 32 else 16


def attention_smem_bytes(head_dim: int, elem_bytes: int, rows: int) -> int:
    """Dynamic shared memory of a decode/extend CTA with ``rows`` query rows (layout: attention.cu)."""
    tile = tile_tokens(head_dim, elem_bytes)
    row_words = head_dim * elem_bytes // 4 + 1
    words = rows * (head_dim + 1) + rows * head_dim + rows * (tile + 1) + 4 * rows + 2 * tile * row_words
    return 4 * words


_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.M)


def kernel_source(source: str) -> str:
    """The text of ``cuda/<source>`` with its local ``#include "x.cuh"`` lines inlined, so that a
    compiler cache keyed on the source text sees every header change."""
    package = resources.files("hf_paged.cuda")
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = package.joinpath(name).read_text()
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(source)
