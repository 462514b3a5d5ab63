"""The scheduler alone, no model: the exact state after every ``schedule`` / ``postprocess`` / ``finish``
/ ``cancel`` — block tables, the pool's refcounts and free queue, statuses, ``num_computed``, queue
order, copy-on-write pairs, prefix hits and commits (vLLM v1's core tests' style).

``forward`` stands for the runner and the engine around ``postprocess``: the sequences whose chunk
reaches their last token sample, and each gets the token the test gives it. A fresh pool hands out
blocks 0, 1, 2, ... in order; a released block goes to the head of the free queue, or, when it
carries a prefix-cache hash, to the tail (kept). The last test is random: a fixed seed, printed,
and ``HF_PAGED_SEED=<int>`` runs another.
"""
from __future__ import annotations

import os
import random

import pytest

from hf_paged.blocks import BlockPool, PrefixCache
from hf_paged.engine.request import Request, SamplingParams, Status
from hf_paged.engine.scheduler import Scheduler
from hf_paged.engine.stats import EngineCounters

BS = 4


def params(n: int = 1) -> SamplingParams:
    return SamplingParams(max_new_tokens=8, max_length=None, min_new_tokens=None, min_length=0, do_sample=False,
                          temperature=1.0, top_k=None, top_p=1.0, eos_token_ids=frozenset(), pad_token_id=None,
                          stop_strings=(), num_return_sequences=n, seed=None)


def scheduler(num_blocks: int, budget: int = 32, max_num_seqs: int = 4, prefix: bool = True) -> Scheduler:
    pool = BlockPool(num_blocks, BS)
    return Scheduler(pool, PrefixCache(pool) if prefix else None, max_num_seqs, budget, EngineCounters())


def add(sched: Scheduler, request_id: int, prompt: list[int], n: int = 1) -> Request:
    request = Request(request_id, request_id, prompt, params(n))
    sched.add(request)
    return request


def forward(sched: Scheduler, out, tokens: dict | None = None) -> tuple[list, list]:
    """What happens between two schedules: postprocess, then each sampled sequence gets ``tokens[seq]``
    (by (request id, index); none when ``tokens`` is None). Returns postprocess's (sequences, rows)."""
    samplers = [seq for seq, n in out.batch if seq.num_computed + n == seq.num_tokens]
    sampled, rows = sched.postprocess(out.batch, samplers)
    for seq in sampled:
        if tokens is not None:
            seq.token_ids.append(tokens[seq.request.request_id, seq.index])
    return sampled, rows


def table(seq) -> tuple[list[int], int]:
    return seq.block_table.blocks, seq.block_table.num_tokens


def free_queue(sched: Scheduler) -> list[int]:
    return list(sched.pool.state()[1])


def check(sched: Scheduler) -> None:
    sched.pool.check_invariants(s.block_table.blocks for s in sched.running)
    if sched.prefix_cache is not None:
        sched.prefix_cache.check_invariants()
    assert all(s.status is Status.RUNNING for s in sched.running)
    assert not any(s.block_table.blocks for s in sched.waiting)


def test_chunked_prefill_under_the_token_budget():
    sched = scheduler(8, budget=6)
    a = add(sched, 0, list(range(10, 20)))                    # 10 tokens
    (a0,) = a.sequences
    assert a0.status is Status.WAITING and list(sched.waiting) == [a0]

    out = sched.schedule()
    assert out.batch == [(a0, 6)] and out.num_tokens == 6 and out.copies == []
    assert a0.status is Status.RUNNING and sched.running == [a0] and not sched.waiting
    assert table(a0) == ([0, 1], 6) and a0.num_computed == 0          # slots reserved, not yet computed
    assert sched.pool.num_free == 6
    assert forward(sched, out) == ([], [])                            # the prompt is not done: no sample
    assert a0.num_computed == a0.high_water == 6
    assert len(a0.block_hashes) == 1 and sched.prefix_cache.num_hashed == 1   # block 0 is full: committed

    out = sched.schedule()
    assert out.batch == [(a0, 4)] and table(a0) == ([0, 1, 2], 10) and sched.pool.num_free == 5
    assert forward(sched, out) == ([a0], [0])
    assert a0.num_computed == 10 and len(a0.block_hashes) == 2 and sched.prefix_cache.num_hashed == 2
    c = sched.counters
    assert (c.prefix_query_tokens, c.prefix_hit_tokens, c.recomputed_tokens, c.preemptions) == (10, 0, 0, 0)
    check(sched)


