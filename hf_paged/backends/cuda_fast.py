"""Host side of ``cuda/fast_attention.cu``: fp16/bf16 attention over model-dtype pools on sm_80+.

* :func:`ragged_attention` — the tensor-core kernel over a ragged token list: every query token of a step
  (prefill, chunked prefill, the engine's packed steps, or decode rows with large GQA groups) given by
  its block-table row and stored index; no padding, no scatter.
* :func:`decode_fast` — the cp.async-pipelined CUDA-core decode for groups up to
  ``kernel_registry.FAST_DECODE_MAX_GROUP``.
* :func:`decode_fast_quantised` / :func:`ragged_attention_quantised` — the same two over quantised pools
  (``cuda/fast_quant.cuh``, ``cuda/fast_quant_extend.cuh``).

Work lists (:func:`ragged_chunks`) are built on the device without a host sync, once per step and
chunk size (see :class:`~hf_paged.backends.cuda_backend.CudaStep`). Fp32 queries and pools stay on
``attention.cu`` (:class:`~hf_paged.backends.cuda_backend.CudaBackend`).
"""
from __future__ import annotations

import numpy as np
import torch

from ..kv_formats import QuantizedPool, quantize
from . import kernel_registry as reg
from .cuda_args import ptr
from .splits import split_scratch
from .synthetic import random_paged_kv

_SPLIT_CAP = 1 << 30   # "no split": a partition longer than any key range


def eligible(query: torch.Tensor, k_pool) -> bool:
    """Whether the fast kernels serve these tensors: model-dtype fp16/bf16 pools, the query cast to them."""
    return isinstance(k_pool, torch.Tensor) and reg.DTYPE_TAGS.get(k_pool.dtype) in reg.FAST_DTYPE_TAGS


