"""Decode steps on static buffers per batch-size bucket, captured as CUDA graphs.

A decode-only step of ``n`` sequences runs in the smallest bucket ``B >= n`` of vLLM's capture sizes
(:func:`capture_sizes`: 1, 2, 4, then multiples of 8). Each bucket owns static tensors
(:class:`DecodeBuffers`): the input ids and position ids ``[1, B]``, the rows kept for the LM head, and a
:class:`~hf_paged.plan.StepPlan` whose tensors never move. A step copies its metadata into them; the
``B - n`` pad rows hold token 0 at position 0, write the reserved scratch block (the pool's last block,
which the block pool never hands out) and read only it, so they touch no real block; their logits are
dropped. The plan's host integers are fixed per bucket (``max_context`` = the table width in tokens), so
the same launches serve every step of that bucket, which is what a captured graph replays.

:class:`DecodeGraphs` runs a bucket through a *capture* function: ``cuda_capture`` records a
``torch.cuda.CUDAGraph`` of the forward (on first use of the bucket); ``eager_replay`` runs the forward
eagerly on the static buffers (CPU tests of bucketing and padding). The first replay of every bucket is
checked against an eager forward on the same buffers; a capture that raises or a replay that disagrees
is logged and the engine stays eager from then on, as the fast kernels' first-use check does.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..plan import StepPlan

log = logging.getLogger("hf_paged.engine")

# First-use check: replayed logits against eager ones on the same buffers (the same kernels run, so only
# reduction-order noise is expected); relative to the logits' largest magnitude.
CHECK_RTOL = 1e-2


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's capture sizes 1, 2, 4, 8, 16, 24, 32, ..., up to the first one >= ``max_num_seqs``."""
    sizes = [1, 2, 4]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] + (4 if sizes[-1] == 4 else 8))
    return [s for s in sizes if s < max_num_seqs] + [next(s for s in sizes if s >= max_num_seqs)]


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding ``n`` rows, or None when ``n`` is over the largest."""
    return next((s for s in sizes if s >= n), None)


@dataclass(frozen=True)
class DecodeBuffers:
    """Static inputs of one bucket: input_ids / position_ids int64 [1, B], keep int64 [B] (every row: the
    LM head runs on all B), and ``plan``, a decode StepPlan over B rows of ``width`` blocks each."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    keep: torch.Tensor
    plan: StepPlan
    scratch_block: int
    block_size: int

    @classmethod
    def new(cls, size: int, width: int, block_size: int, scratch_block: int, device) -> DecodeBuffers:
        def zeros(*shape, dtype=torch.int32):
            return torch.zeros(shape, dtype=dtype, device=device)
        span = width * block_size                   # the most keys a row of this table width can hold
        plan = StepPlan(slot_mapping=zeros(size, dtype=torch.int64),
                        token_row=torch.arange(size, dtype=torch.int32, device=device), token_pos=zeros(size),
                        query_start=torch.arange(size + 1, dtype=torch.int32, device=device),
                        block_tables=zeros(size, width), context_lens=zeros(size), decode_lens=zeros(size),
                        num_decode=size, max_context=span, max_query_len=1, decode_context=span,
                        batch_shape=(1, size), writes_all=True)
        return cls(zeros(1, size, dtype=torch.int64), zeros(1, size, dtype=torch.int64),
                   torch.arange(size, dtype=torch.int64, device=device), plan, scratch_block, block_size)

    @property
    def size(self) -> int:
        return self.keep.shape[0]

    def host_rows(self, batch) -> dict[str, np.ndarray]:
        """The bucket's rows on the host: the batch's decode rows, then pad rows on the scratch block."""
        size, width = self.plan.block_tables.shape
        bs, scratch = self.block_size, self.scratch_block
        ids = np.zeros(size, dtype=np.int64)
        pos = np.zeros(size, dtype=np.int64)
        slots = np.full(size, scratch * bs, dtype=np.int64)
        tables = np.full((size, width), scratch, dtype=np.int32)
        for row, (seq, _) in enumerate(batch):
            stored = seq.num_computed
            used = stored // bs + 1
            if used > width:
                raise ValueError(f"a decode row needs {used} blocks but the bucket's tables are {width} wide "
                                 "(max_model_len / block_size); run it eagerly (enforce_eager=True)")
            ids[row], pos[row] = seq.token_ids[stored], stored
            slots[row] = seq.block_table.slots(stored, stored + 1, bs)[0]
            tables[row, :used] = seq.block_table.blocks[:used]
        return {"ids": ids, "pos": pos, "slots": slots, "tables": tables}

    def fill(self, batch) -> None:
        """Copy ``batch`` ((sequence, 1) decode entries, at most ``size``) into the static tensors."""
        host = self.host_rows(batch)
        plan = self.plan
        lens = torch.from_numpy(host["pos"] + 1).to(torch.int32)
        for static, value in ((self.input_ids.view(-1), torch.from_numpy(host["ids"])),
                              (self.position_ids.view(-1), torch.from_numpy(host["pos"])),
                              (plan.token_pos, torch.from_numpy(host["pos"]).to(torch.int32)),
                              (plan.slot_mapping, torch.from_numpy(host["slots"])),
                              (plan.block_tables, torch.from_numpy(host["tables"])),
                              (plan.context_lens, lens), (plan.decode_lens, lens)):
            static.copy_(value, non_blocking=True)


