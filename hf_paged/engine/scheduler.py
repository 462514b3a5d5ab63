"""Scheduler: which sequences run in the next forward, and how many of their tokens — and the owner
of every sequence's lifecycle.

One token budget (``max_num_batched_tokens``) per step, spent first on running sequences in arrival
order (a decode needs one token; a sequence mid-prefill gets the next chunk), then on waiting ones
while sequence slots (``max_num_seqs``) and blocks allow (vLLM v1's unified schedule: a sequence
simply has ``num_tokens`` and ``num_computed``; prefill, chunked prefill, decode and recomputation
after preemption are the same thing). When a running sequence needs a block and none is free, the
newest running sequence is preempted: its blocks go back (its full blocks stay in the prefix cache)
and it waits at the front of the queue, to be recomputed later; nothing new is admitted that step.

Every transition of a sequence happens here (nano-vllm's scheduler and ``postprocess``):

    add(request)        sequence 0 of the request, WAITING at the back of the queue
    schedule()          WAITING -> RUNNING (admission: prefix match, table from the hits, slots for a
                        chunk); RUNNING -> WAITING (preemption of the newest); slots reserved
    postprocess(...)    after the forward: num_computed / high_water advance, full blocks committed
                        to the prefix cache, the extra sequences of num_return_sequences forked
    finish(seq, why)    RUNNING -> FINISHED, blocks back at once
    cancel(request)     every sequence of the request -> FINISHED "cancelled"

Invariants between calls: ``running`` holds exactly the RUNNING sequences, in admission order (forks
right after their parent's step); every WAITING sequence is in ``waiting`` (which may still hold
cancelled ones, dropped when they reach its front); only RUNNING sequences hold blocks.
"""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..blocks import BlockPool, BlockTable, PrefixCache
from .request import Request, Sequence, Status
from .stats import EngineCounters