def tokens_per_chunk(group: int) -> int:
    """Query tokens per ragged CTA: its 64 rows hold tokens x the group's heads."""
    return max(1, reg.RAGGED_ROWS // group)


def ragged_chunks(token_row: torch.Tensor, per_chunk: int, num_rows: int) -> torch.Tensor:
    """int32 [C, 2] (first token, count): runs of consecutive tokens of one row, cut every ``per_chunk``
    tokens. Computed on the token list's device without reading it on the host: C is an upper bound
    (ceil(T / per_chunk) + min(T, rows)) and unused entries have count 0 (their CTAs exit at once)."""
    total = token_row.numel()
    device = token_row.device
    if total == 0:
        return torch.zeros(0, 2, dtype=torch.int32, device=device)
    index = torch.arange(total, device=device)
    new_run = torch.ones(total, dtype=torch.bool, device=device)
    new_run[1:] = token_row[1:] != token_row[:-1]
    run_start = torch.where(new_run, index, torch.zeros_like(index)).cummax(0).values
    chunk_id = ((index - run_start) % per_chunk == 0).cumsum(0) - 1
    capacity = -(-total // per_chunk) + min(total, num_rows)
    first = torch.zeros(capacity, dtype=torch.int64, device=device)
    first.scatter_reduce_(0, chunk_id, index, reduce="amin", include_self=False)
    count = torch.zeros(capacity, dtype=torch.int64, device=device).scatter_add_(0, chunk_id, torch.ones_like(index))
    return torch.stack([first, count], 1).to(torch.int32).contiguous()


def _merge(backend, tag: str, head_dim: int, out, part_out, part_lse, splits: int, fmt_tag: str = "") -> None:
    rows = out.numel() // head_dim
    args = (ptr(out), ptr(part_out), ptr(part_lse), np.int32(splits), np.int32(head_dim))
    backend.launch(reg.merge_kernel(tag, head_dim, fmt_tag), out.device, (rows, 1, 1), (reg.THREADS, 1, 1), args, 0,
                   {"out": (out, 2), "part_out": (part_out, 4), "part_lse": (part_lse, 4)},
                   {"grid.x": f"{rows} (token, query head) rows"})


def _aligned_tokens(query: torch.Tensor) -> torch.Tensor:
    """[T, Hq, D] with unit stride on D and 16-byte aligned token and head rows (copied otherwise)."""
    elem = query.element_size()
    ok = (query.stride(2) == 1 and query.data_ptr() % 16 == 0
          and all(query.stride(i) * elem % 16 == 0 or query.shape[i] == 1 for i in (0, 1)))
    return query if ok else query.contiguous()


def _ragged_split(backend, query: torch.Tensor, chunks: torch.Tensor, num_kv_heads: int, span: int, workspace):
    """The split-K plan of a ragged launch (one CTA per chunk and KV head) and its scratch: (partition,
    splits, part_out, part_lse); one split means a partition longer than any key range."""
    total, num_q_heads, head_dim = query.shape
    ctas = chunks.shape[0] * num_kv_heads
    split = backend.plan_splits(query.device, ctas, span, reg.ragged_tile_keys(head_dim))
    partition, splits = (_SPLIT_CAP, 1) if split.splits == 1 else (split.partition, split.splits)
    part_out, part_lse = split_scratch(workspace.splits if workspace is not None else None,
                                       ("ragged", total, num_q_heads, head_dim, splits),
                                       total * num_q_heads, splits, head_dim, query.device)
    return partition, splits, part_out, part_lse


def ragged_attention(backend, query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     block_tables: torch.Tensor, token_row: torch.Tensor, token_pos: torch.Tensor,
                     chunks: torch.Tensor, scale: float, window: int, span: int,
                     workspace=None) -> torch.Tensor:
    """query [T, Hq, D] (any strides; fp16/bf16 pools) -> out [T, Hq, D]. token_row / token_pos int32 [T]
    (pos -1 = pad: zeros); chunks from :func:`ragged_chunks` with ``tokens_per_chunk(group)``; ``span``:
    an upper bound on the keys any token sees (for the split plan, ``backend.plan_splits``); ``workspace``:
    the step's (split scratch shared by its layers), or None."""
    total, num_q_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = k_pool.shape
    group = num_q_heads // num_kv_heads
    tag = reg.check_attention_shape(k_pool.dtype, head_dim, block_size, num_q_heads, num_kv_heads)
    query = _aligned_tokens(query.to(k_pool.dtype))
    out = torch.empty(total, num_q_heads, head_dim, dtype=k_pool.dtype, device=query.device)
    if total == 0 or chunks.shape[0] == 0:
        return out.zero_()
    partition, splits, part_out, part_lse = _ragged_split(backend, query, chunks, num_kv_heads, span, workspace)
    args = (ptr(out), ptr(part_out), ptr(part_lse), ptr(query), np.int64(query.stride(0)),
            np.int64(query.stride(1)), ptr(k_pool), ptr(v_pool), np.int64(k_pool.stride(0)),
            ptr(block_tables), np.int32(block_tables.shape[1]), np.int32(block_size.bit_length() - 1),
            ptr(token_row), ptr(token_pos), ptr(chunks), np.int32(num_kv_heads), np.int32(group),
            np.int32(window), np.int32(partition), np.float32(scale * np.log2(np.e)))
    tensors = {"out": (out, 16), "query": (query, 16), "k_pool": (k_pool, 16), "v_pool": (v_pool, 16),
               "block_tables": (block_tables, 4), "token_row": (token_row, 4), "token_pos": (token_pos, 4),
               "chunks": (chunks, 4), "part_out": (part_out, 16), "part_lse": (part_lse, 4)}
    explain = {"grid.x": f"{chunks.shape[0]} work chunks x {num_kv_heads} KV heads",
               "grid.y": f"ceil({span} keys / partition {partition}): raise partition_size"}
    backend.launch(reg.ragged_kernel(tag, head_dim), query.device,
                   (chunks.shape[0] * num_kv_heads, splits, 1), (reg.THREADS, 1, 1), args,
                   reg.ragged_smem_bytes(head_dim), tensors, explain)
    if splits > 1:
        _merge(backend, tag, head_dim, out, part_out, part_lse, splits)
    return out


def decode_fast(backend, query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, window: int, span: int,
                workspace=None) -> torch.Tensor:
    """query [B, Hq, D] -> out [B, Hq, D] on CUDA cores (groups up to FAST_DECODE_MAX_GROUP)."""
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = k_pool.shape
    group = num_q_heads // num_kv_heads
    tag = reg.check_attention_shape(k_pool.dtype, head_dim, block_size, num_q_heads, num_kv_heads)
    query = query.to(k_pool.dtype).contiguous()
    out = torch.empty_like(query)
    ctas = batch * num_kv_heads
    split = backend.plan_splits(query.device, ctas, span, reg.decode_fast_keys(head_dim))
    partition, splits = (_SPLIT_CAP, 1) if split.splits == 1 else (split.partition, split.splits)
    part_out, part_lse = split_scratch(workspace.splits if workspace is not None else None,
                                       ("decode_fast", batch, num_q_heads, head_dim, splits),
                                       batch * num_q_heads, splits, head_dim, query.device)
    args = (ptr(out), ptr(part_out), ptr(part_lse), ptr(query), ptr(k_pool), ptr(v_pool),
            np.int64(k_pool.stride(0)), ptr(block_tables), np.int32(block_tables.shape[1]),
            np.int32(block_size.bit_length() - 1), ptr(context_lens), np.int32(num_kv_heads), np.int32(group),
            np.int32(reg.decode_key_groups(group, head_dim)), np.int32(window), np.int32(partition),
            np.float32(scale * np.log2(np.e)))
    tensors = {"out": (out, 16), "query": (query, 16), "k_pool": (k_pool, 16), "v_pool": (v_pool, 16),
               "block_tables": (block_tables, 4), "context_lens": (context_lens, 4), "part_out": (part_out, 16),
               "part_lse": (part_lse, 4)}
    explain = {"grid.x": f"{batch} rows x {num_kv_heads} KV heads",
               "grid.y": f"ceil({span} keys / partition {partition}): raise partition_size"}
    backend.launch(reg.decode_fast_kernel(tag, head_dim), query.device, (ctas, splits, 1), (reg.THREADS, 1, 1),
                   args, reg.decode_fast_smem_bytes(head_dim), tensors, explain)
    if splits > 1:
        _merge(backend, tag, head_dim, out, part_out, part_lse, splits)
    return out


def eligible_quantised(query: torch.Tensor, k_pool) -> bool:
    """Decode over quantised pools that the quantised fast decode serves: a format with kernels (int8,
    fp8_e4m3, fp8_e5m2, int4; not KIVI or nvfp4), fp16/bf16 queries, GQA groups up to
    FAST_DECODE_MAX_GROUP (each lane group holds the whole group in registers; larger groups, and fp32
    queries, stay on attention.cu). Rotated pools qualify: the backend's attention functions work in the
    rotated space (``Step.attend`` rotates the query before them and unrotates their output)."""
    return (isinstance(k_pool, QuantizedPool) and k_pool.fmt.name in reg.KV_FORMAT_TAGS
            and reg.DTYPE_TAGS.get(query.dtype) in reg.FAST_DTYPE_TAGS
            and query.shape[-2] // k_pool.shape[0] <= reg.FAST_DECODE_MAX_GROUP)


def decode_fast_quantised(backend, query: torch.Tensor, k_pool: QuantizedPool, v_pool: QuantizedPool,
                          block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, window: int,
                          span: int, workspace=None) -> torch.Tensor:
    """query [B, Hq, D] (fp16/bf16) over quantised pools -> out [B, Hq, D] in the query's dtype; groups up
    to FAST_DECODE_MAX_GROUP (cuda/fast_quant.cuh: codes and scales staged by cp.async)."""
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads, num_blocks, block_size, _ = k_pool.shape
    group = num_q_heads // num_kv_heads
    fmt_tag = reg.kv_format_tag(k_pool.fmt)
    tag = reg.check_attention_shape(query.dtype, head_dim, block_size, num_q_heads, num_kv_heads, k_pool.fmt)
    query = query.contiguous()
    out = torch.empty_like(query)
    ctas = batch * num_kv_heads
    split = backend.plan_splits(query.device, ctas, span, reg.decode_fast_quant_keys(head_dim, fmt_tag))
    partition, splits = (_SPLIT_CAP, 1) if split.splits == 1 else (split.partition, split.splits)
    part_out, part_lse = split_scratch(workspace.splits if workspace is not None else None,
                                       ("decode_fast", batch, num_q_heads, head_dim, splits),
                                       batch * num_q_heads, splits, head_dim, query.device)
    args = (ptr(out), ptr(part_out), ptr(part_lse), ptr(query), ptr(k_pool.data), ptr(k_pool.scales),
            ptr(v_pool.data), ptr(v_pool.scales), np.int64(num_blocks * block_size), ptr(block_tables),
            np.int32(block_tables.shape[1]), np.int32(block_size.bit_length() - 1), ptr(context_lens),
            np.int32(num_kv_heads), np.int32(group), np.int32(window), np.int32(partition),
            np.float32(scale * np.log2(np.e)))
    tensors = {"out": (out, 16), "query": (query, 16), "k_codes": (k_pool.data, 16), "k_scales": (k_pool.scales, 16),
               "v_codes": (v_pool.data, 16), "v_scales": (v_pool.scales, 16), "block_tables": (block_tables, 4),
               "context_lens": (context_lens, 4), "part_out": (part_out, 16), "part_lse": (part_lse, 4)}
    explain = {"grid.x": f"{batch} rows x {num_kv_heads} KV heads",
               "grid.y": f"ceil({span} keys / partition {partition}): raise partition_size"}
    backend.launch(reg.decode_fast_kernel(tag, head_dim, fmt_tag), query.device, (ctas, splits, 1),
                   (reg.THREADS, 1, 1), args, reg.decode_fast_quant_smem_bytes(head_dim, fmt_tag), tensors, explain)
    if splits > 1:
        _merge(backend, tag, head_dim, out, part_out, part_lse, splits, fmt_tag)
    return out


def eligible_quantised_extend(query: torch.Tensor, k_pool) -> bool:
    """Extend (multi-token queries) over quantised pools that the quantised tensor-core kernel serves:
    a format with kernels, fp16/bf16 queries, any supported GQA group (a CTA's 64 rows hold
    64 // group tokens). Rotated pools qualify, as for :func:`eligible_quantised`."""
    return (isinstance(k_pool, QuantizedPool) and k_pool.fmt.name in reg.KV_FORMAT_TAGS
            and reg.DTYPE_TAGS.get(query.dtype) in reg.FAST_DTYPE_TAGS)


def ragged_attention_quantised(backend, query: torch.Tensor, k_pool: QuantizedPool, v_pool: QuantizedPool,
                               block_tables: torch.Tensor, token_row: torch.Tensor, token_pos: torch.Tensor,
                               chunks: torch.Tensor, scale: float, window: int, span: int,
                               workspace=None) -> torch.Tensor:
    """:func:`ragged_attention` over quantised pools (cuda/fast_quant_extend.cuh: codes and scales staged by
    cp.async, dequantised once per CTA into the tiles the mma reads); out in the query's dtype (fp16/bf16)."""
    total, num_q_heads, head_dim = query.shape
    num_kv_heads, num_blocks, block_size, _ = k_pool.shape
    group = num_q_heads // num_kv_heads
    fmt_tag = reg.kv_format_tag(k_pool.fmt)
    tag = reg.check_attention_shape(query.dtype, head_dim, block_size, num_q_heads, num_kv_heads, k_pool.fmt)
    query = _aligned_tokens(query)
    out = torch.empty(total, num_q_heads, head_dim, dtype=query.dtype, device=query.device)
    if total == 0 or chunks.shape[0] == 0:
        return out.zero_()
    partition, splits, part_out, part_lse = _ragged_split(backend, query, chunks, num_kv_heads, span, workspace)
    args = (ptr(out), ptr(part_out), ptr(part_lse), ptr(query), np.int64(query.stride(0)),
            np.int64(query.stride(1)), ptr(k_pool.data), ptr(k_pool.scales), ptr(v_pool.data), ptr(v_pool.scales),
            np.int64(num_blocks * block_size), ptr(block_tables), np.int32(block_tables.shape[1]),
            np.int32(block_size.bit_length() - 1), ptr(token_row), ptr(token_pos), ptr(chunks),
            np.int32(num_kv_heads), np.int32(group), np.int32(window), np.int32(partition),
            np.float32(scale * np.log2(np.e)))
    tensors = {"out": (out, 16), "query": (query, 16), "k_codes": (k_pool.data, 16), "k_scales": (k_pool.scales, 16),
               "v_codes": (v_pool.data, 16), "v_scales": (v_pool.scales, 16), "block_tables": (block_tables, 4),
               "token_row": (token_row, 4), "token_pos": (token_pos, 4), "chunks": (chunks, 4),
               "part_out": (part_out, 16), "part_lse": (part_lse, 4)}
    explain = {"grid.x": f"{chunks.shape[0]} work chunks x {num_kv_heads} KV heads",
               "grid.y": f"ceil({span} keys / partition {partition}): raise partition_size"}
    backend.launch(reg.ragged_kernel(tag, head_dim, fmt_tag), query.device,
                   (chunks.shape[0] * num_kv_heads, splits, 1), (reg.THREADS, 1, 1), args,
                   reg.ragged_quant_smem_bytes(head_dim, fmt_tag), tensors, explain)
    if splits > 1:
        _merge(backend, tag, head_dim, out, part_out, part_lse, splits, fmt_tag)
    return out


def self_check(backend, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Both kernels once, on a small random case, against ``torch_backend``: the first use of the PTX paths
    (mma.sync fragments, ldmatrix, cp.async) on a real device is checked before any model output depends
    on them. None when they agree, else what disagreed (the caller then keeps attention.cu)."""
    from . import torch_backend  # noqa: PLC0415  (the reference; imported only when a check runs)
    gen = torch.Generator().manual_seed(0)
    num_kv_heads, lengths = 2, [150, 5, 1]
    *pools, tables, lens = random_paged_kv(lengths, 16, num_kv_heads, head_dim, dtype, gen, spare_blocks=1,
                                           device=device)
    pos = torch.stack([torch.arange(100, 150), torch.cat([torch.arange(5), torch.full((45,), -1)]),
                       torch.cat([torch.arange(1), torch.full((49,), -1)])]).to(device, torch.int32)
    tolerance = 2e-2 if dtype == torch.float16 else 6e-2
    for group in (4, 8):                      # CUDA-core decode, and decode on tensor cores
        num_q_heads = num_kv_heads * group
        query = torch.randn(len(lengths), num_q_heads, head_dim, generator=gen).to(device, dtype)
        cases = {
            f"decode, group {group}": (
                backend.decode_attention(query, *pools, tables, lens, 0.1),
                torch_backend.decode_attention(query, *pools, tables, lens, 0.1)),
        }
        extend_q = torch.randn(len(lengths), num_q_heads, pos.shape[1], head_dim, generator=gen).to(device, dtype)
        flat = extend_q.transpose(1, 2).reshape(-1, num_q_heads, head_dim)
        rows = torch.arange(len(lengths), dtype=torch.int32, device=device).repeat_interleave(pos.shape[1])
        out = backend.ragged_attention(flat, *pools, tables, rows, pos.reshape(-1), 0.1, 0, max(lengths))
        cases[f"prefill, group {group}"] = (
            out.view(len(lengths), pos.shape[1], num_q_heads, head_dim).transpose(1, 2),
            torch_backend.extend_attention(extend_q, *pools, tables, lens, pos, 0.1))
        for name, (got, want) in cases.items():
            error = (got.float() - want.float()).abs().max().item()
            if not error <= tolerance:        # NaN fails too
                return f"{name}: max |error| {error:.3g} > {tolerance} ({dtype}, head_dim {head_dim})"
    return None


def self_check_quantised(backend, device: torch.device, dtype: torch.dtype, head_dim: int, fmt) -> str | None:
    """The quantised fast decode once per (head dim, format), on small random pools, against attention.cu's
    quantised decode (the kernels it replaces, whose compute equals the model-dtype kernels' bit for bit):
    groups 1 and 4, a split-K case and a window. None when they agree, else what disagreed (the caller
    then keeps attention.cu)."""
    reference = type(backend)(backend.launcher, fast_kernels=False)    # attention.cu, the same loaded modules
    gen = torch.Generator().manual_seed(0)
    num_kv_heads, lengths = 2, [600, 5, 1, 0]
    k, v, tables, lens = random_paged_kv(lengths, 16, num_kv_heads, head_dim, torch.float32, gen, spare_blocks=1)
    k_pool, v_pool = (QuantizedPool(*(t.to(device) for t in quantize(fmt, x)), fmt, head_dim) for x in (k, v))
    tables, lens = tables.to(device), lens.to(device)
    # Error relative to each output row's largest element: both kernels round to the dtype once (one ulp:
    # 2^-8 bf16, 2^-11 fp16), so 5x that passes, and a value off by 10% on any row fails.
    tolerance = 2e-2 if dtype == torch.bfloat16 else 2.5e-3
    for group, window in ((1, 0), (4, 0), (4, 37)):       # row 600 splits on a GPU (MIN_PARTITION 256)
        query = torch.randn(len(lengths), num_kv_heads * group, head_dim, generator=gen).to(device, dtype)
        span = min(max(lengths), window) if window else max(lengths)
        got = decode_fast_quantised(backend, query, k_pool, v_pool, tables, lens, 0.3, window, span).float()
        want = reference.decode_attention(query, k_pool, v_pool, tables, lens, 0.3, window, max(lengths)).float()
        error = ((got - want).abs().amax(-1) / want.abs().amax(-1).clamp_min(1e-3)).max().item()
        if not error <= tolerance:            # NaN fails too
            return (f"quantised decode ({fmt.name}), group {group}, window {window}: max relative error "
                    f"{error:.3g} > {tolerance} ({dtype}, head_dim {head_dim})")
    return None


def self_check_quantised_extend(backend, device: torch.device, dtype: torch.dtype, head_dim: int, fmt) -> str | None:
    """The quantised tensor-core extend once per (dtype, head dim, format), on small random pools, against
    attention.cu's quantised extend: groups 1 and 8, a prefix + chunk row (positions 520..599 over 600
    stored tokens: split-K on a GPU), a short row, a window. None when they agree, else what disagreed."""
    reference = type(backend)(backend.launcher, fast_kernels=False)
    gen = torch.Generator().manual_seed(0)
    num_kv_heads, lengths, q_len = 2, [600, 5], 80
    k, v, tables, lens = random_paged_kv(lengths, 16, num_kv_heads, head_dim, torch.float32, gen, spare_blocks=1)
    k_pool, v_pool = (QuantizedPool(*(t.to(device) for t in quantize(fmt, x)), fmt, head_dim) for x in (k, v))
    tables, lens = tables.to(device), lens.to(device)
    pos = torch.stack([torch.arange(520, 600), torch.cat([torch.arange(5), torch.full((q_len - 5,), -1)])])
    pos = pos.to(device, torch.int32)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 2.5e-3       # relative to each row's largest element
    for group, window in ((1, 0), (8, 0), (8, 37)):
        query = torch.randn(len(lengths), num_kv_heads * group, q_len, head_dim, generator=gen).to(device, dtype)
        got = backend.extend_attention(query, k_pool, v_pool, tables, lens, pos, 0.3, window).float()
        want = reference.extend_attention(query, k_pool, v_pool, tables, lens, pos, 0.3, window).float()
        error = ((got - want).abs().amax(-1) / want.abs().amax(-1).clamp_min(1e-3)).max().item()
        if not error <= tolerance:            # NaN fails too
            return (f"quantised extend ({fmt.name}), group {group}, window {window}: max relative error "
                    f"{error:.3g} > {tolerance} ({dtype}, head_dim {head_dim})")
    return None
