"""CPU kernel backend: attention that reads K/V in place through the block tables.

``cuda/paged_attention_cpu.cpp`` is compiled on first use through torch's extension loader for this
CPU (``-O3 -march=native``, or ``HF_PAGED_CPU_ARCH``'s value: ``march``; the build is cached under
``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``, keyed by the source, the flags, torch's
version and the CPU's features) and registered as ``torch.ops.hf_paged_cpu.paged_attention`` (with a fake
implementation, so that ``torch.compile`` traces through it without a graph break). It replaces the PyTorch
path's per-layer gather of every row's whole context: one ragged call per layer serves decode, prefill and
packed steps.
Quantised pools (``kv_cache_dtype``: int8, fp8_e4m3, fp8_e5m2, int4, nvfp4 and KIVI's sealed blocks and side rows)
go to ``torch.ops.hf_paged_cpu.paged_attention_quant`` (``paged_attention_cpu_quant.cpp``), which reads codes
and scales in place and dequantises each stored row once per work item (``kv_codec_cpu.h``, AVX-512 / AVX2 /
scalar as the build's ``-march`` allows); their writes go to ``write_kv_quant`` (``kv_write_cpu.cpp``:
rotation and quantisation fused, one pass per row); KIVI pools' to ``kivi_write`` (``kivi_write_cpu.cpp``: rows into
open slots and sealing, which ``hf_paged.kivi`` plans and calls); model-dtype pools' to ``write_kv`` (the same
file: one copy per layer, -1 slots skipped without reading a mask back). Copy-on-write stays on
:mod:`torch_backend` (same pool layout).

``HF_PAGED_CPU_KERNEL=0`` keeps the PyTorch path; when the build fails (no compiler), ``select_backend``
logs why and falls back to it. The build itself: ``cpp_build``.
"""
from __future__ import annotations

import logging

import torch

from ..kivi import KiviPool, one_call_args
from ..kv_formats import QuantizedPool
from ..plan import StepPlan
from . import torch_backend
from .cpp_build import build_extension
from .step import Step

log = logging.getLogger("hf_paged.backends")
SOURCE = "paged_attention_cpu.cpp"
SOURCES = (SOURCE, "paged_attention_cpu_bf16.cpp", "paged_attention_cpu_quant.cpp", "kv_write_cpu.cpp",
           "kivi_write_cpu.cpp")  # one extension
# part of the build's cache key
HEADERS = ("paged_attention_cpu.h", "paged_attention_cpu_util.h", "paged_attention_cpu_tile.h",
           "paged_attention_cpu_simd.h", "kv_codec_cpu.h", "kv_encode_cpu.h")
# kv_formats / kivi format -> the op's k_format / v_format (kv_codec_cpu.h's enum Format).
FORMAT_IDS = {"int8": 0, "fp8_e4m3": 1, "fp8_e5m2": 2, "int4": 3, "nvfp4": 5}
KIVI_KEY_ID, KIVI_VALUE_ID = 4, 3     # KIVI values: asymmetric 4-bit groups along head_dim, int4's row layout


def _registered():
    """The op when this process has loaded a build with all its ops, else None."""
    try:
        torch.ops.hf_paged_cpu.paged_attention_quant  # noqa: B018  (each raises when absent)
        torch.ops.hf_paged_cpu.write_kv_quant  # noqa: B018
        torch.ops.hf_paged_cpu.kivi_write  # noqa: B018
        torch.ops.hf_paged_cpu.kivi_write_kv  # noqa: B018
        torch.ops.hf_paged_cpu.write_kv  # noqa: B018
        return torch.ops.hf_paged_cpu.paged_attention
    except (AttributeError, RuntimeError):
        return None


