"""KV pools: what every paged cache (generate's PagedCache, the engine's EngineCache) shares.

Per layer, ``key_pools[i]`` and ``value_pools[i]`` are ``[num_kv_heads, num_blocks, block_size,
head_dim]`` tensors in the model's dtype (the layout ``backends.torch_backend`` documents), or, with a
quantised ``kv_format``, ``kv_formats.QuantizedPool`` objects (codes and scales in the same block
geometry). This base holds the model's KV geometry, the
pools, writes and copy-on-write copies through the backend, and the per-layer answers
transformers asks of a cache (no sliding/linear/dummy layers it must special-case, not compileable).
"""
from __future__ import annotations

import logging
import math

import torch
from transformers import Cache

from ..backends import TorchBackend, select_backend
from ..backends.cpu_backend import CpuKernelBackend
from ..backends.kernel_registry import has_kernels
from ..backends.step import PagedLayer, Step
from ..families import KVGeometry, config_geometry
from ..hugepages import huge_page_buffer
from ..kivi import KIVI, KiviPool, KiviWrite, write_kv as write_kivi
from ..kivi_stores import KiviMaps, grown
from ..kv_formats import KVFormat, QuantizedPool, kv_format, rotation_matrix

log = logging.getLogger("hf_paged.cache")


def kv_bytes_per_token(config, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """KV bytes one token takes over all layers, keys and values (scales included), for ``config``'s
    model in ``dtype`` stored as ``kv_cache_dtype``."""
    return config_geometry(config).bytes_per_token(dtype, kv_format(kv_cache_dtype))


class KVPools(Cache):
    """Pools and backend of a paged cache; subclasses decide which slots each forward uses (they plan it
    and ``prepare`` it; ``update`` writes and hands the step on to the attention function)."""

    def __init__(self, config, backend=None, geometry: KVGeometry | None = None, kv_format: KVFormat | None = None):
        super().__init__(layers=[])
        self.config = config
        # The config's geometry, unless the model holds less per process (tensor parallelism: see
        # introspect.model_geometry, which the patched generate and the engine pass).
        self.geometry = geometry or config_geometry(config)
        self.kv_format = kv_format          # None: the model's dtype
        if kv_format is not None:
            kv_format.check_head_dim(self.geometry.head_dim)
        self.backend = backend
        self.key_pools: list[torch.Tensor | QuantizedPool] = []
        self.value_pools: list[torch.Tensor | QuantizedPool] = []
        self.peer_backends: dict = {}     # device -> backend of layers on other devices than ``device``
        self.step: Step | None = None     # the running forward's step (set by whoever planned it)
        self.open_slots = 8               # kivi: open slots reserved per layer (the engine: max_num_seqs)
        self.sink_slots: int | None = None  # kivi: sink rows reserved per layer (None: open_slots)
        # kivi: the step's write plans, one per slot_mapping tensor (a device of a device_map), made by the
        # first layer that writes and reused by the others (with the layers that used it); dropped with the step.
        self._kivi_writes: dict[int | str, tuple[torch.Tensor, torch.Tensor, KiviWrite, set[int]]] = {}
        self.kivi_maps: list[KiviMaps] = []    # kivi: the entries the pools on each device share

    def allocate_pools(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Pools on ``device``, or on each layer's own device where the geometry names one (device_map)."""
        g = self.geometry
        device = torch.device(device)
        devices = g.layer_devices or (device,) * g.num_layers
        shape = (g.num_kv_heads, num_blocks, block_size, g.head_dim)
        if self.kv_format is None:
            cpu_pools = iter(self._cpu_pools(shape, dtype, 2 * sum(torch.device(d).type == "cpu" for d in devices)))

            def new_pool(d):
                return next(cpu_pools) if torch.device(d).type == "cpu" else torch.zeros(shape, dtype=dtype, device=d)
        elif self.kv_format is KIVI:
            return self._allocate_kivi(shape, dtype, device, devices)
        else:
            rotations = self._rotations(devices)
            on_cpu = [d for d in devices if torch.device(d).type == "cpu"]     # (keys, then values: 2 per layer)
            cpu_pools = iter(self._cpu_quantised_pools(shape, 2 * len(on_cpu), rotations[on_cpu[0]] if on_cpu else None))

            def new_pool(d):
                if torch.device(d).type == "cpu":
                    return next(cpu_pools)
                return QuantizedPool.zeros(self.kv_format, *shape, device=d, rotation=rotations[d])
        self.key_pools = [new_pool(d) for d in devices]
        self.value_pools = [new_pool(d) for d in devices]
        if not has_kernels(self.kv_format):
            return self._without_cuda_kernels(device, devices)
        if self.backend is None:
            self.backend = select_backend(device)
        self.peer_backends = {d: select_backend(d) for d in set(devices) - {device}}

    @staticmethod
    def _cpu_pools(shape, dtype: torch.dtype, count: int) -> list[torch.Tensor]:
        """``count`` zeroed pools of ``shape`` for the CPU, views of one buffer on huge pages where the system
        allows (``hf_paged.hugepages``: decode steps read the pools' blocks scattered over all of it)."""
        numel = math.prod(shape)
        buffer = huge_page_buffer(numel * count, dtype)
        return [buffer[i * numel:(i + 1) * numel].view(shape).zero_() for i in range(count)]

    def _cpu_quantised_pools(self, shape, count: int, rotation) -> list[QuantizedPool]:
        """``count`` quantised pools of ``shape`` for the CPU (as ``QuantizedPool.zeros`` makes them: zero codes,
        unit scales), their codes and scales views of one buffer on huge pages where the system allows (as
        ``_cpu_pools``), each tensor starting on a cache line."""
        if count == 0:
            return []
        fmt, (heads, blocks, block_size, head_dim) = self.kv_format, shape
        fmt.check_head_dim(head_dim)
        code_shape = (heads, blocks, block_size, fmt.code_bytes(head_dim))
        scale_shape = (heads, blocks, block_size, fmt.num_scales(head_dim))
        code_bytes, scale_bytes = math.prod(code_shape), 2 * math.prod(scale_shape)
        lines = lambda nbytes: -(-nbytes // 64) * 64           # noqa: E731  (rounded up to whole cache lines)
        stride = lines(lines(code_bytes) + scale_bytes)         # one pool: codes, then scales
        buffer = huge_page_buffer(stride * count, torch.uint8)
        pools = []
        for i in range(count):
            at = i * stride
            scales_at = at + lines(code_bytes)
            data = buffer[at:at + code_bytes].view(code_shape).zero_()
            scales = buffer[scales_at:scales_at + scale_bytes].view(torch.bfloat16).view(scale_shape).fill_(1)
            pools.append(QuantizedPool(data, scales, fmt, head_dim, rotation if fmt.rotate else None))
        return pools

    def _rotations(self, devices) -> dict:
        """R on each distinct device, shared by every layer's quantised pools there."""
        return {d: rotation_matrix(self.geometry.head_dim, d) for d in set(devices)}

    def _without_cuda_kernels(self, device, devices) -> None:
        """A format no CUDA kernel reads (``kernel_registry.has_kernels``: nvfp4, kivi) runs on the PyTorch
        path off the CPU, so a GPU never reaches a kernel that would refuse its pools; said once per
        allocation, on CUDA only. All on the CPU, the CPU kernel backend stays: it reads both (nvfp4 and kivi)
        in place, and would hand a format it had no code for to the PyTorch path itself."""
        if all(torch.device(d).type == "cpu" for d in devices):
            chosen = self.backend if self.backend is not None else select_backend(device)
            if isinstance(chosen, (TorchBackend, CpuKernelBackend)):
                self.backend, self.peer_backends = chosen, {}
                return
        if any(torch.device(d).type == "cuda" for d in devices):
            log.info("kv_cache_dtype=%r has no CUDA kernel: attention runs on the PyTorch path",
                     self.kv_format.name)
        self.backend = self.backend if isinstance(self.backend, TorchBackend) else TorchBackend()
        self.peer_backends = {d: self.backend for d in set(devices) - {device}}

    def _allocate_kivi(self, shape, dtype, device, devices) -> None:
        """KIVI pools (``hf_paged.kivi``): on the CPU the kernel backend reads them in place (codes and side
        rows; writes and sealing are kivi's own); elsewhere the PyTorch path (no CUDA kernel reads them)."""
        heads, blocks, block_size, head_dim = shape
        reserved = (self.open_slots, self.sink_slots)
        rotations = self._rotations(devices)                   # values only (kivi.py)
        sinks = self.open_slots if self.sink_slots is None else self.sink_slots
        maps = {d: KiviMaps.empty(blocks, self.open_slots, sinks, d, shared=True) for d in dict.fromkeys(devices)}
        self.kivi_maps = list(maps.values())
        self.key_pools = [KiviPool.new(True, heads, blocks, block_size, head_dim, dtype, d, *reserved, maps=maps[d])
                          for d in devices]
        self.value_pools = [KiviPool.new(False, heads, blocks, block_size, head_dim, dtype, d, *reserved,
                                         rotation=rotations[d], maps=maps[d]) for d in devices]
        self._without_cuda_kernels(device, devices)

    def release_blocks(self, blocks) -> None:
        """Blocks the block pool made plain free (``BlockPool.free_listeners``): KIVI open slots and sinks go
        back (once per device: the pools there share their entries)."""
        for maps in self.kivi_maps:
            maps.release(blocks)

    def copy_side_from(self, src: KVPools, src_blocks: list[int], dst_blocks: list[int]) -> None:
        """Blocks ``dst_blocks`` were copied from ``src``'s ``src_blocks`` (codes and scales): KIVI sinks
        travel with them (the blocks are full, hence sealed: no open slot). The entries change once per pair of
        shared maps, the rows in every pool."""
        pairs: dict[tuple[int, int], list] = {}
        for mine, theirs in zip(self.key_pools + self.value_pools, src.key_pools + src.value_pools):
            if isinstance(mine, KiviPool):
                key = (id(mine.maps), id(theirs.maps))
                if key not in pairs:
                    pairs[key] = mine.maps.copy_sinks_from(theirs.maps, src_blocks, dst_blocks)
                mine.sink.copy_rows(theirs.sink, pairs[key])

    @property
    def open_bytes(self) -> int:
        """Bytes of KIVI open slots and sinks (model dtype), all layers; 0 for other formats."""
        return sum(p.open_bytes for p in self.key_pools + self.value_pools if isinstance(p, KiviPool))

    def grow_pools(self, extra_blocks: int) -> None:
        """Append ``extra_blocks`` zeroed blocks to every pool (one copy of the pools; scales filled with 1)."""
        for pools in (self.key_pools, self.value_pools):
            for i, pool in enumerate(pools):
                if isinstance(pool, QuantizedPool):
                    pools[i] = pool.with_tensors(grown(pool.data, extra_blocks, 0), grown(pool.scales, extra_blocks, 1))
                else:
                    pools[i] = grown(pool, extra_blocks, 0)

    def pool_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by block (dimension 1): each layer's keys and values, codes and scales."""
        out = []
        for pool in self.key_pools + self.value_pools:
            out.extend(pool.tensors if isinstance(pool, QuantizedPool) else (pool,))
        return out

    @property
    def pool_bytes(self) -> int:
        """Bytes the pools take (scales included)."""
        return sum(t.nbytes for t in self.pool_tensors()) + self.open_bytes

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Apply copy-on-write pairs ``(src, dst)`` to every layer's keys and values, in one call."""
        if not copies:
            return
        entries = {id(maps): maps.copy(copies) for maps in self.kivi_maps}     # once per device, then the rows
        for pool in self.key_pools + self.value_pools:
            if isinstance(pool, KiviPool):
                pool.copy_rows(*entries[id(pool.maps)])
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for pool in self.pool_tensors():
            by_device.setdefault(pool.device, []).append(pool)
        for device, pools in by_device.items():
            pairs = torch.tensor(copies, dtype=torch.int64, device=device)
            self.peer_backends.get(device, self.backend).copy_blocks(pools, pairs)

    def prepare(self, plan) -> Step:
        """Bind one forward's plan to the backend (and the peers of a device_map); the layers' ``update``
        calls write and read through it until ``end_step``."""
        self.step = self.backend.prepare(plan, self.peer_backends)
        self._kivi_writes = {}
        return self.step

    def end_step(self) -> None:
        """The forward is over: its plan may not be used again (and KIVI's fresh rows are not needed)."""
        self.step = None
        self._kivi_writes = {}
        for maps in self.kivi_maps:
            maps.fresh.clear()
            maps.last = None
        for pool in self.key_pools + self.value_pools:
            if isinstance(pool, KiviPool):
                pool.fresh.drop_rows()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[PagedLayer, PagedLayer]:
        """Write this forward's K/V ([B, Hkv, Q, D]) into the planned slots; return the layer's pools bound
        to the step (as both "keys" and "values"), which the attention function reads."""
        if self.step is None:
            raise RuntimeError(self.no_step_message)
        k_pool = self.key_pools[layer_idx]
        step = self.step.on(k_pool.device)      # the plan where this layer's pool is
        self.write(layer_idx, key_states, value_states, step.plan.slot_mapping, step.plan.writes_all,
                   step.plan.token_pos)
        layer = PagedLayer(k_pool, self.value_pools[layer_idx], step)
        return layer, layer

    no_step_message = "a paged cache's update ran outside a planned forward"

    def direct(self, layer_idx: int, dtype: torch.dtype):
        """(k_pool, v_pool, step) when this layer's write and attention may skip ``update`` and transformers'
        attention interface: pools on the CPU in a step of the CPU kernel backend on their device, either
        model-dtype pools of ``dtype``, contiguous (``CpuStep.write_direct`` / ``attend_direct``: the C++ calls
        those end in), or quantised ones (``write_rows`` / ``Step.attend``); else None (then ``update``)."""
        step, k_pool, v_pool = self.step, self.key_pools[layer_idx], self.value_pools[layer_idx]
        if (step is None or not hasattr(step, "attend_direct") or k_pool.device != step.device
                or k_pool.device.type != "cpu"):
            return None
        if isinstance(k_pool, QuantizedPool):       # (states go to the backend unrotated: it rotates on write)
            return (k_pool, v_pool, step) if getattr(self.backend, "rotates_on_write", False) else None
        if (type(k_pool) is not torch.Tensor or k_pool.dtype != dtype or v_pool.dtype != dtype
                or not (k_pool.is_contiguous() and v_pool.is_contiguous())):
            return None
        return k_pool, v_pool, step

    def write_rows(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                   writes_all: bool, positions: torch.Tensor | None, kivi_plan: KiviWrite | None = None) -> None:
        """[N, Hkv, D] keys / values (``write``'s states as rows, checked and, for a backend that does not rotate
        on write, rotated) into layer ``layer_idx``'s pools: KIVI's write plan (``kivi_plan``: the one this layer
        already took from ``kivi_write_plan``), else the backend's write."""
        k_pool, v_pool = self.key_pools[layer_idx], self.value_pools[layer_idx]
        if isinstance(k_pool, KiviPool):        # on every backend: no kernel writes or seals KIVI blocks
            write_kivi(k_pool, v_pool, key, value,
                       kivi_plan or self.kivi_write_plan(layer_idx, slot_mapping, positions),
                       self.kivi_ops(k_pool.device))
        else:
            self.backend.write_kv(k_pool, v_pool, key, value, slot_mapping, writes_all)

    def write(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor,
              slot_mapping: torch.Tensor, writes_all: bool = False,
              positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write [B, Hkv, Q, D] keys/values at ``slot_mapping`` (int64 [B*Q] on the layer's device, -1 = skip;
        ``writes_all``: none is, known on the host); return the pools. ``positions``: int [B*Q], the stored
        index of each token (the plan's ``token_pos``); KIVI pools need it (their sinks are position 0).

        Inference only: the pools hold detached values, so no autograd graph grows across steps."""
        k_pool, v_pool = self.key_pools[layer_idx], self.value_pools[layer_idx]
        quantised = isinstance(k_pool, QuantizedPool)
        if key_states.device != k_pool.device or (not quantised and key_states.dtype != k_pool.dtype):
            raise TypeError(
                f"layer {layer_idx} produced {key_states.dtype} keys on {key_states.device} but the KV pool "
                f"is {self.kv_format.name if quantised else k_pool.dtype} on {k_pool.device}; build the cache with the model's dtype/device "
                "(PagedCache(config, dtype=..., device=...)) or leave them unset.")
        if key_states.shape[1] != k_pool.shape[0]:
            raise ValueError(
                f"layer {layer_idx} produced {key_states.shape[1]} KV heads but the KV pool holds {k_pool.shape[0]}: "
                "the model is sharded (tensor parallelism) or is not the model the cache was built for. Build the "
                "cache with the model's own geometry: PagedCache(model.config, geometry=hf_paged.model_geometry(model))"
                " (the patched generate and the engine do this).")
        batch, heads, q_len, dim = key_states.shape
        kivi = isinstance(k_pool, KiviPool)
        if kivi and positions is None:
            raise ValueError("kv_cache_dtype='kivi' writes need each token's position (the plan's token_pos)")
        if quantised and not kivi and not getattr(self.backend, "rotates_on_write", False):
            # rotated in fp32, quantised from fp32 (see kv_formats); a backend that rotates on write
            # (the CPU kernel's, fused with quantisation) gets the states as they are. (KIVI rotates its values.)
            key_states, value_states = k_pool.rotate(key_states), v_pool.rotate(value_states)
        self.write_rows(layer_idx, key_states.detach().transpose(1, 2).reshape(batch * q_len, heads, dim),
                        value_states.detach().transpose(1, 2).reshape(batch * q_len, heads, dim),
                        slot_mapping, writes_all, positions)
        return k_pool, v_pool

    def kivi_ops(self, device):
        """The backend of ``device`` where it has KIVI's C++ writes (the CPU kernel backend), else None."""
        backend = self.peer_backends.get(device, self.backend)
        return backend if hasattr(backend, "kivi_write_kv") and torch.device(device).type == "cpu" else None

    def kivi_write_plan(self, layer_idx: int, slot_mapping: torch.Tensor, positions: torch.Tensor) -> KiviWrite:
        """The KIVI write plan of these slots and positions for layer ``layer_idx``'s write, one per write of all
        layers: the pools of a device share their entries, which change once per plan (``kivi_plan.transition``).
        In a step, the plan of the slot_mapping tensor (the same object reaches every layer); outside one (direct
        ``write`` calls), the latest plan while the slots and positions are equal and the layer has not written
        it yet. A layer takes it once per write (a second call is its next write)."""
        block_size = self.key_pools[layer_idx].data.shape[2]
        known = self._kivi_writes.get(id(slot_mapping))
        if known is not None and known[0] is slot_mapping and known[1] is positions and layer_idx not in known[3]:
            known[3].add(layer_idx)
            return known[2]
        key = id(slot_mapping) if self.step is not None else str(slot_mapping.device)
        if self.step is None:
            last = self._kivi_writes.get(key)
            if (last is not None and layer_idx not in last[3] and torch.equal(last[0], slot_mapping)
                    and torch.equal(last[1], positions)):
                last[3].add(layer_idx)
                return last[2]
        plan = KiviWrite.of(slot_mapping, positions.reshape(-1), block_size)
        self._kivi_writes[key] = (slot_mapping, positions, plan, {layer_idx})   # (held: ids stay theirs)
        return plan

    # ------------------------------------------------- per-layer answers for transformers
    def __len__(self) -> int:
        return self.geometry.num_layers

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [w > 0 for w in self.geometry.sliding_windows]

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.geometry.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.geometry.num_layers