def test_one_token_entries_first_and_the_budget_shared():
    sched = scheduler(8, budget=4)
    b = add(sched, 0, list(range(10, 16)))                    # 6 tokens: 4 now, 2 next step
    out = sched.schedule()
    (b0,) = b.sequences
    assert out.batch == [(b0, 4)] and table(b0) == ([0], 4)
    forward(sched, out)
    a = add(sched, 1, [30])                                   # a one-token prompt joins behind b0
    c = add(sched, 2, [40, 41, 42])                           # the budget leaves it one token
    out = sched.schedule()
    (a0,), (c0,) = a.sequences, c.sequences
    assert sched.running == [b0, a0, c0]
    assert out.batch == [(a0, 1), (c0, 1), (b0, 2)] and out.num_tokens == 4
    assert table(b0) == ([0, 1], 6) and table(a0) == ([2], 1) and table(c0) == ([3], 1)
    assert forward(sched, out, {(0, 0): 7, (1, 0): 8}) == ([a0, b0], [0, 1])   # rows in batch order
    assert c0.num_computed == 1 and c0.num_tokens == 3
    check(sched)


def test_prefix_hits_revive_kept_blocks_and_duplicates_stay_unhashed():
    sched = scheduler(6)
    prompt = list(range(10, 19))                              # 9 tokens: blocks 0 and 1 full
    a = add(sched, 0, prompt)
    (a0,) = a.sequences
    forward(sched, sched.schedule(), {(0, 0): 99})
    assert table(a0) == ([0, 1, 2], 9) and sched.prefix_cache.num_hashed == 2
    sched.finish(a0, "stop")
    assert a0.status is Status.FINISHED and a0.finish_reason == "stop" and sched.running == []
    assert table(a0) == ([], 0)
    assert free_queue(sched) == [2, 3, 4, 5, 1, 0]             # plain block 2 first; hashed 1, 0 kept at the tail
    assert sched.pool.num_kept == 2

    b = add(sched, 1, prompt[:8] + [50, 51])                  # hits both blocks (limit: 9 tokens)
    c = add(sched, 2, prompt[:8])                             # limit 7 tokens: hits block 0 only
    out = sched.schedule()
    (b0,), (c0,) = b.sequences, c.sequences
    assert out.batch == [(b0, 2), (c0, 4)] and out.copies == []
    assert table(b0) == ([0, 1, 2], 10) and b0.num_computed == 8 and b.output.num_cached_tokens == 8
    assert table(c0) == ([0, 3], 8) and c0.num_computed == 4 and c.output.num_cached_tokens == 4
    assert sched.pool.refcounts[:4] == [2, 1, 1, 1] and free_queue(sched) == [4, 5]
    counters = sched.counters
    assert (counters.prefix_query_tokens, counters.prefix_hit_tokens) == (9 + 10 + 8, 8 + 4)
    forward(sched, out)
    # c0's second block holds the tokens of block 1: same hash, so block 3 stays unhashed
    assert c0.block_hashes == b0.block_hashes[:2] and sched.prefix_cache.block_hash[3] is None
    assert sched.prefix_cache.num_hashed == 2
    check(sched)