def load_kernel():
    """``torch.ops.hf_paged_cpu.paged_attention``, building and loading the extension if this process has
    not yet. Raises RuntimeError with the compiler's complaint when it cannot be built."""
    op = _registered()
    if op is not None:
        return op
    build_extension("hf_paged_cpu_", SOURCES, HEADERS)
    op = _registered()
    if op is None:
        raise RuntimeError("the CPU kernel loaded but registered no torch.ops.hf_paged_cpu.paged_attention(_quant)")
    # Shape propagation for torch.compile: each op is one opaque node in a traced graph (no graph break).
    for qualname, fake in (("hf_paged_cpu::paged_attention", _fake_paged_attention),
                           ("hf_paged_cpu::paged_attention_quant", _fake_paged_attention_quant),
                           ("hf_paged_cpu::write_kv_quant", _fake_write_kv_quant),
                           ("hf_paged_cpu::kivi_write", _fake_write_kv_quant),
                           ("hf_paged_cpu::kivi_write_kv", _fake_kivi_write_kv),
                           ("hf_paged_cpu::write_kv", _fake_write_kv_quant)):
        try:
            torch.library.register_fake(qualname)(fake)
        except RuntimeError:        # another thread loading at the same time registered it first
            pass
    return op


def _fake_paged_attention(query, k_pool, v_pool, block_tables, token_row, token_pos, scale, window):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def _fake_paged_attention_quant(query, *args, **kwargs):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def _fake_write_kv_quant(*args, **kwargs):        # (and kivi_write, write_kv) writes its pool arguments in place
    return None


def _fake_kivi_write_kv(key, value, rotation, src, dst, seal_blocks, *args):
    k_open, v_open = args[7], args[11]                # the fresh rows: [H, sealed, BS, D] per pool
    return tuple(o.new_empty((o.shape[0], seal_blocks.shape[0], *o.shape[2:])) for o in (k_open, v_open))


def _side(pool: QuantizedPool, dtype: torch.dtype):
    """(codes, scales, format id, KIVI side tensors) of one pool for the quantised op; None when the op cannot
    read it (a format it does not know, KIVI side rows in another dtype than the query's)."""
    if isinstance(pool, KiviPool):
        if pool.open.rows.dtype != dtype:
            return None
        fmt = KIVI_KEY_ID if pool.is_key else KIVI_VALUE_ID
        return pool.data, pool.scales, fmt, kivi_side(pool)
    fmt = FORMAT_IDS.get(pool.fmt.name)
    return None if fmt is None else (pool.data, pool.scales, fmt, [])


def kivi_side(pool: KiviPool) -> list[torch.Tensor]:
    """The op's k_kivi / v_kivi: [open, open_slot, fresh, fresh_slot, sink, sink_slot] (paged_attention_cpu_quant.cpp)."""
    stores = (pool.open, pool.fresh, pool.sink)
    return [t for store in stores for t in (store.rows.contiguous(), store.block_slot)]


def quantised_args(k_pool, v_pool, dtype: torch.dtype):
    """The quantised op's pool arguments (k_codes, k_scales, v_codes, v_scales, k_format, v_format, k_kivi,
    v_kivi), or None to leave these pools to the PyTorch path."""
    k, v = _side(k_pool, dtype), _side(v_pool, dtype)
    if k is None or v is None or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    return k[0], k[1], v[0], v[1], k[2], v[2], k[3], v[3]


def kernel_call(backend, query, k_pool, v_pool, rotation=None, rotate_query=True):
    """``call(query, block_tables, token_row, token_pos, scale, window)`` running the kernel that reads these
    pools (model-dtype or quantised), or None for the PyTorch path (mixed dtypes, a format it does not read).
    ``rotation``: R, for a query not yet rotated (the kernel rotates it and unrotates the output; with
    ``rotate_query`` False it only unrotates the output: KIVI, whose keys are stored unrotated)."""
    if isinstance(k_pool, QuantizedPool):
        args = quantised_args(k_pool, v_pool, query.dtype)
        if args is None:
            return None
        codes, rest = args[:4], (*args[4:], rotation, rotate_query)
        return lambda q, tables, rows, pos, scale, window: backend.quant_op(q, *codes, tables, rows, pos, scale,
                                                                            window, *rest)
    if query.dtype != k_pool.dtype:
        return None
    return lambda q, tables, rows, pos, scale, window: backend.op(q, k_pool, v_pool, tables, rows, pos, scale,
                                                                  window)


