"""One forward's plan bound to an attention backend: what every layer's attention call runs.

The protocol every backend follows (``TorchBackend``, ``CpuKernelBackend``, ``CudaBackend``)::

    backend.write_kv(k_pool, v_pool, key [T, Hkv, D], value [T, Hkv, D], slot_mapping int64 [T])
    backend.copy_blocks(pools, pairs int64 [P, 2])          # copy-on-write, every pool tensor at once
    step = backend.prepare(plan, peers)                      # once per forward (a hf_paged.plan.StepPlan)
    out = step.attend(query [T, Hq, D], k_pool, v_pool, scale, window)   # each layer -> [T, Hq, D]

``query`` holds the forward's T query tokens in the plan's order (generate's [B, Q] row-major, the
engine's packed [1, T]); pad tokens give zeros. Layer-independent work is done once per forward and
kept in the step's :class:`Workspace` (the padded view, masks, work chunks, split scratch). The base
:class:`Step` is the padded path: decode rows through the backend's ``decode_attention`` and extend rows
through ``extend_attention`` over :func:`~hf_paged.plan.padded_view` (the PyTorch reference's layout);
the CPU and CUDA steps send the ragged token list to their kernels instead where they can.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kv_formats import QuantizedPool
from ..plan import PaddedView, StepPlan, padded_view, plan_on


@dataclass
class Workspace:
    """What the layers of one forward share (they run one after another, so scratch is reused).

    padded      : the plan's extend rows as a padded batch (built on first use)
    decode_bias : (keys, window) -> (float32 [D, keys] additive mask, bool [D, 1] rows with keys)
    chunks      : tokens per chunk -> int32 [C, 2] ragged work chunks (CUDA)
    splits      : (kernel family, rows, heads, head_dim, splits) -> fp32 split-K scratch (CUDA)
    devices     : device -> this step on that device (a device_map's other devices)
    rotary      : (cos, sin, their rows [N, D]) of the forward's position embeddings (``fused_lean``)
    """
    padded: PaddedView | None = None
    decode_bias: dict = field(default_factory=dict)
    chunks: dict = field(default_factory=dict)
    splits: dict = field(default_factory=dict)
    devices: dict = field(default_factory=dict)
    rotary: tuple | None = None


@dataclass(frozen=True)
class PagedLayer:
    """What a paged cache's ``update`` returns as the layer's "keys" and "values": its pools and the step
    bound to their device. The attention function reads K/V through it, so the step reaches the layers
    one way only: through the cache that planned it."""
    k_pool: object          # torch.Tensor [Hkv, num_blocks, block_size, D] or QuantizedPool
    v_pool: object
    step: Step


class Step:
    """A plan bound to ``backend`` for one forward. ``peers``: device -> backend of the pools that a
    device_map puts on other devices."""

    def __init__(self, backend, plan: StepPlan, peers: dict | None = None):
        self.backend, self.plan = backend, plan
        self.device = plan.device
        self.peers = peers or {}
        self.workspace = Workspace()

    def on(self, device: torch.device) -> Step:
        """This step for layers on another device: the plan copied there and bound to that device's
        backend, once per forward and device."""
        if device == self.device:
            return self
        step = self.workspace.devices.get(device)
        if step is None:
            if device not in self.peers:
                raise RuntimeError(f"a layer ran on {device} but the KV pools know only "
                                   f"{[self.device, *self.peers]}; build the cache for this model "
                                   "(the patched generate and the engine read each layer's device)")
            step = self.workspace.devices[device] = self.peers[device].prepare(plan_on(self.plan, device))
        return step

    def attend(self, query: torch.Tensor, k_pool, v_pool, scale: float, window: int) -> torch.Tensor:
        """query [T, Hq, D] -> out [T, Hq, D]."""
        if query.device != self.device:
            return self.on(query.device).attend(query, k_pool, v_pool, scale, window)
        if isinstance(k_pool, QuantizedPool):
            # Pools hold x R (kv_formats): (q R)·(k R) = q·k, and the output comes back as (sum p v) R.
            # A pool without R leaves its side as it is (KIVI rotates its values only).
            out = self._attend(k_pool.rotate(query).to(query.dtype), k_pool, v_pool, scale, window)
            return v_pool.unrotate(out)
        return self._attend(query, k_pool, v_pool, scale, window)

    def padded(self) -> PaddedView | None:
        if self.workspace.padded is None:
            self.workspace.padded = padded_view(self.plan)
        return self.workspace.padded

    def _attend(self, query, k_pool, v_pool, scale, window):
        """Decode rows through ``decode_attention`` as they are; extend rows scattered into the padded
        view (zeros elsewhere, query_pos -1), through ``extend_attention``, and gathered back."""
        plan, backend = self.plan, self.backend
        nd = plan.num_decode
        parts = []
        if nd:
            parts.append(backend.decode_attention(
                query[:nd], k_pool, v_pool, plan.block_tables[:nd], plan.decode_lens, scale, window,
                plan.decode_context, workspace=self.workspace))
        view = self.padded()
        if view is not None:
            tokens = query[nd:]
            rows, q_len = view.query_pos.shape
            if view.index is None:
                padded = tokens.view(rows, q_len, *tokens.shape[1:])
            else:
                padded = tokens.new_zeros(rows * q_len, *tokens.shape[1:]).index_copy_(0, view.index, tokens)
                padded = padded.view(rows, q_len, *tokens.shape[1:])
            out = backend.extend_attention(padded.transpose(1, 2), k_pool, v_pool, view.block_tables,
                                           view.context_lens, view.query_pos, scale, window, plan.max_context)
            out = out.transpose(1, 2).reshape(rows * q_len, *tokens.shape[1:])
            parts.append(out if view.index is None else out.index_select(0, view.index))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
