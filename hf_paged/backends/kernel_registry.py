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

from ..kv_formats import FORMATS, KVFormat

HEAD_DIMS = (64, 80, 96, 128, 256)
BLOCK_SIZES = (8, 16, 32)   # a runtime power of two in the kernels; these are the tested ones
DTYPE_TAGS = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
MAX_GROUP = 32            # query heads per KV head (decode puts a whole group in one CTA)
MAX_ROWS = 32             # query rows (heads x tokens) per extend CTA
THREADS = 128             # threads per block of every kernel (hfp::kThreads)
ATTENTION_SOURCE = "attention.cu"
CACHE_SOURCE = "cache_ops.cu"
# sm_80+ fp16/bf16 kernels over model-dtype pools: cp.async decode for small groups, tensor-core
# ragged attention for the rest (fast_attention.cu); fp32 and quantised pools use attention.cu.
FAST_SOURCE = "fast_attention.cu"
FAST_DTYPE_TAGS = ("f16", "bf16")
FAST_DECODE_MAX_GROUP = 4     # larger groups decode on tensor cores (the ragged kernel, one token); bench/roofline.py
RAGGED_ROWS = 64              # query rows (tokens x group heads) per ragged CTA
# Quantised KV formats (hf_paged/kv_formats.py name -> kernel-name tag). Their kernels read codes and
# scales and dequantise into the query's dtype; the write kernels quantise from the key's dtype.
KV_FORMAT_TAGS = {"fp8_e4m3": "fp8e4m3", "fp8_e5m2": "fp8e5m2", "int8": "int8", "int4": "int4"}
# -DHFP_ONLY_KV_FORMAT value of each attention module ("" = the model dtype); mirror of cuda/kv_quant.cuh.
KV_FORMAT_IDS = {"": 1, "fp8e4m3": 2, "fp8e5m2": 3, "int8": 4, "int4": 5}


@dataclass(frozen=True)
class KernelSpec:
    """One entry point. ``module`` names the compiled unit it lives in: attention kernels are built
    per (head dim, KV format) with all dtypes (block size is a runtime argument), so a model compiles
    only the kernels of its head dim and format; cache kernels all together."""

    name: str
    source: str
    head_dim: int = 0       # 0: any
    kv_format: str = ""     # KV_FORMAT_TAGS value of quantised pools; "" = the model dtype

    @property
    def module(self) -> tuple[str, int, str]:
        return (self.source, self.head_dim, self.kv_format)

    @property
    def defines(self) -> tuple[str, ...]:
        """Preprocessor options selecting this kernel's module (see the end of attention.cu)."""
        if self.source == FAST_SOURCE:
            return (f"-DHFP_ONLY_HEAD_DIM={self.head_dim}", f"-DHFP_ONLY_KV_FORMAT={KV_FORMAT_IDS[self.kv_format]}")
        if self.source != ATTENTION_SOURCE:
            return ()
        return (f"-DHFP_ONLY_HEAD_DIM={self.head_dim}", f"-DHFP_ONLY_KV_FORMAT={KV_FORMAT_IDS[self.kv_format]}")


def _prefix(kind: str, kv_format: str) -> str:
    return f"hfp_{kind}_{kv_format}_" if kv_format else f"hfp_{kind}_"


def decode_kernel(tag: str, head_dim: int, kv_format: str = "") -> KernelSpec:
    return KernelSpec(f"{_prefix('decode', kv_format)}{tag}_d{head_dim}", ATTENTION_SOURCE, head_dim, kv_format)


def extend_kernel(tag: str, head_dim: int, kv_format: str = "") -> KernelSpec:
    return KernelSpec(f"{_prefix('extend', kv_format)}{tag}_d{head_dim}", ATTENTION_SOURCE, head_dim, kv_format)