class CpuStep(Step):
    """One forward on the CPU kernel: one call per layer for every query token of the step, read
    straight from the plan's ragged token list (rows and stored indices). Quantised pools arrive with the
    query already rotated (``Step.attend``), as the PyTorch path gets them."""

    def attend(self, query, k_pool, v_pool, scale, window):
        """As Step.attend; rotated quantised pools (one R for keys and values) have the kernel rotate each
        query row on entry and each output row on exit, instead of two matmuls around the call; KIVI's (values
        rotated, keys not) have it unrotate the output only."""
        k_rotation, rotation = getattr(k_pool, "rotation", None), getattr(v_pool, "rotation", None)
        if rotation is not None and (k_rotation is None or k_rotation is rotation) and query.device == self.device:
            call = kernel_call(self.backend, query, k_pool, v_pool, rotation, rotate_query=k_rotation is not None)
            if call is not None:
                plan = self.plan
                return call(query.contiguous(), plan.block_tables, plan.token_row, plan.token_pos, float(scale),
                            int(window))
        return super().attend(query, k_pool, v_pool, scale, window)

    def write_direct(self, key, value, k_pool, v_pool) -> None:
        """[N, Hkv, D] keys and values (rows of any stride, contiguous heads) into model-dtype pools of their
        dtype, contiguous, on the CPU (``KVPools.direct`` checked it): ``write_kv``'s C++ call, as
        ``CpuKernelBackend.write_kv`` makes it for such pools."""
        self.backend.plain_write_op(key, value, self.slot_mapping, k_pool, v_pool)

    def attend_direct(self, query, k_pool, v_pool, scale: float, window: int) -> torch.Tensor:
        """contiguous query [N, Hq, D] against model-dtype pools of its dtype: the kernel's call, as ``_attend``
        makes it for such pools."""
        plan = self.plan
        return self.backend.op(query, k_pool, v_pool, plan.block_tables, plan.token_row, plan.token_pos, scale, window)

    @property
    def direct_metadata(self):
        """(slot_mapping, block_tables, token_row, token_pos) as ``write_direct`` and ``attend_direct`` pass them,
        for a caller that makes those two C++ calls itself (``fused_lean``'s one-call layer); None where this
        step's backend calls other ops than the extension's own (a wrapped op must see its calls). Made once per
        step (every layer asks)."""
        if self._metadata is None:
            backend, plan = self.backend, self.plan
            own = (backend.op is torch.ops.hf_paged_cpu.paged_attention
                   and backend.plain_write_op is torch.ops.hf_paged_cpu.write_kv)
            self._metadata = (self.slot_mapping, plan.block_tables, plan.token_row, plan.token_pos) if own else ()
        return self._metadata or None

    _metadata: tuple | None = None

    def quant_metadata(self, k_pool, v_pool) -> tuple | None:
        """(k_codes, k_scales, v_codes, v_scales, k_format, v_format, rotation) then ``direct_metadata``'s four: what
        ``CpuKernelBackend.write_kv`` and ``attend`` pass ``write_kv_quant`` and ``paged_attention_quant`` for these
        quantised pools (R: the one both pools store x R of; the op rotates the query and unrotates the output),
        for a caller that makes those calls itself (``fused_lean``'s one-call layer). None where the Python calls
        go elsewhere: KIVI pools (its write plan), a format the ops do not know, keys and values under different
        rotations, pools off this step's device, or ops other than the extension's own (a wrapped op)."""
        if (isinstance(k_pool, KiviPool) or isinstance(v_pool, KiviPool) or not isinstance(k_pool, QuantizedPool)
                or not isinstance(v_pool, QuantizedPool) or k_pool.rotation is not v_pool.rotation
                or k_pool.device != self.device or self.device.type != "cpu"):
            return None
        ids = (FORMAT_IDS.get(k_pool.fmt.name), FORMAT_IDS.get(v_pool.fmt.name))
        backend = self.backend
        if None in ids or backend.quant_op is not torch.ops.hf_paged_cpu.paged_attention_quant \
                or backend.write_op is not torch.ops.hf_paged_cpu.write_kv_quant:
            return None
        plan = self.plan
        return (k_pool.data, k_pool.scales, v_pool.data, v_pool.scales, *ids, v_pool.rotation, self.slot_mapping,
                plan.block_tables, plan.token_row, plan.token_pos)

    def kivi_metadata(self, k_pool, v_pool, plan, dtype: torch.dtype) -> tuple | None:
        """What ``fused_lean``'s one-call KIVI layer (``lean_layer_kivi``) takes after cos and sin, for a layer whose
        write follows ``plan`` (``KVPools.kivi_write_plan``) with states in ``dtype``: R, the keys' and values' format
        ids, the write's index tensors, each pool's (open, sink, codes, scales) and (open_slot, fresh_slot,
        sink_slot), then the block tables, token rows and positions. The plan is applied to the shared entries here
        (``kivi.one_call_args``). None where the Python calls go elsewhere: a plan that drops tokens or reopens a
        block, values not rotated, pools off this step's device, ops other than the extension's own."""
        backend = self.backend
        if (plan.keep is not None or v_pool.rotation is None or k_pool.device != self.device
                or self.device.type != "cpu"
                or backend.quant_op is not torch.ops.hf_paged_cpu.paged_attention_quant
                or getattr(backend, "kivi_write_kv", None) is not torch.ops.hf_paged_cpu.kivi_write_kv):
            return None
        args = one_call_args(k_pool, v_pool, plan, dtype)
        if args is None or not (k_pool.open.rows.is_contiguous() and v_pool.open.rows.is_contiguous()):
            return None
        rotation, indices, k_stores, v_stores = args
        maps = ([p.open.block_slot, p.fresh.block_slot, p.sink.block_slot] for p in (k_pool, v_pool))
        step = self.plan
        return (rotation, KIVI_KEY_ID, KIVI_VALUE_ID, indices, k_stores, v_stores, *maps, step.block_tables,
                step.token_row, step.token_pos)

    @property
    def slot_mapping(self) -> torch.Tensor:
        """The plan's slots, contiguous (made once per step)."""
        if self._slots is None:
            self._slots = self.plan.slot_mapping.contiguous()
        return self._slots

    _slots: torch.Tensor | None = None

    def _attend(self, query, k_pool, v_pool, scale, window):
        call = kernel_call(self.backend, query, k_pool, v_pool)
        if call is None:
            return super()._attend(query, k_pool, v_pool, scale, window)
        plan = self.plan
        return call(query.contiguous(), plan.block_tables, plan.token_row, plan.token_pos, float(scale), int(window))


