"""One forward's plan bound to an attention backend: what every layer's attention call runs.

A backend is any object with ``write_kv``, ``copy_blocks``, ``decode_attention`` and
``extend_attention`` (see ``torch_backend`` for the signatures and the pool layout). Once per forward
the cache calls ``prepare_step(backend, plan)``; each layer then calls ``step.attend(...)``.
Layer-independent work is done once per forward: a backend's attention functions receive the
step's ``workspace`` dict and keep there what every layer would otherwise redo (split-K partitions,
scratch buffers); the plan's tables are int32 and on the device already.
"""
from __future__ import annotations

import torch

from ..kv_formats import QuantizedPool
from ..plan import PackedPlan, StepPlan, plan_on


class PreparedStep:
    def __init__(self, backend, plan: StepPlan | PackedPlan):
        self.backend, self.plan = backend, plan
        self.device = plan.slot_mapping.device if plan.slot_mapping is not None else plan.block_tables.device
        self.workspace: dict = {}
        self.peers: dict = {}        # device -> backend, for layers a device_map puts on other devices

    def on(self, device: torch.device) -> PreparedStep:
        """This step for layers on another device (a device_map): the plan copied there and bound to that
        device's backend, once per forward and device."""
        if device == self.device:
            return self
        key = ("device", device)
        if key not in self.workspace:
            if device not in self.peers:
                raise RuntimeError(f"a layer ran on {device} but the KV pools know only "
                                   f"{[self.device, *self.peers]}; build the cache for this model "
                                   "(the patched generate and the engine read each layer's device)")
            self.workspace[key] = prepare_step(self.peers[device], plan_on(self.plan, device))
        return self.workspace[key]

    def ragged(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`ragged_plan` of this step, built on first use and kept for the other layers."""
        if "ragged" not in self.workspace:
            self.workspace["ragged"] = ragged_plan(self.plan)
        return self.workspace["ragged"]

    def attend(self, query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float,
               window: int) -> torch.Tensor:
        """query [B, Hq, Q, D] (packed: [1, Hq, N, D]) -> out [B, Q, Hq, D]. Pad queries give zeros."""
        if query.device != self.device:
            return self.on(query.device).attend(query, k_pool, v_pool, scale, window)
        if isinstance(k_pool, QuantizedPool) and k_pool.rotation is not None:
            # Pools hold x R (kv_formats): (q R)·(k R) = q·k, and the output comes back as (sum p v) R.
            out = self._attend(k_pool.rotate(query).to(query.dtype), k_pool, v_pool, scale, window)
            return v_pool.unrotate(out)
        return self._attend(query, k_pool, v_pool, scale, window)

    def _attend(self, query, k_pool, v_pool, scale, window):
        plan = self.plan
        if isinstance(plan, PackedPlan):
            return self._packed(query, k_pool, v_pool, scale, window)
        if plan.is_decode:
            return self._decode(plan, query[:, :, 0], k_pool, v_pool, scale, window).unsqueeze(1)
        return self._extend(plan, query, k_pool, v_pool, scale, window).transpose(1, 2)

    def _decode(self, plan: StepPlan, query, k_pool, v_pool, scale, window):
        return self.backend.decode_attention(query, k_pool, v_pool, plan.block_tables, plan.decode_lens, scale,
                                             window, plan.max_context, workspace=self.workspace)

    def _extend(self, plan: StepPlan, query, k_pool, v_pool, scale, window):
        return self.backend.extend_attention(query, k_pool, v_pool, plan.block_tables, plan.context_lens,
                                             plan.query_pos, scale, window, plan.max_context)

    def _packed(self, query, k_pool, v_pool, scale, window):
        """Decode tokens go to decode attention as they are; the others are scattered into the extend
        plan's padded [B_e, Hq, Q_e, D] (zeros elsewhere, query_pos -1), attended, and gathered back."""
        plan = self.plan
        _, num_heads, _, head_dim = query.shape
        packed = query[0].transpose(0, 1)                                       # [N, Hq, D]
        nd = plan.num_decode
        parts = []
        if plan.decode is not None:
            parts.append(self._decode(plan.decode, packed[:nd].contiguous(), k_pool, v_pool, scale, window))
        if plan.extend is not None:
            e = plan.extend
            rows, q_len = e.query_pos.shape
            padded = packed.new_zeros(rows * q_len, num_heads, head_dim)
            padded.index_copy_(0, e.packed_index, packed[nd:])
            out = self._extend(e, padded.view(rows, q_len, num_heads, head_dim).transpose(1, 2), k_pool, v_pool,
                               scale, window)
            parts.append(out.transpose(1, 2).reshape(rows * q_len, num_heads, head_dim).index_select(0, e.packed_index))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.unsqueeze(0)


def ragged_plan(plan: StepPlan | PackedPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query token of ``plan``, in the order the forward lays them out: its block-table row and its
    stored index (-1 = pad). A PackedPlan's decode and extend rows share one table (decode rows first)."""
    if isinstance(plan, StepPlan):
        batch, q_len = plan.query_pos.shape
        rows = torch.arange(batch, dtype=torch.int32, device=plan.query_pos.device).repeat_interleave(q_len)
        return plan.block_tables.contiguous(), rows, plan.query_pos.reshape(-1).to(torch.int32).contiguous()
    parts = [p for p in (plan.decode, plan.extend) if p is not None]
    width = max(p.block_tables.shape[1] for p in parts)
    tables, rows, pos, row_base = [], [], [], 0
    for part in parts:
        table = part.block_tables
        tables.append(torch.nn.functional.pad(table, (0, width - table.shape[1])))
        batch, q_len = part.query_pos.shape
        part_rows = torch.arange(batch, dtype=torch.int32, device=table.device).repeat_interleave(q_len) + row_base
        part_pos = part.query_pos.reshape(-1)
        if part.packed_index is not None:
            part_rows, part_pos = part_rows[part.packed_index], part_pos[part.packed_index]
        rows.append(part_rows)
        pos.append(part_pos.to(torch.int32))
        row_base += batch
    return torch.cat(tables).contiguous(), torch.cat(rows), torch.cat(pos).contiguous()


def prepare_step(backend, plan: StepPlan | PackedPlan, peers: dict | None = None) -> PreparedStep:
    """``backend.prepare(plan)`` where the backend has one, else a plain PreparedStep. ``peers``: the
    backends of other devices holding layers' pools (device -> backend)."""
    prepare = getattr(backend, "prepare", None)
    step = prepare(plan) if prepare is not None else PreparedStep(backend, plan)
    step.peers = peers or {}
    return step
