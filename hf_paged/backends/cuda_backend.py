"""CUDA backend: the four functions of ``torch_backend`` as launches of the kernels in ``hf_paged/cuda``.

Same signatures, pool layout and semantics as :mod:`hf_paged.backends.torch_backend`. The host side (shape
checks, argument packing, split-K planning) lives in :class:`KernelBackend`, which launches through a
*launcher*: :class:`CupyLauncher` on a GPU, or the CPU shim in ``tests/backends`` (same kernels, same
arguments). cupy is imported on the first launch, never at ``import hf_paged``.

Pools are model-dtype tensors or :class:`~hf_paged.kv_formats.QuantizedPool` (codes + bf16 scales): then
write_kv quantises from the keys' dtype, and the attention kernels dequantise into the query's dtype.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from ..kv_formats import QuantizedPool
from ..plan import PackedPlan
from . import cuda_fast
from . import kernel_registry as reg
from .cupy_loader import cuda_include_dirs, cupy_cuda_major, import_cupy
from .launch_checks import DeviceLimits, check_launch, check_tensors
from .step import PreparedStep

logger = logging.getLogger(__name__)
_DEFAULT_SMEM_LIMIT = 48 * 1024


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _check_pools(k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    if k_pool.shape != v_pool.shape or k_pool.dtype != v_pool.dtype:
        raise ValueError(f"k_pool {tuple(k_pool.shape)} {k_pool.dtype} and v_pool {tuple(v_pool.shape)} "
                         f"{v_pool.dtype} differ")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("pools must be contiguous [Hkv, num_blocks, block_size, D] tensors")


def _check_quantized_pools(k_pool: QuantizedPool, v_pool) -> str:
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


def _pool_tensors(k_pool, v_pool) -> dict:
    """The pools' tensors and the alignment the kernels read them with (16-byte words; bf16 scales)."""
    if isinstance(k_pool, QuantizedPool):
        return {"k_codes": (k_pool.data, 16), "k_scales": (k_pool.scales, 2), "v_codes": (v_pool.data, 16),
                "v_scales": (v_pool.scales, 2)}
    return {"k_pool": (k_pool, 16), "v_pool": (v_pool, 16)}


def _copy_word(tile_bytes: int, pools: list[torch.Tensor]) -> int:
    """Bytes per word copy_blocks moves: the largest of 16, 4, 1 dividing a (head, block) tile and
    every pool's address (16 for model-dtype pools and, at block sizes 8/16/32, for codes and scales)."""
    return next(w for w in (16, 4, 1) if tile_bytes % w == 0 and all(p.data_ptr() % w == 0 for p in pools))