class CpuKernelBackend:
    """The backend protocol (``hf_paged.backends.step``) with attention and writes through the compiled
    kernels; copies are ``torch_backend``'s. ``decode_attention`` / ``extend_attention``: the kernel
    over torch_backend's padded signatures (quantised pools: in the rotated space, as quantized_torch's).
    ``op`` / ``quant_op``: the loaded ``torch.ops.hf_paged_cpu.paged_attention`` and ``paged_attention_quant``
    (see :func:`load_kernel`)."""

    copy_blocks = staticmethod(torch_backend.copy_blocks)
    # write_kv takes quantised pools' states unrotated and rotates them itself (hf_paged.cache.pools reads this).
    rotates_on_write = True

    def __init__(self, op):
        self.op = op
        self.quant_op = torch.ops.hf_paged_cpu.paged_attention_quant
        self.write_op = torch.ops.hf_paged_cpu.write_kv_quant
        self.plain_write_op = torch.ops.hf_paged_cpu.write_kv       # model-dtype pools (kv_write_cpu.cpp)
        # KIVI pools' writes and sealing (hf_paged.kivi calls them; kivi_write_cpu.cpp): per pool, and a layer's
        # keys and values in one call (values rotated by the op); rotate_rows rotates values as that op does.
        self.kivi_write = torch.ops.hf_paged_cpu.kivi_write
        self.kivi_write_kv = torch.ops.hf_paged_cpu.kivi_write_kv
        self.rotate_rows = torch.ops.hf_paged_cpu.rotate_rows

    def write_kv(self, k_pool, v_pool, key, value, slot_mapping, writes_all: bool = False):
        """As torch_backend.write_kv, but quantised pools get unrotated states: row formats are rotated and
        quantised in one C++ pass (every row format: FORMAT_IDS); another quantised pool would be rotated here and
        handed to torch_backend.
        (KIVI pools never come here: ``KVPools.write`` hands them to ``hf_paged.kivi``.)"""
        if isinstance(k_pool, QuantizedPool):
            ids = (FORMAT_IDS.get(k_pool.fmt.name), FORMAT_IDS.get(v_pool.fmt.name))
            if None not in ids and key.device.type == "cpu":
                return self.write_op(key, value, slot_mapping.contiguous(), k_pool.data, k_pool.scales, v_pool.data,
                                     v_pool.scales, ids[0], ids[1], k_pool.rotation)
            key, value = k_pool.rotate(key), v_pool.rotate(value)
        elif key.device.type == "cpu" and key.dtype == value.dtype == k_pool.dtype == v_pool.dtype \
                and k_pool.is_contiguous() and v_pool.is_contiguous():
            # one call, -1 slots skipped in C++ (no mask read back), the states read in place
            return self.plain_write_op(key, value, slot_mapping.contiguous(), k_pool, v_pool)
        return torch_backend.write_kv(k_pool, v_pool, key, value, slot_mapping, writes_all)

    def prepare(self, plan: StepPlan, peers: dict | None = None) -> CpuStep:
        return CpuStep(self, plan, peers)

    def decode_attention(self, query, k_pool, v_pool, block_tables, context_lens, scale, sliding_window=0,
                         max_context=None, workspace=None):
        """As torch_backend.decode_attention: query [B, Hq, D] -> [B, Hq, D]."""
        call = kernel_call(self, query, k_pool, v_pool)
        if call is None:
            return torch_backend.decode_attention(query, k_pool, v_pool, block_tables, context_lens, scale,
                                                  sliding_window, max_context, workspace)
        rows = torch.arange(query.shape[0], dtype=torch.int32)
        pos = (context_lens.to(torch.int32) - 1).contiguous()           # 0 stored tokens -> -1: zeros
        return call(query.contiguous(), block_tables.to(torch.int32).contiguous(), rows, pos, float(scale),
                    int(sliding_window))

    def extend_attention(self, query, k_pool, v_pool, block_tables, context_lens, query_pos, scale,
                         sliding_window=0, max_context=None):
        """As torch_backend.extend_attention: query [B, Hq, Q, D] -> [B, Hq, Q, D]."""
        call = kernel_call(self, query, k_pool, v_pool)
        if call is None:
            return torch_backend.extend_attention(query, k_pool, v_pool, block_tables, context_lens, query_pos,
                                                  scale, sliding_window, max_context)
        batch, num_heads, q_len, head_dim = query.shape
        rows = torch.arange(batch, dtype=torch.int32).repeat_interleave(q_len)
        flat = query.transpose(1, 2).reshape(batch * q_len, num_heads, head_dim).contiguous()
        out = call(flat, block_tables.to(torch.int32).contiguous(), rows,
                   query_pos.reshape(-1).to(torch.int32).contiguous(), float(scale), int(sliding_window))
        return out.view(batch, q_len, num_heads, head_dim).transpose(1, 2)


def make_backend() -> CpuKernelBackend:
    """A backend on the compiled kernel (built on first use); raises RuntimeError when it cannot be built."""
    return CpuKernelBackend(load_kernel())
