"""Split-K for the CUDA attention kernels: the one planner, and the scratch the splits merge through.

A launch with few CTAs (small batches, long contexts) leaves most SMs idle, so each (row, KV head)
CTA's keys are cut into ``splits`` ranges of ``partition`` keys, each range run by its own CTA, and
the partial results merged by log-sum-exp (``hfp_decode_reduce_*``, ``hfp_merge_splits_*``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_PARTITION = 256      # keys: shorter splits cost more in merging than they gain in parallelism


@dataclass(frozen=True)
class SplitPlan:
    """``partition`` keys per split, ``splits`` = ceil(span / partition) splits (1: no merge)."""
    partition: int
    splits: int


def plan_splits(sm_count: int, ctas: int, span: int, tile: int, partition_size: int | None = None) -> SplitPlan:
    """Splits over ``span`` keys for a grid of ``ctas`` CTAs: one split when the CTAs already fill two
    waves of the device's ``sm_count`` SMs, else enough splits to do so, each a multiple of the kernel's
    ``tile`` keys and at least MIN_PARTITION. ``partition_size`` (the backend's knob) fixes the keys per
    split instead."""
    span = max(span, 1)
    if partition_size is not None:
        partition = partition_size
    else:
        want = _ceil_div(2 * sm_count, max(ctas, 1))
        partition = span if want <= 1 else max(_ceil_div(_ceil_div(span, want), tile) * tile, MIN_PARTITION)
    return SplitPlan(partition, _ceil_div(span, partition))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def split_scratch(scratch: dict | None, key: tuple, rows: int, splits: int, head_dim: int,
                  device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """fp32 partial outputs [rows, splits, D] and log2-sum-exps [rows, splits] (None, None for one split).
    ``scratch``: the step's ``Workspace.splits``, so that the layers of a step (which run one after
    another) share one buffer per ``key``."""
    if splits == 1:
        return None, None
    buffers = scratch.get(key) if scratch is not None else None
    if buffers is None:
        buffers = (torch.empty(rows, splits, head_dim, dtype=torch.float32, device=device),
                   torch.empty(rows, splits, dtype=torch.float32, device=device))
        if scratch is not None:
            scratch[key] = buffers
    return buffers
