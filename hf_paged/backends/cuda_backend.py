"""CUDA backend: the backend protocol (``hf_paged.backends.step``) as launches of the kernels in ``hf_paged/cuda``.

Same semantics and pool layout as :mod:`hf_paged.backends.torch_backend`, whose padded-signature
functions it mirrors (``decode_attention``, ``extend_attention``) beside the ragged one
(``ragged_attention``). The host side (shape checks, argument packing in ``cuda_args``, split-K planning
in ``splits``) lives in :class:`CudaBackend`, which launches through a *launcher*: ``cupy_launcher.CupyLauncher``
on a GPU, or the CPU shim in ``tests/backends`` (same kernels, same arguments).

Pools are model-dtype tensors or :class:`~hf_paged.kv_formats.QuantizedPool` (codes + bf16 scales): then
write_kv quantises from the keys' dtype, and the attention kernels dequantise into the query's dtype.
fp16/bf16 model-dtype pools go to ``fast_attention.cu`` (``cuda_fast``), and so do quantised pools with
fp16/bf16 queries: decodes with GQA groups up to 4 (its quantised decode) and every extend (its quantised
tensor-core kernel); the rest to ``attention.cu``.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from ..kv_formats import QuantizedPool
from ..plan import StepPlan
from . import cuda_fast
from . import kernel_registry as reg
from .cuda_args import check_pools, check_quantized_pools, copy_word, pool_tensors, ptr
from .launch_checks import check_launch, check_tensors
from .splits import SplitPlan, plan_splits, split_scratch
from .step import Step, Workspace

logger = logging.getLogger(__name__)


class CudaBackend:
    """write_kv / copy_blocks / prepare, and the kernel-level attention functions, over a kernel launcher.

    launcher: object with ``launch(spec, device, grid, block, args, shared_mem)`` (args: numpy
    scalars; pointers as ``numpy.uint64``), ``sm_count(device)`` and ``device_limits(device)``.
    partition_size: keys per split-K split; ``None`` plans them per call so that the grid fills the
    device (``splits.plan_splits``).
    fast_kernels: fp16/bf16 model-dtype pools on fast_attention.cu, and decode and extend over quantised
    pools on its quantised kernels (the default); False keeps them on attention.cu (the kernels the quantised formats
    share their compute with, for comparisons).
    One backend serves a device for the whole process (``backends.backend_for``), so the kernel modules
    load and the fast kernels' first-use check runs once per (device, dtype, head dim).
    """

    # Device types on which the fast kernels are checked against PyTorch on first use (cuda_fast.self_check):
    # the GPU's PTX paths; the CPU shim's emulation is what the test-suite proves.
    self_check_devices = ("cuda",)

    def __init__(self, launcher, partition_size: int | None = None, fast_kernels: bool = True):
        self.launcher = launcher
        self.partition_size = partition_size
        self.fast_kernels = fast_kernels
        self.checked: dict[tuple, bool] = {}   # (device, dtype, head_dim[, format]) -> the kernels agreed

    def uses_fast_kernels(self, query: torch.Tensor, k_pool) -> bool:
        """Whether fast_attention.cu serves this call: eligible pools, and on a GPU a passed self-check."""
        if not (self.fast_kernels and cuda_fast.eligible(query, k_pool)):
            return False
        device, head_dim = k_pool.device, k_pool.shape[-1]
        return self._first_use((device, k_pool.dtype, head_dim),
                               "the sm_80+ kernels (cuda/fast_attention.cu) disagree with the PyTorch reference",
                               lambda: cuda_fast.self_check(self, device, k_pool.dtype, head_dim))

    def uses_fast_quantised(self, query: torch.Tensor, k_pool) -> bool:
        """Whether the quantised fast decode (cuda/fast_quant.cuh) serves a decode over these pools
        (``cuda_fast.eligible_quantised``), on a GPU after a passed self-check per (dtype, head dim, format)."""
        if not (self.fast_kernels and cuda_fast.eligible_quantised(query, k_pool)):
            return False
        device, head_dim, fmt = k_pool.device, k_pool.shape[-1], k_pool.fmt
        return self._first_use((device, query.dtype, head_dim, fmt.name),
                               f"the quantised fast decode (cuda/fast_quant.cuh, {fmt.name}) disagrees with "
                               "attention.cu's",
                               lambda: cuda_fast.self_check_quantised(self, device, query.dtype, head_dim, fmt))

    def uses_fast_quantised_extend(self, query: torch.Tensor, k_pool) -> bool:
        """Whether the quantised tensor-core extend (cuda/fast_quant_extend.cuh) serves an extend over these
        pools (``cuda_fast.eligible_quantised_extend``), on a GPU after a passed self-check per (dtype, head
        dim, format) against attention.cu's quantised extend."""
        if not (self.fast_kernels and cuda_fast.eligible_quantised_extend(query, k_pool)):
            return False
        device, head_dim, fmt = k_pool.device, k_pool.shape[-1], k_pool.fmt
        return self._first_use((device, query.dtype, head_dim, fmt.name, "extend"),
                               f"the quantised tensor-core extend (cuda/fast_quant_extend.cuh, {fmt.name}) "
                               "disagrees with attention.cu's",
                               lambda: cuda_fast.self_check_quantised_extend(self, device, query.dtype, head_dim, fmt))

    def _first_use(self, key: tuple, what: str, check) -> bool:
        """``check()`` (None, or what disagreed) once per key on the self-check devices; a disagreement is
        logged and the key stays on attention.cu for the process (``self.checked``)."""
        if key[0].type not in self.self_check_devices:
            return True
        if key not in self.checked:
            self.checked[key] = True          # the check itself runs the fast kernels
            try:
                problem = check()
            except (RuntimeError, ValueError) as exc:   # e.g. a compiler the kernels do not build with
                problem = f"{type(exc).__name__}: {exc}"
            if problem is not None:
                logger.error("hf_paged: %s on %s: %s. Using attention.cu's kernels instead; please report this "
                             "with the GPU's name.", what, key[0], problem)
                self.checked[key] = False
        return self.checked[key]

    def launch(self, spec: reg.KernelSpec, device: torch.device, grid, block, args, shared_mem: int,
               tensors: dict | None = None, explain: dict | None = None) -> None:
        """Every launch goes through here: tensors on ``device`` and aligned as the kernel reads them
        (``tensors``: name -> (tensor or None, bytes)), grid, block and shared memory within the device's
        limits (``explain``: where a quantity comes from and its knob, for the error), then the launcher."""
        check_tensors(spec.name, device, tensors or {})
        check_launch(spec.name, grid, block, shared_mem, self.launcher.device_limits(device), explain)
        self.launcher.launch(spec, device, grid, block, args, shared_mem)

    def plan_splits(self, device: torch.device, ctas: int, span: int, tile: int) -> SplitPlan:
        """Split-K for ``ctas`` CTAs over ``span`` keys in tiles of ``tile`` keys (``splits.plan_splits``)."""
        return plan_splits(self.launcher.sm_count(device), ctas, span, tile, self.partition_size)

    # -- cache writes -------------------------------------------------------------------------
    def write_kv(self, k_pool: torch.Tensor | QuantizedPool, v_pool: torch.Tensor | QuantizedPool,
                 key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, writes_all: bool = False) -> None:
        """key, value: [N, Hkv, D] (any strides); slot_mapping: int64 [N], -1 = skip (the kernels skip -1
        themselves, so ``writes_all`` changes nothing here)."""
        slots = slot_mapping.reshape(-1).to(torch.int64).contiguous()
        n = slots.numel()
        if n == 0:
            return
        if isinstance(k_pool, QuantizedPool):
            self._write_quantized(k_pool, v_pool, key, value, slots)
            return
        check_pools(k_pool, v_pool)
        tag = reg.dtype_tag(k_pool.dtype)
        num_kv_heads, head_dim = k_pool.shape[0], k_pool.shape[3]
        key, value = (x.to(k_pool.dtype) for x in (key, value))
        key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (key, value))
        args = (ptr(k_pool), ptr(v_pool), ptr(key), ptr(value), ptr(slots), np.int64(k_pool.stride(0)),
                np.int32(num_kv_heads), np.int32(head_dim),
                np.int64(key.stride(0)), np.int64(key.stride(1)),
                np.int64(value.stride(0)), np.int64(value.stride(1)))
        self.launch(reg.write_kv_kernel(tag), k_pool.device, (n, 1, 1), (reg.THREADS, 1, 1), args, 0,
                    {"k_pool": (k_pool, 16), "v_pool": (v_pool, 16), "key": (key, key.element_size()),
                     "value": (value, value.element_size()), "slot_mapping": (slots, 8)})

    def _write_quantized(self, k_pool: QuantizedPool, v_pool: QuantizedPool, key: torch.Tensor,
                         value: torch.Tensor, slots: torch.Tensor) -> None:
        """Quantise on write, from the keys' own dtype (the scales see the values the model made)."""
        fmt_tag = check_quantized_pools(k_pool, v_pool)
        num_kv_heads, num_blocks, block_size, head_dim = k_pool.shape
        if key.shape[1:] != (num_kv_heads, head_dim) or value.shape != key.shape:
            raise ValueError(f"write_kv: key {tuple(key.shape)} and value {tuple(value.shape)} must be "
                             f"[N, {num_kv_heads}, {head_dim}] for these pools")
        tag = reg.dtype_tag(key.dtype)
        value = value.to(key.dtype)
        key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (key, value))
        args = (ptr(k_pool.data), ptr(k_pool.scales), ptr(v_pool.data), ptr(v_pool.scales), ptr(key),
                ptr(value), ptr(slots), np.int64(num_blocks * block_size), np.int32(num_kv_heads),
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
        word = copy_word(tile_bytes, pools)
        table = torch.tensor([p.data_ptr() for p in pools], dtype=torch.int64).to(pairs.device, non_blocking=True)
        args = (ptr(table), ptr(pairs), np.int32(shape[0]), np.int64(shape[1] * tile_bytes // word),
                np.int64(tile_bytes // word))
        self.launch(reg.COPY_BLOCKS_BY_WORD[word], pairs.device, (pairs.shape[0], len(pools), 1),
                    (reg.THREADS, 1, 1), args, 0, {f"pool {i}": (p, word) for i, p in enumerate(pools)},
                    {"grid.x": f"{pairs.shape[0]} block copies", "grid.y": f"{len(pools)} pools"})

    # -- attention ----------------------------------------------------------------------------
    def prepare(self, plan: StepPlan, peers: dict | None = None) -> CudaStep:
        """Bind one forward's plan (its tables are already int32 on the device). What every layer shares —
        work chunks, split scratch — is computed by the first layer on the device (no host sync) and kept
        in the step's workspace; later layers only launch."""
        return CudaStep(self, plan, peers)

    def ragged_attention(self, query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         block_tables: torch.Tensor, token_row: torch.Tensor, token_pos: torch.Tensor,
                         scale: float, sliding_window: int = 0, span: int | None = None,
                         workspace: Workspace | None = None) -> torch.Tensor:
        """query [T, Hq, D] for fp16/bf16 model-dtype pools, or fp16/bf16 queries over quantised pools ->
        out [T, Hq, D]: every query token with its block-table row and stored index (int32 [T], -1 = pad),
        tokens of a row consecutive. ``span``: a bound on the keys any token sees (default: the table's
        width in tokens). ``workspace``: the step's, when the token list is its plan's (the work chunks
        are then built once per step)."""
        quantised = isinstance(k_pool, QuantizedPool)
        if quantised:
            check_quantized_pools(k_pool, v_pool)
        else:
            check_pools(k_pool, v_pool)
        group = query.shape[1] // k_pool.shape[0]
        block_size = k_pool.shape[2]
        tables = block_tables.to(torch.int32).contiguous()
        rows = token_row.to(torch.int32).contiguous()
        pos = token_pos.to(torch.int32).contiguous()
        per_chunk = cuda_fast.tokens_per_chunk(group)
        chunks = workspace.chunks.get(per_chunk) if workspace is not None else None
        if chunks is None:
            chunks = cuda_fast.ragged_chunks(rows, per_chunk, tables.shape[0])
            if workspace is not None:
                workspace.chunks[per_chunk] = chunks
        span = tables.shape[1] * block_size if span is None else span
        if sliding_window > 0:
            span = min(span, sliding_window + reg.RAGGED_ROWS)   # a chunk's tokens span < 64 positions
        run = cuda_fast.ragged_attention_quantised if quantised else cuda_fast.ragged_attention
        return run(self, query, k_pool, v_pool, tables, rows, pos, chunks, scale, sliding_window, max(span, 1),
                   workspace)

    def _attention_pools(self, query: torch.Tensor, k_pool, v_pool) -> tuple:
        """(query in the kernels' dtype, dtype tag, format tag ("" unquantised), pool arguments) after
        the checks. Model-dtype pools: the query is cast to the pools' dtype; quantised pools are
        dequantised into the query's dtype. Pool arguments: the pointers, then elements (model dtype)
        or tokens (quantised) per KV head."""
        num_q_heads, head_dim = query.shape[1], query.shape[-1]
        num_kv_heads, num_blocks, block_size, _ = k_pool.shape
        if isinstance(k_pool, QuantizedPool):
            fmt_tag = check_quantized_pools(k_pool, v_pool)
            tag = reg.check_attention_shape(query.dtype, head_dim, block_size, num_q_heads, num_kv_heads,
                                            k_pool.fmt)
            args = (ptr(k_pool.data), ptr(k_pool.scales), ptr(v_pool.data), ptr(v_pool.scales),
                    np.int64(num_blocks * block_size))
            return query.contiguous(), tag, fmt_tag, args
        check_pools(k_pool, v_pool)
        tag = reg.check_attention_shape(k_pool.dtype, head_dim, block_size, num_q_heads, num_kv_heads)
        return query.to(k_pool.dtype).contiguous(), tag, "", (ptr(k_pool), ptr(v_pool), np.int64(k_pool.stride(0)))

    def decode_attention(self, query: torch.Tensor, k_pool: torch.Tensor | QuantizedPool,
                         v_pool: torch.Tensor | QuantizedPool, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, scale: float, sliding_window: int = 0,
                         max_context: int | None = None, workspace: Workspace | None = None) -> torch.Tensor:
        """query [B, Hq, D] -> out [B, Hq, D]; see torch_backend.decode_attention."""
        batch, num_q_heads, head_dim = query.shape
        num_kv_heads, _, block_size, _ = k_pool.shape
        query, tag, fmt_tag, pool_args = self._attention_pools(query, k_pool, v_pool)
        length = int(context_lens.max()) if max_context is None else int(max_context)
        if batch == 0 or length == 0:
            return torch.zeros_like(query)
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        span = min(length, sliding_window) if sliding_window > 0 else length
        if self.uses_fast_kernels(query, k_pool):
            return self._decode_fast(query, k_pool, v_pool, tables, lens, scale, sliding_window, span, workspace)
        if self.uses_fast_quantised(query, k_pool):
            return cuda_fast.decode_fast_quantised(self, query, k_pool, v_pool, tables, lens, scale, sliding_window,
                                                   span, workspace)
        elem = query.element_size()
        group = num_q_heads // num_kv_heads
        split = self.plan_splits(query.device, batch * num_kv_heads, span, reg.tile_tokens(head_dim, elem))
        part_out, part_lse = split_scratch(workspace.splits if workspace is not None else None,
                                           ("decode", batch, num_q_heads, head_dim, split.splits),
                                           batch * num_q_heads, split.splits, head_dim, query.device)
        out = torch.empty_like(query)
        *pools, head_stride = pool_args
        args = (ptr(out), ptr(part_out), ptr(part_lse), ptr(query), *pools,
                ptr(tables), ptr(lens), head_stride, np.int32(block_size.bit_length() - 1),
                np.int32(tables.shape[1]),
                np.int32(num_kv_heads), np.int32(group), np.int32(sliding_window), np.int32(split.partition),
                np.float32(scale * np.log2(np.e)))
        smem = reg.attention_smem_bytes(head_dim, elem, group)
        tensors = {"out": (out, elem), "query": (query, elem), **pool_tensors(k_pool, v_pool),
                   "block_tables": (tables, 4), "context_lens": (lens, 4), "part_out": (part_out, 4),
                   "part_lse": (part_lse, 4)}
        explain = {"grid.y": f"batch rows {batch}: run fewer sequences per forward",
                   "grid.z": f"ceil({span} keys / partition {split.partition}): raise partition_size"}
        self.launch(reg.decode_kernel(tag, head_dim, fmt_tag), query.device, (num_kv_heads, batch, split.splits),
                    (reg.THREADS, 1, 1), args, smem, tensors, explain)
        if split.splits > 1:
            args = (ptr(out), ptr(part_out), ptr(part_lse), np.int32(split.splits), np.int32(head_dim))
            self.launch(reg.reduce_kernel(tag, head_dim, fmt_tag), query.device, (num_q_heads, batch, 1),
                        (reg.THREADS, 1, 1), args, 0, explain={"grid.y": explain["grid.y"]})
        return out

    def _decode_fast(self, query, k_pool, v_pool, tables, lens, scale, window, span, workspace):
        """fp16/bf16 decode: CUDA cores for small groups, else the tensor-core kernel with one token per row."""
        batch, num_q_heads, head_dim = query.shape
        group = num_q_heads // k_pool.shape[0]
        if reg.uses_decode_fast(group, head_dim):
            return cuda_fast.decode_fast(self, query, k_pool, v_pool, tables, lens, scale, window, span, workspace)
        rows = torch.arange(batch, dtype=torch.int32, device=query.device)
        return self.ragged_attention(query, k_pool, v_pool, tables, rows, lens - 1, scale, window, span)

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
        if self.uses_fast_kernels(query, k_pool) or self.uses_fast_quantised_extend(query, k_pool):
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
        args = (ptr(out), ptr(query), *pools, ptr(tables), ptr(lens), ptr(pos),
                head_stride, np.int32(block_size.bit_length() - 1), np.int32(tables.shape[1]),
                np.int32(num_kv_heads), np.int32(group), np.int32(q_len),
                np.int32(q_per_cta), np.int32(sliding_window), np.float32(scale * np.log2(np.e)))
        smem = reg.attention_smem_bytes(head_dim, query.element_size(), group * q_per_cta)
        elem = query.element_size()
        tensors = {"out": (out, elem), "query": (query, elem), **pool_tensors(k_pool, v_pool),
                   "block_tables": (tables, 4), "context_lens": (lens, 4), "query_pos": (pos, 4)}
        explain = {"grid.x": f"{num_kv_heads} KV heads x ceil({q_len} query tokens / {q_per_cta} per CTA)",
                   "grid.y": f"batch rows {batch}: run fewer sequences per forward"}
        self.launch(reg.extend_kernel(tag, head_dim, fmt_tag), query.device,
                    (num_kv_heads * -(-q_len // q_per_cta), batch, 1), (reg.THREADS, 1, 1), args, smem, tensors,
                    explain)
        return out



class CudaStep(Step):
    """A forward on the kernels. With fp16/bf16 model-dtype pools every query token of the step — decode
    rows, prefill, the packed engine's mixed steps — goes to one ragged launch per layer, straight from
    the plan's token list (decode-only steps with small GQA groups to the CUDA-core decode); other pools
    take the padded path of :class:`Step`. Work chunks (which depend on the model's GQA group) and split
    scratch are built by the first layer and kept in the workspace for the others."""

    def _attend(self, query, k_pool, v_pool, scale, window):
        backend, plan = self.backend, self.plan
        if not backend.uses_fast_kernels(query, k_pool):
            return super()._attend(query, k_pool, v_pool, scale, window)
        group = query.shape[1] // k_pool.shape[0]
        if plan.is_decode and reg.uses_decode_fast(group, query.shape[-1]):
            return backend.decode_attention(query, k_pool, v_pool, plan.block_tables, plan.decode_lens, scale, window,
                                            plan.decode_context, self.workspace)
        return backend.ragged_attention(query, k_pool, v_pool, plan.block_tables, plan.token_row, plan.token_pos,
                                        scale, window, plan.max_context, self.workspace)


def make_backend() -> CudaBackend:
    """A backend for CUDA tensors over CuPy (``backends.backend_for`` keeps one per device and process)."""
    from .cupy_launcher import CupyLauncher  # noqa: PLC0415  (cupy only when a CUDA kernel first runs)
    return CudaBackend(CupyLauncher())