def eager_replay(forward, device):
    """A "capture" that runs the forward eagerly on the static buffers each time (CPU, and tests)."""
    return forward


def cuda_capture(forward, device, pool=None):
    """Record ``forward()`` (which returns the logits tensor) as a CUDA graph; returns ``replay()``, which
    reruns it on whatever the static buffers hold and returns the same logits tensor. Two warm-up runs on
    a side stream first (lazy kernel loads, library workspaces, the fast kernels' first-use check, none
    of which may happen during capture)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()

    def replay():
        graph.replay()
        return out
    return replay


class DecodeGraphs:
    """Decode-only steps of a runner on per-bucket static buffers, through ``capture`` (see module doc).

    sizes: the buckets; width: blocks per table row; scratch_block: the pool's reserved block.
    """

    def __init__(self, runner, sizes: list[int], width: int, scratch_block: int, capture=cuda_capture):
        self.runner, self.sizes, self.width, self.scratch_block = runner, sizes, width, scratch_block
        self.capture = capture
        self.buffers: dict[int, DecodeBuffers] = {}
        self.replays: dict[int, object] = {}
        self.enabled = True
        self.replayed_steps = 0

    def eligible(self, batch) -> bool:
        """Every entry is one decode token that samples, and the batch fits the largest bucket (the
        runner also sends no step that asks prompt log-probabilities)."""
        return (self.enabled and 0 < len(batch) <= self.sizes[-1]
                and all(n == 1 and seq.num_computed + 1 == seq.num_tokens for seq, n in batch))

    def _buffers(self, size: int) -> DecodeBuffers:
        if size not in self.buffers:
            self.buffers[size] = DecodeBuffers.new(size, self.width, self.runner.cache.block_size,
                                                   self.scratch_block, self.runner.device)
        return self.buffers[size]

    def execute(self, batch) -> torch.Tensor | None:
        """float32 logits [n, V] of the batch's rows, or None when graphs just turned off (capture failed):
        the caller then runs the step eagerly."""
        size = bucket_for(len(batch), self.sizes)
        buffers = self._buffers(size)
        buffers.fill(batch)

        def forward():
            return self.runner.forward(buffers.input_ids, buffers.position_ids, buffers.plan, buffers.keep)

        replay = self.replays.get(size)
        if replay is None:
            return self._first_use(size, forward, len(batch))
        self.replayed_steps += 1
        return replay()[:len(batch)].float()

    def _first_use(self, size: int, forward, n: int) -> torch.Tensor | None:
        """Capture the bucket, replay it once, and keep it only if it agrees with an eager forward."""
        try:
            replay = self.capture(forward, self.runner.device)
            got = replay()[:n].float().clone()
        except Exception as exc:        # any capture failure: the eager path is always there
            log.error("hf_paged: capturing the decode step of bucket %d failed (%s: %s); the engine runs "
                      "eagerly from now on (enforce_eager=True skips capture)", size, type(exc).__name__, exc)
            self.enabled = False
            return None
        want = forward()[:n].float()
        error = (got - want).abs().max().item()
        bound = CHECK_RTOL * max(want.abs().max().item(), 1.0)
        if not error <= bound:          # NaN fails too
            log.error("hf_paged: the replayed decode step of bucket %d disagrees with the eager one (max |error| "
                      "%.3g > %.3g); the engine runs eagerly from now on (enforce_eager=True skips capture)",
                      size, error, bound)
            self.enabled = False
            return want
        self.replays[size] = replay
        return got