def reduce_kernel(tag: str, head_dim: int, kv_format: str = "") -> KernelSpec:
    """The split-K merge; compiled into every attention module, so it is looked up in the caller's."""
    return KernelSpec(f"hfp_decode_reduce_{tag}", ATTENTION_SOURCE, head_dim, kv_format)


def ragged_kernel(tag: str, head_dim: int, kv_format: str = "") -> KernelSpec:
    """The tensor-core kernel; ``kv_format``: over quantised pools (cuda/fast_quant_extend.cuh), ``tag`` the
    query's dtype."""
    return KernelSpec(f"{_prefix('ragged', kv_format)}{tag}_d{head_dim}", FAST_SOURCE, head_dim, kv_format)


def decode_fast_kernel(tag: str, head_dim: int, kv_format: str = "") -> KernelSpec:
    """The cp.async decode; ``kv_format``: over quantised pools (cuda/fast_quant.cuh), ``tag`` the query's dtype."""
    return KernelSpec(f"{_prefix('decode_fast', kv_format)}{tag}_d{head_dim}", FAST_SOURCE, head_dim, kv_format)


def merge_kernel(tag: str, head_dim: int, kv_format: str = "") -> KernelSpec:
    """The split merge of the fast kernels; compiled into every fast_attention.cu module."""
    return KernelSpec(f"hfp_merge_splits_{tag}", FAST_SOURCE, head_dim, kv_format)


def write_kv_kernel(tag: str, kv_format: str = "") -> KernelSpec:
    """Writes keys/values of dtype ``tag``: into a model-dtype pool of that dtype, or quantised."""
    return KernelSpec(f"{_prefix('write_kv', kv_format)}{tag}", CACHE_SOURCE)


COPY_BLOCKS = KernelSpec("hfp_copy_blocks", CACHE_SOURCE)
# copy_blocks in 4- and 1-byte words, for tiles (or pool addresses) that are not multiples of 16 bytes
COPY_BLOCKS_BY_WORD = {16: COPY_BLOCKS, 4: KernelSpec("hfp_copy_blocks_w4", CACHE_SOURCE),
                       1: KernelSpec("hfp_copy_blocks_w1", CACHE_SOURCE)}


def kv_format_head_dims(kv_format: str) -> tuple[int, ...]:
    """The head dims with kernels for a format tag (int4 needs whole groups of 16)."""
    fmt = FORMATS[_FORMAT_NAMES[kv_format]]
    return tuple(d for d in HEAD_DIMS if not fmt.group or d % fmt.group == 0)


def all_kernels() -> list[KernelSpec]:
    """Every entry point, each once (the reduce kernels under head dim 0)."""
    tags = list(DTYPE_TAGS.values())
    specs = [KernelSpec(f"hfp_decode_reduce_{t}", ATTENTION_SOURCE) for t in tags]
    specs += [KernelSpec(f"hfp_merge_splits_{t}", FAST_SOURCE) for t in FAST_DTYPE_TAGS]
    for d in HEAD_DIMS:
        specs += [ragged_kernel(t, d) for t in FAST_DTYPE_TAGS] + [decode_fast_kernel(t, d) for t in FAST_DTYPE_TAGS]
    for d in HEAD_DIMS:
        specs += [decode_kernel(t, d) for t in tags] + [extend_kernel(t, d) for t in tags]
    for f in KV_FORMAT_TAGS.values():
        for d in kv_format_head_dims(f):
            specs += [decode_kernel(t, d, f) for t in tags] + [extend_kernel(t, d, f) for t in tags]
            specs += [decode_fast_kernel(t, d, f) for t in FAST_DTYPE_TAGS]
            specs += [ragged_kernel(t, d, f) for t in FAST_DTYPE_TAGS]
    specs += [write_kv_kernel(t) for t in tags]
    specs += [write_kv_kernel(t, f) for f in KV_FORMAT_TAGS.values() for t in tags]
    return specs + list(COPY_BLOCKS_BY_WORD.values())