def test_forks_share_blocks_then_copy_on_write_and_wait_for_slots():
    sched = scheduler(8, max_num_seqs=4)
    r = add(sched, 0, list(range(10, 15)), n=3)               # 5 tokens: blocks 0 (full) and 1 (1 token)
    out = sched.schedule()
    (r0,) = r.sequences
    assert out.batch == [(r0, 5)] and not r.forked
    sampled, rows = forward(sched, out, {(0, 0): 20, (0, 1): 21, (0, 2): 22})
    r0, r1, r2 = r.sequences
    assert r.forked and sampled == [r0, r1, r2] and rows == [0, 0, 0]
    assert [s.seq_id for s in r.sequences] == [0, 1, 2] and sched.running == [r0, r1, r2]
    for s in (r1, r2):
        assert s.status is Status.RUNNING and s.num_computed == s.high_water == 5
        assert s.block_hashes == r0.block_hashes and s.block_hashes is not r0.block_hashes
    assert [s.token_ids[-1] for s in (r0, r1, r2)] == [20, 21, 22]
    assert sched.pool.refcounts[:2] == [3, 3] and sched.pool.num_free == 6

    s = add(sched, 1, [30, 31], n=2)                          # 3 running + 2 > max_num_seqs: waits
    t = add(sched, 2, [40])                                   # behind it, in order
    out = sched.schedule()
    assert out.batch == [(r0, 1), (r1, 1), (r2, 1)]
    assert out.copies == [(1, 2), (1, 3)]                     # the last one to write keeps block 1
    assert table(r0) == ([0, 2], 6) and table(r1) == ([0, 3], 6) and table(r2) == ([0, 1], 6)
    assert sched.pool.refcounts[:4] == [3, 1, 1, 1]
    assert list(sched.waiting) == [s.sequences[0], t.sequences[0]] and s.sequences[0].status is Status.WAITING
    forward(sched, out, {(0, 0): 1, (0, 1): 1, (0, 2): 1})    # no second fork
    assert len(r.sequences) == 3

    sched.finish(r1, "length")                                # block 3 back to the head; block 0 still shared
    assert sched.running == [r0, r2] and sched.pool.refcounts[:4] == [2, 1, 1, 0] and free_queue(sched)[0] == 3
    out = sched.schedule()                                    # 2 running + 2 for s fit now, and t after it
    (s0,), (t0,) = s.sequences, t.sequences
    assert sched.running == [r0, r2, s0, t0] and not sched.waiting
    assert out.batch == [(r0, 1), (r2, 1), (t0, 1), (s0, 2)] and out.copies == []
    assert table(s0) == ([3], 2) and table(t0) == ([4], 1)
    check(sched)


def test_preemption_takes_the_newest_and_recomputes_it_later():
    sched = scheduler(4, prefix=False)
    a = add(sched, 0, list(range(10, 18)))                    # 8 tokens: blocks 0, 1 (full)
    b = add(sched, 1, list(range(20, 27)))                    # 7 tokens: blocks 2, 3
    (a0,), (b0,) = a.sequences, b.sequences
    forward(sched, sched.schedule(), {(0, 0): 90, (1, 0): 91})
    assert table(a0) == ([0, 1], 8) and table(b0) == ([2, 3], 7) and sched.pool.num_free == 0
    c = add(sched, 2, [50])

    out = sched.schedule()                                    # a0 needs a 3rd block: b0 (newest) goes
    assert out.batch == [(a0, 1)] and table(a0) == ([0, 1, 2], 9)
    assert b0.status is Status.WAITING and table(b0) == ([], 0) and b0.num_computed == 0 and b0.high_water == 7
    assert sched.running == [a0] and list(sched.waiting) == [b0, c.sequences[0]]    # nothing admitted
    assert free_queue(sched) == [3] and sched.counters.preemptions == 1
    forward(sched, out, {(0, 0): 92})

    sched.finish(a0, "length")
    assert free_queue(sched) == [0, 1, 2, 3]
    out = sched.schedule()                                    # b0 first again: its 8 tokens, 7 recomputed
    assert out.batch == [(c.sequences[0], 1), (b0, 8)] and table(b0) == ([0, 1], 8)
    assert sched.counters.recomputed_tokens == 7
    assert forward(sched, out) == ([c.sequences[0], b0], [0, 1]) and b0.num_computed == b0.high_water == 8
    check(sched)


