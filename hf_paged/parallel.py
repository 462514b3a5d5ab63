"""Tensor-parallel ranks: what the ranks of a ``tp_plan`` model must agree on.

Under transformers' tensor parallelism every rank runs the same program (SPMD) on its share of the
heads, and every rank's hf_paged state — block pool, block tables, schedule — must stay identical, or
the ranks would write and read different slots and the all-reduces would mix different tokens. The
bookkeeping is deterministic given the same calls, so the ranks agree by construction; two things are
not, and are made so here: a KV budget measured per device (free memory differs between ranks, so
all take the smallest), and sampled tokens (drawn once, on the group's first rank, and broadcast).
A model that is not tensor-parallel gets a ``TensorParallelRanks`` of size 1, whose methods do nothing.
Each rank holds a shard of the model (its share of the heads), not a replica of it.
"""
from __future__ import annotations

import torch

from .introspect import tensor_parallel_size


class TensorParallelRanks:
    """The tensor-parallel group of a model, seen from one rank (size 1 when there is none)."""

    def __init__(self, group=None):
        self.group = group
        if group is None:
            self.size, self.rank, self.first = 1, 0, 0
        else:
            import torch.distributed as dist

            self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
            self.first = dist.get_global_rank(group, 0)
            self.device = torch.device("cuda", torch.cuda.current_device()) \
                if dist.get_backend(group) == "nccl" else torch.device("cpu")

    def smallest(self, value: int) -> int:
        """The smallest ``value`` over the ranks (every rank calls this)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def share_tokens(self, tokens: list[int]) -> list[int]:
        """The first rank's ``tokens`` on every rank (every rank calls this with a list of the same length)."""
        if self.size == 1 or not tokens:
            return tokens
        import torch.distributed as dist

        t = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=self.first, group=self.group)
        return t.tolist()

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order — for checks that the ranks agree."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def tensor_parallel_ranks(model) -> TensorParallelRanks:
    """The tensor-parallel group ``model`` was loaded with (``from_pretrained(..., tp_plan=...)``), if any."""
    tp_size = tensor_parallel_size(model)
    if tp_size <= 1:
        return TensorParallelRanks()
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        raise RuntimeError(f"model has tp_size={tp_size} but no device mesh; load it with "
                           "from_pretrained(..., tp_plan='auto') under torchrun")
    if mesh.ndim > 1:
        mesh = mesh["tp"]
    return TensorParallelRanks(mesh.get_group())