def attention_modules() -> list[tuple[str, int, str]]:
    """Every compiled attention unit (source, head dim, format tag), model dtype first."""
    return sorted({s.module for s in all_kernels() if s.source != CACHE_SOURCE and s.head_dim},
                  key=lambda m: (m[2] != "", m[2], m[0], m[1]))


def module_kernel_names(module: tuple[str, int, str]) -> set[str]:
    """The entry points one compiled module holds: its kernels, and in an attention module the reduce
    kernels too."""
    names = {spec.name for spec in all_kernels() if spec.module == module}
    if module[0] == ATTENTION_SOURCE:
        names |= {reduce_kernel(t, module[1], module[2]).name for t in DTYPE_TAGS.values()}
    if module[0] == FAST_SOURCE:
        names |= {merge_kernel(t, module[1], module[2]).name for t in FAST_DTYPE_TAGS}
    return names


_FORMAT_NAMES = {tag: name for name, tag in KV_FORMAT_TAGS.items()}


def has_kernels(fmt: KVFormat | None) -> bool:
    """Whether the CUDA kernels read pools of ``fmt`` (None: the model's dtype, always). Formats without
    kernels ("nvfp4", "kivi") are served by the PyTorch path on every device (``cache.pools``)."""
    return fmt is None or fmt.name in KV_FORMAT_TAGS


def kv_format_tag(fmt: KVFormat) -> str:
    """The kernel-name tag of a quantised format (refusing formats without kernels)."""
    try:
        return KV_FORMAT_TAGS[fmt.name]
    except KeyError:
        raise ValueError(f"hf_paged CUDA kernels: kv_cache_dtype {fmt.name!r} has no kernels; supported: "
                         f"{', '.join(KV_FORMAT_TAGS)}. Set HF_PAGED_FORCE_TORCH=1 to use the PyTorch path.") from None


def dtype_tag(dtype: torch.dtype) -> str:
    try:
        return DTYPE_TAGS[dtype]
    except KeyError:
        raise ValueError(f"hf_paged CUDA kernels: dtype {dtype} is not supported; supported: "
                         f"{', '.join(str(d) for d in DTYPE_TAGS)}") from None


def check_attention_shape(dtype: torch.dtype, head_dim: int, block_size: int, num_q_heads: int,
                          num_kv_heads: int, kv_format: KVFormat | None = None) -> str:
    """Validate a pool/query shape against the table; returns the dtype tag. ``dtype``: the pools'
    dtype, or with quantised pools (``kv_format``) the query's, which the kernels dequantise into."""
    tag = dtype_tag(dtype)
    if kv_format is not None:
        kv_format.check_head_dim(head_dim)
        kv_format_tag(kv_format)
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


# --- fast_attention.cu geometry (mirrors of RaggedShape / DecodeShape there) -----------------------
def ragged_tile_keys(head_dim: int) -> int:
    return 64 if head_dim <= 128 else 32


def ragged_smem_bytes(head_dim: int) -> int:
    """q [64][D + 8] + K and V [2][keys][D + 8] (fp16/bf16) + 64 int positions."""
    return (RAGGED_ROWS + 4 * ragged_tile_keys(head_dim)) * (head_dim + 8) * 2 + 4 * RAGGED_ROWS


def decode_fast_slots(head_dim: int) -> int:
    """Lane groups per decode CTA: 128 threads / lanes per head_dim (one 16-byte chunk each, a power of two)."""
    chunks = head_dim // 8
    return THREADS // (8 if chunks <= 8 else 16 if chunks <= 16 else 32)


def decode_fast_keys(head_dim: int) -> int:
    return 32 if head_dim <= 128 else 16


DECODE_FAST_STAGES = 3


def decode_fast_smem_bytes(head_dim: int) -> int:
    """K and V rings [stages][keys][D] (fp16/bf16) + the key-group merge [slots][D + 2] fp32."""
    ring = DECODE_FAST_STAGES * decode_fast_keys(head_dim) * head_dim * 2
    return 2 * ring + 4 * decode_fast_slots(head_dim) * (head_dim + 2)