def test_cancel_running_waiting_and_unforked():
    sched = scheduler(8, max_num_seqs=3)
    a = add(sched, 0, list(range(10, 15)))                    # runs: blocks 0, 1
    r = add(sched, 1, [5, 6, 7], n=3)                         # waits: 1 running + 3 > max_num_seqs
    b = add(sched, 2, [8, 9])                                 # waits behind it
    out = sched.schedule()
    (a0,), (r0,), (b0,) = a.sequences, r.sequences, b.sequences
    assert out.batch == [(a0, 5)] and list(sched.waiting) == [r0, b0]

    sched.cancel(a)
    assert a.cancelled and a0.status is Status.FINISHED and a0.finish_reason == "cancelled"
    assert sched.running == [] and table(a0) == ([], 0) and sched.pool.num_free == 8
    sched.cancel(r)                                           # before its fork: all 3 sequences end now
    assert r.cancelled and not r.forked
    assert [(s.index, s.seq_id, s.status, s.finish_reason) for s in r.sequences] == [
        (0, 1, Status.FINISHED, "cancelled"), (1, 3, Status.FINISHED, "cancelled"),
        (2, 4, Status.FINISHED, "cancelled")]
    assert list(sched.waiting) == [r0, b0] and sched.requests_waiting() == 1      # r0 leaves at the front
    with pytest.raises(ValueError, match="is finished: only a running sequence can finish"):
        sched.finish(r0, "length")
    out = sched.schedule()
    assert out.batch == [(b0, 2)] and not sched.waiting and sched.running == [b0]
    check(sched)


def test_cancel_after_the_fork_frees_the_shared_blocks():
    sched = scheduler(4)
    r = add(sched, 0, list(range(10, 16)), n=2)               # 6 tokens: block 0 full and committed
    forward(sched, sched.schedule(), {(0, 0): 1, (0, 1): 2})
    r0, r1 = r.sequences
    assert sched.pool.refcounts == [2, 2, 0, 0] and sched.running == [r0, r1]
    sched.cancel(r)
    assert [s.finish_reason for s in r.sequences] == ["cancelled", "cancelled"] and len(r.sequences) == 2
    assert sched.running == [] and not sched.has_work
    assert free_queue(sched) == [1, 2, 3, 0] and sched.pool.num_kept == 1         # block 0 kept for hits
    check(sched)


def test_random_operations_keep_the_invariants():
    """Random adds, steps, finishes and cancels on a tiny pool: after every operation the pool's
    refcounts match the running tables, only running sequences hold blocks, and ``running`` holds
    exactly the RUNNING sequences; at the end every block is free. ``HF_PAGED_SEED`` picks another run."""
    seed = int(os.environ.get("HF_PAGED_SEED") or 20261202)
    print(f"HF_PAGED_SEED={seed}")
    rng = random.Random(seed)
    sched = scheduler(12, budget=10, max_num_seqs=5)
    requests = []
    for step in range(400):
        if step < 300 and rng.random() < 0.5:
            prompt = [rng.randrange(3, 9) for _ in range(rng.randint(1, 14))]   # few ids: prefix hits
            requests.append(add(sched, len(requests), prompt, n=rng.randint(1, 3)))
        live = [r for r in requests if not r.finished]
        if live and rng.random() < 0.05:
            sched.cancel(rng.choice(live))
        check(sched)
        out = sched.schedule()
        check(sched)
        if not out.batch:
            assert not sched.has_work, f"stuck with work left (HF_PAGED_SEED={seed})"
            continue
        sampled, _ = forward(sched, out)
        for seq in sampled:
            seq.token_ids.append(rng.randrange(3, 9))
            if seq.num_output >= rng.randint(1, 6):
                sched.finish(seq, "length")
        check(sched)
        assert all(s.num_computed <= s.block_table.num_tokens <= s.num_tokens for s in sched.running)
    while sched.has_work:
        sampled, _ = forward(sched, sched.schedule())
        for seq in sampled:
            sched.finish(seq, "length")
    assert sched.pool.num_used == 0 and all(r.finished for r in requests), f"HF_PAGED_SEED={seed}"
    assert sched.counters.preemptions > 0 and sched.counters.prefix_hit_tokens > 0, f"HF_PAGED_SEED={seed}"