@dataclass
class SchedulerOutput:
    """batch: (sequence, tokens to compute), one-token entries first; copies: the copy-on-write block pairs
    ``(src, dst)`` made (and applied: ``Scheduler.copy_blocks``) while scheduling; num_tokens: the batch's tokens."""
    batch: list[tuple[Sequence, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    num_tokens: int = 0


class Scheduler:
    """copy_blocks: applies copy-on-write pairs to the KV pools (the engine's cache), called as each pair is
    made: a preemption later in the same schedule may free the source block and hand it out again (as the
    destination of another copy), so a copy cannot wait for the end of the schedule."""

    def __init__(self, pool: BlockPool, prefix_cache: PrefixCache | None, max_num_seqs: int,
                 max_num_batched_tokens: int, counters: EngineCounters,
                 copy_blocks: Callable[[list[tuple[int, int]]], None] | None = None):
        self.pool, self.prefix_cache = pool, prefix_cache
        self.copy_blocks = copy_blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.counters = counters        # the engine's; the scheduler adds preemptions, prefix hits, recomputation
        self._seq_ids = itertools.count()

    # ------------------------------------------------------------ queries
    @property
    def has_work(self) -> bool:
        return bool(self.running) or any(s.status is Status.WAITING for s in self.waiting)

    def requests_running(self) -> int:
        return len({s.request.request_id for s in self.running})

    def requests_waiting(self) -> int:
        return len({s.request.request_id for s in self.waiting if s.status is Status.WAITING})

    # ------------------------------------------------------------ lifecycle
    def add(self, request: Request) -> Sequence:
        """Queue ``request``: its sequence 0 (the prompt) waits at the back; returns it."""
        seq = self._new_sequence(request, 0, list(request.prompt))
        self.waiting.append(seq)
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        """Running ``seq`` is done (``reason``: its finish_reason): its blocks go back now (hashed full
        blocks stay kept for prefix hits) and it leaves ``running``."""
        if seq.status is not Status.RUNNING:
            raise ValueError(f"sequence {seq.seq_id} of request {seq.request.request_id} is {seq.status.value}: "
                             "only a running sequence can finish (a waiting one is cancelled: cancel(request))")
        seq.block_table.release(self.pool)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.running.remove(seq)

    def cancel(self, request: Request) -> None:
        """End every sequence of ``request`` with finish_reason "cancelled": running ones give their
        blocks back, waiting ones leave the queue when they reach its front, and the sequences not
        forked yet are created finished, so that the request has all ``num_return_sequences``."""
        request.cancelled = True
        for seq in request.sequences:
            if seq.status is Status.RUNNING:
                self.finish(seq, "cancelled")
            elif seq.status is Status.WAITING:
                seq.status, seq.finish_reason = Status.FINISHED, "cancelled"
        while len(request.sequences) < request.params.num_return_sequences:
            seq = self._new_sequence(request, len(request.sequences), list(request.prompt))
            seq.status, seq.finish_reason = Status.FINISHED, "cancelled"

    def preempt_newest(self) -> Sequence:
        """The newest running sequence gives its blocks back and waits at the front of the queue, to
        be recomputed from its tokens (its full blocks may still be hit in the prefix cache)."""
        seq = self.running.pop()
        seq.block_table.release(self.pool)
        seq.block_hashes, seq.num_computed, seq.status = [], 0, Status.WAITING
        self.waiting.appendleft(seq)
        self.counters.preemptions += 1
        return seq

    # ------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        """The next forward's batch: running sequences first, then admitted waiting ones (see module doc)."""
        out, decode, extend = SchedulerOutput(), [], []
        budget, preempted = self._schedule_running(out, decode, extend)
        if not preempted:
            self._admit_waiting(budget, out, decode, extend)
        out.batch = decode + extend
        return out

    def postprocess(self, batch: list[tuple[Sequence, int]], samplers: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """After the forward of ``batch`` (``schedule().batch``): each sequence's ``num_computed`` advances
        by its chunk, ``high_water`` with it, and its newly full blocks are committed to the prefix cache.
        Sequence 0 of a request with num_return_sequences = n > 1 forks the n - 1 others at its first
        sample: they share its blocks (copy-on-write later) and run from now on.

        samplers: the sequences whose last token was computed, in the order of the forward's logits rows.
        Returns (sequences to sample: ``samplers`` then the forks, the logits row of each: a fork
        samples from its parent's row)."""
        for seq, n in batch:
            seq.num_computed += n
            seq.high_water = max(seq.high_water, seq.num_computed)
            if self.prefix_cache is not None:
                self.prefix_cache.commit(seq.block_table, seq.token_ids, seq.block_hashes)
        sampled, rows = list(samplers), list(range(len(samplers)))
        for row, seq in enumerate(samplers):
            request = seq.request
            if seq.index == 0 and not request.forked and not request.cancelled:
                request.forked = True
                for index in range(1, request.params.num_return_sequences):
                    sampled.append(self._fork(seq, index))
                    rows.append(row)
        return sampled, rows

    # ------------------------------------------------------------ internals
    def _schedule_running(self, out: SchedulerOutput, decode: list, extend: list) -> tuple[int, bool]:
        """Running sequences in order, each its next chunk, preempting the newest while blocks lack.
        Returns (token budget left, whether anything was preempted)."""
        budget, running, pool = self.max_num_batched_tokens, self.running, self.pool
        preempted, i = False, 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            while seq.block_table.blocks_needed(pool, n) > pool.num_free:
                preempted = True
                if self.preempt_newest() is seq:
                    break
            if seq.status is not Status.RUNNING:
                break
            self._reserve(seq, n, out, decode, extend)
            budget -= n
            i += 1
        return budget, preempted

    def _admit_waiting(self, budget: int, out: SchedulerOutput, decode: list, extend: list) -> None:
        """Waiting sequences from the front while the budget, the sequence slots (with room for a
        request's forks) and the free blocks allow; the first that does not fit stops admission."""
        pool, running, waiting = self.pool, self.running, self.waiting
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            seq = waiting[0]
            if seq.status is not Status.WAITING:        # cancelled while waiting
                waiting.popleft()
                continue
            request = seq.request
            fan_out = request.params.num_return_sequences if not request.forked else 1
            if running and len(running) + fan_out > self.max_num_seqs:
                break
            hits, hashes = self._match(seq)
            computed = len(hits) * pool.block_size
            n = min(seq.num_tokens - computed, budget)
            revived = self.prefix_cache.blocks_to_revive(hits) if hits else 0
            # hits are whole blocks, so the n new tokens start a fresh block
            if revived + -(-n // pool.block_size) > pool.num_free:
                break
            waiting.popleft()
            self._start(seq, hits, hashes)
            running.append(seq)
            self._reserve(seq, n, out, decode, extend)
            budget -= n

    def _match(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Cached blocks for ``seq``'s first tokens; its last token is always computed (it samples)."""
        if self.prefix_cache is None or seq.request.needs_prompt_logprobs:
            return [], []          # prompt log-probabilities need the logits of every prompt position
        return self.prefix_cache.match(seq.token_ids, seq.num_tokens - 1)

    def _start(self, seq: Sequence, hits: list[int], hashes: list[int]) -> None:
        """Admitted ``seq`` runs from its prefix hits ``hits`` (block ids) with chain hashes ``hashes``."""
        computed = len(hits) * self.pool.block_size
        seq.block_table = self.prefix_cache.table_from_hits(hits) if hits else BlockTable()
        seq.block_hashes, seq.num_computed = hashes, computed
        self.counters.prefix_query_tokens += seq.num_tokens
        self.counters.prefix_hit_tokens += computed
        if seq.high_water == 0:
            seq.request.output.num_cached_tokens = max(seq.request.output.num_cached_tokens, computed)
        seq.status = Status.RUNNING

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput, decode: list, extend: list) -> None:
        """Slots for ``seq``'s next ``n`` tokens (copy-on-write pairs applied now, and into ``out.copies``);
        into the batch."""
        c = seq.num_computed
        copies: list[tuple[int, int]] = []
        seq.block_table.append(self.pool, n, copies)
        if copies:
            if self.copy_blocks is not None:
                self.copy_blocks(copies)
            out.copies.extend(copies)
        self.counters.recomputed_tokens += max(0, min(c + n, seq.high_water) - c)
        (decode if n == 1 else extend).append((seq, n))
        out.num_tokens += n

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        """Sequence ``index`` of ``parent``'s request: ``parent``'s tokens and blocks (shared), running."""
        child = self._new_sequence(parent.request, index, list(parent.token_ids))
        child.num_computed = child.high_water = parent.num_computed
        child.block_table = parent.block_table.fork(self.pool)
        child.block_hashes = list(parent.block_hashes)
        child.status = Status.RUNNING
        self.running.append(child)
        return child

    def _new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(next(self._seq_ids), request, index, token_ids)
        request.sequences.append(seq)
        return seq