# Quantised fast decode (mirror of QuantDecodeShape in cuda/fast_quant.cuh): each lane group serves
# the whole GQA group, so groups up to FAST_DECODE_MAX_GROUP at every head dim.
QUANT_RUN = 8   # stored tokens per staged run (within one block: block sizes >= 8)


def _format_bits_scales(kv_format: str, head_dim: int) -> tuple[int, int]:
    fmt = FORMATS[_FORMAT_NAMES[kv_format]]
    return fmt.bits, fmt.num_scales(head_dim)


def decode_fast_quant_keys(head_dim: int, kv_format: str) -> int:
    """Keys per stage: the bf16 kernel's code bytes per stage (2x the keys at 8 bits, 4x at 4)."""
    return decode_fast_keys(head_dim) * 16 // _format_bits_scales(kv_format, head_dim)[0]


def decode_fast_quant_smem_bytes(head_dim: int, kv_format: str) -> int:
    """K and V rings [stages][keys][code bytes + 2 x scales] + the merge [slots][4 heads][D + 2] fp32."""
    bits, scales = _format_bits_scales(kv_format, head_dim)
    stage = decode_fast_quant_keys(head_dim, kv_format) * (head_dim * bits // 8 + 2 * scales)
    return 2 * DECODE_FAST_STAGES * stage + 4 * decode_fast_slots(head_dim) * FAST_DECODE_MAX_GROUP * (head_dim + 2)


def ragged_quant_smem_bytes(head_dim: int, kv_format: str) -> int:
    """Quantised tensor-core extend (mirror of QuantRaggedShape): q [64][D + 8] + single K and V tiles
    [keys][D + 8] (fp16/bf16) + raw codes and scales [2 buffers][K, V][keys][code bytes + 2 x scales]
    + 64 int positions."""
    bits, scales = _format_bits_scales(kv_format, head_dim)
    keys = ragged_tile_keys(head_dim)
    raw = 4 * keys * (head_dim * bits // 8 + 2 * scales)
    return (RAGGED_ROWS + 2 * keys) * (head_dim + 8) * 2 + raw + 4 * RAGGED_ROWS


def uses_decode_fast(group: int, head_dim: int) -> bool:
    """Decode on CUDA cores (one lane group per query head) or, for larger groups, on tensor cores."""
    return group <= min(FAST_DECODE_MAX_GROUP, decode_fast_slots(head_dim))


def decode_key_groups(group: int, head_dim: int) -> int:
    """Key groups per decode CTA: the largest power of two with group * key_groups <= slots."""
    spare = decode_fast_slots(head_dim) // group
    return 1 << (spare.bit_length() - 1)


def kernel_smem_bytes(spec: KernelSpec, group: int, q_per_cta: int = 1) -> int:
    """Dynamic shared memory of one launch of ``spec`` for a GQA group (extend: rows = group x q_per_cta)."""
    if spec.source == FAST_SOURCE:
        if spec.name.startswith("hfp_ragged_"):
            return ragged_quant_smem_bytes(spec.head_dim, spec.kv_format) if spec.kv_format else \
                ragged_smem_bytes(spec.head_dim)
        if spec.name.startswith("hfp_decode_fast_"):
            if spec.kv_format:
                return decode_fast_quant_smem_bytes(spec.head_dim, spec.kv_format)
            return decode_fast_smem_bytes(spec.head_dim)
        return 0
    if spec.source == ATTENTION_SOURCE and spec.head_dim and "reduce" not in spec.name:
        elem = 4 if spec.name.split("_")[-2] == "f32" else 2
        rows = group if "_decode_" in spec.name else min(MAX_ROWS, group * q_per_cta)
        return attention_smem_bytes(spec.head_dim, elem, rows)
    return 0