class KernelBackend:
    """write_kv / copy_blocks / decode_attention / extend_attention over a kernel launcher.

    launcher: object with ``launch(spec, device, grid, block, args, shared_mem)`` (args: numpy
    scalars; pointers as ``numpy.uint64``) and ``sm_count(device)``.
    partition_size: keys per decode split; ``None`` chooses one per call so that the grid fills the
    device (fewer, longer splits when the batch already does).
    fast_kernels: fp16/bf16 model-dtype pools on fast_attention.cu (the default); False keeps them on
    attention.cu, the kernels the quantised formats share their compute with (for comparisons).
    """

    # Device types on which the fast kernels are checked against PyTorch on first use (cuda_fast.self_check):
    # the GPU's PTX paths; the CPU shim's emulation is what the test-suite proves.
    self_check_devices = ("cuda",)

    def __init__(self, launcher, partition_size: int | None = None, fast_kernels: bool = True):
        self.launcher = launcher
        self.partition_size = partition_size
        self.fast_kernels = fast_kernels
        self._checked: dict[tuple, bool] = {}   # (device, dtype, head_dim) -> fast kernels agreed

    def _fast(self, query: torch.Tensor, k_pool) -> bool:
        """Whether fast_attention.cu serves this call: eligible pools, and on a GPU a passed self-check."""
        if not (self.fast_kernels and cuda_fast.eligible(query, k_pool)):
            return False
        device = k_pool.device
        if device.type not in self.self_check_devices:
            return True
        key = (device, k_pool.dtype, k_pool.shape[-1])
        if key not in self._checked:
            self._checked[key] = True          # the check itself runs the fast kernels
            try:
                problem = cuda_fast.self_check(self, device, k_pool.dtype, k_pool.shape[-1])
            except (RuntimeError, ValueError) as exc:   # e.g. a compiler the kernels do not build with
                problem = f"{type(exc).__name__}: {exc}"
            if problem is not None:
                logger.error("hf_paged: the sm_80+ kernels (cuda/fast_attention.cu) disagree with the PyTorch "
                             "reference on %s: %s. Using attention.cu's kernels instead; please report this "
                             "with the GPU's name.", device, problem)
                self._checked[key] = False
        return self._checked[key]

    def launch(self, spec: reg.KernelSpec, device: torch.device, grid, block, args, shared_mem: int,
               tensors: dict | None = None, explain: dict | None = None) -> None:
        """Every launch goes through here: tensors on ``device`` and aligned as the kernel reads them
        (``tensors``: name -> (tensor or None, bytes)), grid, block and shared memory within the device's
        limits (``explain``: where a quantity comes from and its knob, for the error), then the launcher."""
        check_tensors(spec.name, device, tensors or {})
        check_launch(spec.name, grid, block, shared_mem, self.launcher.device_limits(device), explain)
        self.launcher.launch(spec, device, grid, block, args, shared_mem)

    # -- cache writes -------------------------------------------------------------------------
    def write_kv(self, k_pool: torch.Tensor | QuantizedPool, v_pool: torch.Tensor | QuantizedPool,
                 key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """key, value: [N, Hkv, D] (any strides); slot_mapping: int64 [N], -1 = skip."""
        slots = slot_mapping.reshape(-1).to(torch.int64).contiguous()
        n = slots.numel()
        if n == 0:
            return
        if isinstance(k_pool, QuantizedPool):
            self._write_quantized(k_pool, v_pool, key, value, slots)
            return
        _check_pools(k_pool, v_pool)
        tag = reg.dtype_tag(k_pool.dtype)
        num_kv_heads, head_dim = k_pool.shape[0], k_pool.shape[3]
        key, value = (x.to(k_pool.dtype) for x in (key, value))
        key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (key, value))
        args = (_ptr(k_pool), _ptr(v_pool), _ptr(key), _ptr(value), _ptr(slots), np.int64(k_pool.stride(0)),
                np.int32(num_kv_heads), np.int32(head_dim),
                np.int64(key.stride(0)), np.int64(key.stride(1)),
                np.int64(value.stride(0)), np.int64(value.stride(1)))
        self.launch(reg.write_kv_kernel(tag), k_pool.device, (n, 1, 1), (reg.THREADS, 1, 1), args, 0,
                    {"k_pool": (k_pool, 16), "v_pool": (v_pool, 16), "key": (key, key.element_size()),
                     "value": (value, value.element_size()), "slot_mapping": (slots, 8)})

    def _write_quantized(self, k_pool: QuantizedPool, v_pool: QuantizedPool, key: torch.Tensor,
                         value: torch.Tensor, slots: torch.Tensor) -> None:
        """Quantise on write, from the keys' own dtype (the scales see the values the model made)."""
        fmt_tag = _check_quantized_pools(k_pool, v_pool)
        num_kv_heads, num_blocks, block_size, head_dim = k_pool.shape
        if key.shape[1:] != (num_kv_heads, head_dim) or value.shape != key.shape:
            raise ValueError(f"write_kv: key {tuple(key.shape)} and value {tuple(value.shape)} must be "
                             f"[N, {num_kv_heads}, {head_dim}] for these pools")
        tag = reg.dtype_tag(key.dtype)
        value = value.to(key.dtype)
        key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (key, value))
        args = (_ptr(k_pool.data), _ptr(k_pool.scales), _ptr(v_pool.data), _ptr(v_pool.scales), _ptr(key),
                _ptr(value), _ptr(slots), np.int64(num_blocks * block_size), np.int32(num_kv_heads),
                np.int32(head_dim), np.int64(key.stride(0)), np.int64(key.stride(1)),
                np.int64(value.stride(0)), np.int64(value.stride(1)))
        self.launch(reg.write_kv_kernel(tag, fmt_tag), k_pool.device, (slots.numel(), 1, 1), (reg.THREADS, 1, 1),
                    args, 0, {"k_codes": (k_pool.data, 16), "k_scales": (k_pool.scales, 2),
                              "v_codes": (v_pool.data, 16), "v_scales": (v_pool.scales, 2),
                              "key": (key, key.element_size()), "value": (value, value.element_size()),
                              "slot_mapping": (slots, 8)})

    def copy_blocks(self, pools: list[torch.Tensor], pairs: torch.Tensor) -> None:
        """Block ``dst`` = block ``src`` (every head) for each (src, dst) row of int64 ``pairs`` [P, 2], in
        every pool tensor (indexed by block on dimension 1: model-dtype pools, quantised codes and scales),
        one launch per (shape, dtype size) of the pools given. Destinations must be distinct and not
        sources (copy-on-write targets)."""
        if pairs.numel() == 0 or not pools:
            return
        device = pools[0].device
        groups: dict[tuple, list[torch.Tensor]] = {}
        for pool in pools:
            if pool.dim() < 3 or not pool.is_contiguous():
                raise ValueError(f"copy_blocks: pools must be contiguous [Hkv, num_blocks, ...] tensors, got "
                                 f"{list(pool.shape)}{'' if pool.is_contiguous() else ' (not contiguous)'}")
            if pool.device != device:
                raise ValueError(f"copy_blocks: pools on {device} and {pool.device}; call once per device")
            groups.setdefault((tuple(pool.shape), pool.element_size()), []).append(pool)
        pairs = pairs.to(device=device, dtype=torch.int64).contiguous()
        for (shape, itemsize), group in groups.items():
            self._copy_group(group, shape, itemsize, pairs)

    def _copy_group(self, pools: list[torch.Tensor], shape: tuple, itemsize: int, pairs: torch.Tensor) -> None:
        """One launch for pools of one shape and dtype size."""
        tile_bytes = int(np.prod(shape[2:])) * itemsize                 # one (head, block) tile
        word = _copy_word(tile_bytes, pools)
        table = torch.tensor([p.data_ptr() for p in pools], dtype=torch.int64).to(pairs.device, non_blocking=True)
        args = (_ptr(table), _ptr(pairs), np.int32(shape[0]), np.int64(shape[1] * tile_bytes // word),
                np.int64(tile_bytes // word))
        self.launch(reg.COPY_BLOCKS_BY_WORD[word], pairs.device, (pairs.shape[0], len(pools), 1),
                    (reg.THREADS, 1, 1), args, 0, {f"pool {i}": (p, word) for i, p in enumerate(pools)},
                    {"grid.x": f"{pairs.shape[0]} block copies", "grid.y": f"{len(pools)} pools"})

    # -- attention ----------------------------------------------------------------------------
    def prepare(self, plan) -> PreparedStep:
        """Bind one forward's plan (its tables are already int32 on the device). What every layer shares —
        the ragged token list and work chunks, split partitions, partial-result scratch — is computed by
        the first layer on the device (no host sync) and kept in the step's workspace; later layers only
        launch."""
        return CudaStep(self, plan)

    def _splits_for(self, device: torch.device, tile: int):
        """Keys per split for a grid of ``ctas`` CTAs over ``span`` keys (see _partition)."""
        return lambda ctas, span: self._partition(device, ctas, span, tile)

    def ragged_attention(self, query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         block_tables: torch.Tensor, token_row: torch.Tensor, token_pos: torch.Tensor,
                         scale: float, sliding_window: int = 0, span: int | None = None,
                         workspace: dict | None = None, reuse: str | None = None) -> torch.Tensor:
        """query [T, Hq, D] for fp16/bf16 model-dtype pools -> out [T, Hq, D]: every query token with its
        block-table row and stored index (int32 [T], -1 = pad), tokens of a row consecutive. ``span``:
        a bound on the keys any token sees (default: the table's width in tokens). ``reuse``: a name under
        which the work chunks are kept in ``workspace`` for later calls with the same token list."""
        _check_pools(k_pool, v_pool)
        group = query.shape[1] // k_pool.shape[0]
        block_size = k_pool.shape[2]
        tables = block_tables.to(torch.int32).contiguous()
        rows = token_row.to(torch.int32).contiguous()
        pos = token_pos.to(torch.int32).contiguous()
        per_chunk = cuda_fast.tokens_per_chunk(group)
        key = ("ragged_chunks", reuse, per_chunk)
        chunks = workspace.get(key) if workspace is not None and reuse else None
        if chunks is None:
            chunks = cuda_fast.ragged_chunks(rows, per_chunk, tables.shape[0])
            if workspace is not None and reuse:
                workspace[key] = chunks
        span = tables.shape[1] * block_size if span is None else span
        if sliding_window > 0:
            span = min(span, sliding_window + reg.RAGGED_ROWS)   # a chunk's tokens span < 64 positions
        return cuda_fast.ragged_attention(self, query, k_pool, v_pool, tables, rows, pos, chunks, scale,
                                          sliding_window, max(span, 1),
                                          self._splits_for(query.device, reg.ragged_tile_keys(query.shape[-1])),
                                          workspace)

    def _attention_pools(self, query: torch.Tensor, k_pool, v_pool) -> tuple:
        """(query in the kernels' dtype, dtype tag, format tag ("" unquantised), pool arguments) after
        the checks. Model-dtype pools: the query is cast to the pools' dtype; quantised pools are
        dequantised into the query's dtype. Pool arguments: the pointers, then elements (model dtype)
        or tokens (quantised) per KV head."""
        num_q_heads, head_dim = query.shape[1], query.shape[-1]
        num_kv_heads, num_blocks, block_size, _ = k_pool.shape
        if isinstance(k_pool, QuantizedPool):
            fmt_tag = _check_quantized_pools(k_pool, v_pool)
            tag = reg.check_attention_shape(query.dtype, head_dim, block_size, num_q_heads, num_kv_heads,
                                            k_pool.fmt)
            args = (_ptr(k_pool.data), _ptr(k_pool.scales), _ptr(v_pool.data), _ptr(v_pool.scales),
                    np.int64(num_blocks * block_size))
            return query.contiguous(), tag, fmt_tag, args
        _check_pools(k_pool, v_pool)
        tag = reg.check_attention_shape(k_pool.dtype, head_dim, block_size, num_q_heads, num_kv_heads)
        return query.to(k_pool.dtype).contiguous(), tag, "", (_ptr(k_pool), _ptr(v_pool), np.int64(k_pool.stride(0)))

    def decode_attention(self, query: torch.Tensor, k_pool: torch.Tensor | QuantizedPool,
                         v_pool: torch.Tensor | QuantizedPool, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, scale: float, sliding_window: int = 0,
                         max_context: int | None = None, workspace: dict | None = None) -> torch.Tensor:
        """query [B, Hq, D] -> out [B, Hq, D]; see torch_backend.decode_attention."""
        batch, num_q_heads, head_dim = query.shape
        num_kv_heads, _, block_size, _ = k_pool.shape
        query, tag, fmt_tag, pool_args = self._attention_pools(query, k_pool, v_pool)
        group = num_q_heads // num_kv_heads
        length = int(context_lens.max()) if max_context is None else int(max_context)
        if batch == 0 or length == 0:
            return torch.zeros_like(query)
        if self._fast(query, k_pool):
            return self._decode_fast(query, k_pool, v_pool, block_tables, context_lens, scale, sliding_window,
                                     length, workspace)
        elem = query.element_size()
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        span = min(length, sliding_window) if sliding_window > 0 else length
        key = ("decode_split", batch, num_q_heads, head_dim, span, elem)
        planned = workspace.get(key) if workspace is not None else None
        if planned is None:
            partition = self._partition(query.device, batch * num_kv_heads, span, reg.tile_tokens(head_dim, elem))
            splits = -(-span // partition)
            part_out = part_lse = None
            if splits > 1:     # scratch shared by every layer of the step (layers run one after another)
                part_out = torch.empty(batch, num_q_heads, splits, head_dim, dtype=torch.float32, device=query.device)
                part_lse = torch.empty(batch, num_q_heads, splits, dtype=torch.float32, device=query.device)
            planned = (partition, splits, part_out, part_lse)
            if workspace is not None:
                workspace[key] = planned
        partition, splits, part_out, part_lse = planned
        out = torch.empty_like(query)
        *pools, head_stride = pool_args
        args = (_ptr(out), _ptr(part_out), _ptr(part_lse), _ptr(query), *pools,
                _ptr(tables), _ptr(lens), head_stride, np.int32(block_size.bit_length() - 1),
                np.int32(tables.shape[1]),
                np.int32(num_kv_heads), np.int32(group), np.int32(sliding_window), np.int32(partition),
                np.float32(scale * np.log2(np.e)))
        smem = reg.attention_smem_bytes(head_dim, elem, group)
        tensors = {"out": (out, elem), "query": (query, elem), **_pool_tensors(k_pool, v_pool),
                   "block_tables": (tables, 4), "context_lens": (lens, 4), "part_out": (part_out, 4),
                   "part_lse": (part_lse, 4)}
        explain = {"grid.y": f"batch rows {batch}: run fewer sequences per forward",
                   "grid.z": f"ceil({span} keys / partition {partition}): raise partition_size"}
        self.launch(reg.decode_kernel(tag, head_dim, fmt_tag), query.device, (num_kv_heads, batch, splits),
                    (reg.THREADS, 1, 1), args, smem, tensors, explain)
        if splits > 1:
            args = (_ptr(out), _ptr(part_out), _ptr(part_lse), np.int32(splits), np.int32(head_dim))
            self.launch(reg.reduce_kernel(tag, head_dim, fmt_tag), query.device, (num_q_heads, batch, 1),
                        (reg.THREADS, 1, 1), args, 0, explain={"grid.y": explain["grid.y"]})
        return out

    def _decode_fast(self, query, k_pool, v_pool, block_tables, context_lens, scale, window, length, workspace):
        """fp16/bf16 decode: CUDA cores for small groups, else the tensor-core kernel with one token per row."""
        batch, num_q_heads, head_dim = query.shape
        group = num_q_heads // k_pool.shape[0]
        span = min(length, window) if window > 0 else length
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        if reg.uses_decode_fast(group, head_dim):
            return cuda_fast.decode_fast(self, query, k_pool, v_pool, tables, lens, scale, window, span,
                                         self._splits_for(query.device, reg.decode_fast_keys(head_dim)), workspace)
        key = ("decode_tokens", batch)             # one token per row: its row and stored index
        tokens = workspace.get(key) if workspace is not None else None
        if tokens is None:
            tokens = (torch.arange(batch, dtype=torch.int32, device=query.device), lens - 1)
            if workspace is not None:
                workspace[key] = tokens
        return self.ragged_attention(query, k_pool, v_pool, tables, *tokens, scale, window, span, workspace,
                                     reuse=f"decode{batch}")

    def extend_attention(self, query: torch.Tensor, k_pool: torch.Tensor | QuantizedPool,
                         v_pool: torch.Tensor | QuantizedPool, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, query_pos: torch.Tensor, scale: float,
                         sliding_window: int = 0, max_context: int | None = None) -> torch.Tensor:
        """query [B, Hq, Q, D], query_pos int32 [B, Q] (-1 = pad) -> out [B, Hq, Q, D]; see torch_backend."""
        batch, num_q_heads, q_len, head_dim = query.shape
        num_kv_heads, _, block_size, _ = k_pool.shape
        query, tag, fmt_tag, pool_args = self._attention_pools(query, k_pool, v_pool)
        group = num_q_heads // num_kv_heads
        length = int(context_lens.max()) if max_context is None else int(max_context)
        if batch == 0 or q_len == 0 or length == 0:
            return torch.zeros_like(query)
        if self._fast(query, k_pool):
            flat = query.transpose(1, 2).reshape(batch * q_len, num_q_heads, head_dim)
            rows = torch.arange(batch, dtype=torch.int32, device=query.device).repeat_interleave(q_len)
            out = self.ragged_attention(flat, k_pool, v_pool, block_tables, rows, query_pos.reshape(-1), scale,
                                        sliding_window, length)
            return out.view(batch, q_len, num_q_heads, head_dim).transpose(1, 2)
        out = torch.empty_like(query)
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        pos = query_pos.to(torch.int32).contiguous()
        q_per_cta = min(q_len, max(1, reg.MAX_ROWS // group))
        *pools, head_stride = pool_args
        args = (_ptr(out), _ptr(query), *pools, _ptr(tables), _ptr(lens), _ptr(pos),
                head_stride, np.int32(block_size.bit_length() - 1), np.int32(tables.shape[1]),
                np.int32(num_kv_heads), np.int32(group), np.int32(q_len),
                np.int32(q_per_cta), np.int32(sliding_window), np.float32(scale * np.log2(np.e)))
        smem = reg.attention_smem_bytes(head_dim, query.element_size(), group * q_per_cta)
        elem = query.element_size()
        tensors = {"out": (out, elem), "query": (query, elem), **_pool_tensors(k_pool, v_pool),
                   "block_tables": (tables, 4), "context_lens": (lens, 4), "query_pos": (pos, 4)}
        explain = {"grid.x": f"{num_kv_heads} KV heads x ceil({q_len} query tokens / {q_per_cta} per CTA)",
                   "grid.y": f"batch rows {batch}: run fewer sequences per forward"}
        self.launch(reg.extend_kernel(tag, head_dim, fmt_tag), query.device,
                    (num_kv_heads * -(-q_len // q_per_cta), batch, 1), (reg.THREADS, 1, 1), args, smem, tensors,
                    explain)
        return out

    def _partition(self, device: torch.device, ctas: int, span: int, tile: int) -> int:
        """Keys per decode split: one split when (kv head, row) CTAs already fill two waves of the
        device's SMs, else enough splits to do so, each a multiple of the tile and at least 256 keys."""
        if self.partition_size is not None:
            return self.partition_size
        want_splits = -(-2 * self.launcher.sm_count(device) // ctas)
        if want_splits <= 1:
            return span
        per_split = -(-span // want_splits)
        return max(-(-per_split // tile) * tile, 256)


class CudaStep(PreparedStep):
    """A forward on the kernels. With fp16/bf16 model-dtype pools every query token of the step — decode
    rows, prefill, the packed engine's mixed steps — goes to one ragged launch per layer (decode steps
    with small groups to the CUDA-core decode); other pools take PreparedStep's padded path. The ragged
    token list is built here, once per forward; the work chunks (which depend on the model's GQA group)
    and split scratch by the first layer, kept in the workspace for the others."""

    def __init__(self, backend, plan):
        super().__init__(backend, plan)
        if isinstance(plan, PackedPlan) or not plan.is_decode:
            self.ragged()

    def _attend(self, query, k_pool, v_pool, scale, window):
        plan = self.plan
        if not self.backend._fast(query, k_pool) or (not isinstance(plan, PackedPlan) and plan.is_decode):
            return super()._attend(query, k_pool, v_pool, scale, window)
        batch, num_heads, q_len, head_dim = query.shape
        tables, rows, pos = self.ragged()
        flat = query[0].transpose(0, 1) if isinstance(plan, PackedPlan) else \
            query.transpose(1, 2).reshape(batch * q_len, num_heads, head_dim)
        span = _max_context(plan)
        out = self.backend.ragged_attention(flat, k_pool, v_pool, tables, rows, pos, scale, window, span,
                                            self.workspace, reuse="step")
        return out.view(batch, q_len, num_heads, head_dim)


def _max_context(plan) -> int:
    if isinstance(plan, PackedPlan):
        return max(p.max_context for p in (plan.decode, plan.extend) if p is not None)
    return plan.max_context


class CupyLauncher:
    """Builds each kernel module with NVRTC (through CuPy) on first use per device, and launches on
    torch's current stream. Compiled modules are kept per device here and on disk by CuPy's cache."""

    def __init__(self):
        self._functions: dict[tuple[int, str], object] = {}
        self._modules: dict[tuple[int, tuple], object] = {}
        self._limits: dict[int, DeviceLimits] = {}
        self._cupy = None

    def sm_count(self, device: torch.device) -> int:
        return self.device_limits(device).sm_count

    def device_limits(self, device: torch.device) -> DeviceLimits:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._limits:
            self._limits[index] = DeviceLimits.for_device(index)
        return self._limits[index]

    def prepare(self, spec: reg.KernelSpec, device: torch.device):
        """The compiled kernel function (building its module on first use on this device)."""
        cupy = self._import_cupy()
        index = device.index if device.index is not None else torch.cuda.current_device()
        function = self._functions.get((index, spec.name))
        if function is None:
            with cupy.cuda.Device(index):
                function = self._module(cupy, index, spec).get_function(spec.name)
            self._functions[(index, spec.name)] = function
        return function

    def launch(self, spec: reg.KernelSpec, device: torch.device, grid, block, args, shared_mem: int) -> None:
        function = self.prepare(spec, device)
        cupy = self._cupy
        index = device.index if device.index is not None else torch.cuda.current_device()
        with cupy.cuda.Device(index):
            if shared_mem > _DEFAULT_SMEM_LIMIT and function.max_dynamic_shared_size_bytes < shared_mem:
                function.max_dynamic_shared_size_bytes = shared_mem
            stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(index).cuda_stream)
            function(tuple(grid), tuple(block), args, shared_mem=shared_mem, stream=stream)

    def _module(self, cupy, index: int, spec: reg.KernelSpec):
        key = (index, spec.module)
        if key not in self._modules:
            includes = cuda_include_dirs(cupy_cuda_major(cupy))
            options = (*spec.defines, *(f"-I{d}" for d in includes))  # NVRTC 12+: C++17 by default
            module = cupy.RawModule(code=reg.kernel_source(spec.source), options=options, backend="nvrtc")
            module.compile()
            self._modules[key] = module
        return self._modules[key]

    def _import_cupy(self):
        if self._cupy is None:
            self._cupy = import_cupy()
        return self._cupy


def make_backend() -> KernelBackend:
    """A backend for CUDA tensors. Each PagedCache makes its own (no module-global state); compiled
    kernels are loaded from CuPy's disk cache after the first build."""
    return KernelBackend(CupyLauncher())
