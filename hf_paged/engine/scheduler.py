"""Scheduler: which sequences run in the next forward, and how many of their tokens.

One token budget (``max_num_batched_tokens``) per step, spent first on running sequences in arrival
order (a decode needs one token; a sequence mid-prefill gets the next chunk), then on waiting ones
while sequence slots (``max_num_seqs``) and blocks allow (vLLM v1's unified schedule: a sequence
simply has ``num_tokens`` and ``num_computed``; prefill, chunked prefill, decode and recomputation
after preemption are the same thing). When a running sequence needs a block and none is free, the
newest running sequence is preempted: its blocks go back (its full blocks stay in the prefix cache)
and it waits at the front of the queue, to be recomputed later.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..blocks import BlockPool, BlockTable, PrefixCache
from .request import Sequence, Status
from .stats import EngineCounters


@dataclass
class SchedulerOutput:
    """batch: (sequence, tokens to compute), one-token entries first; copies: copy-on-write block pairs."""
    batch: list[tuple[Sequence, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    num_tokens: int = 0


class Scheduler:
    def __init__(self, pool: BlockPool, prefix_cache: PrefixCache | None, max_num_seqs: int,
                 max_num_batched_tokens: int, counters: EngineCounters):
        self.pool, self.prefix_cache = pool, prefix_cache
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.counters = counters        # the engine's; the scheduler adds preemptions and prefix hits

    @property
    def has_work(self) -> bool:
        return bool(self.running) or any(s.status is Status.WAITING for s in self.waiting)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out, pool = SchedulerOutput(), self.pool
        budget = self.max_num_batched_tokens
        decode, extend = [], []
        running, preempted = self.running, False
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            while seq.block_table.blocks_needed(pool, n) > pool.num_free:
                victim = running.pop()
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break
            self._schedule(seq, n, out, decode, extend)
            budget -= n
            i += 1
        while self.waiting and budget > 0 and not preempted and len(running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.status is not Status.WAITING:        # cancelled while waiting
                self.waiting.popleft()
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
            self.waiting.popleft()
            seq.block_table = self.prefix_cache.table_from_hits(hits) if hits else BlockTable()
            seq.block_hashes, seq.num_computed = hashes, computed
            self.counters.prefix_query_tokens += seq.num_tokens
            self.counters.prefix_hit_tokens += computed
            if seq.high_water == 0:
                request.output.num_cached_tokens = max(request.output.num_cached_tokens, computed)
            seq.status = Status.RUNNING
            running.append(seq)
            self._schedule(seq, n, out, decode, extend)
            budget -= n
        out.batch = decode + extend
        return out

    def _match(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Cached blocks for ``seq``'s first tokens; its last token is always computed (it samples)."""
        if self.prefix_cache is None:
            return [], []
        return self.prefix_cache.match(seq.token_ids, seq.num_tokens - 1)

    def _schedule(self, seq: Sequence, n: int, out: SchedulerOutput, decode: list, extend: list) -> None:
        c = seq.num_computed
        seq.block_table.append(self.pool, n, out.copies)
        self.counters.recomputed_tokens += max(0, min(c + n, seq.high_water) - c)
        (decode if n == 1 else extend).append((seq, n))
        out.num_tokens += n

    def release(self, seq: Sequence) -> None:
        """``seq``'s blocks go back to the pool (hashed full blocks stay kept for prefix hits)."""
        seq.block_table.release(self.pool)

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks; it waits at the front of the queue and is recomputed from its tokens."""
        self.release(seq)
        seq.block_hashes, seq.num_computed, seq.status = [], 0, Status.WAITING
        self.waiting.appendleft(seq)
        self.counters.preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """``seq`` is done: its blocks go back now (it leaves ``running`` at ``drop_finished``)."""
        self.release(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def drop_finished(self) -> None:
        self.running = [s for s in self.running if s.status is Status.RUNNING]
