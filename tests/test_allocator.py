"""BlockAllocator: exact state after each operation, and invariants under random operation sequences."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged.allocator import BlockAllocator, PoolExhaustedError


def test_append_fills_blocks_in_order():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    alloc.add_sequence(1)
    copies = []
    assert alloc.append(1, 6, copies) == [0, 1, 2, 3, 4, 5]
    assert alloc.tables[1].blocks == [0, 1] and alloc.tables[1].num_tokens == 6
    assert alloc.append(1, 1, copies) == [6]
    assert copies == [] and alloc.num_used == 2 and alloc.num_free == 2
    alloc.check_invariants()


def test_fork_shares_and_copy_on_write_records_pair():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    alloc.add_sequence(1)
    copies = []
    alloc.append(1, 6, copies)                   # blocks [0, 1], last block half full
    alloc.fork(1, 2)
    assert alloc.refcounts[:2] == [2, 2] and alloc.num_used == 2
    slots = alloc.append(2, 1, copies)           # child writes into the shared half-full block: CoW
    assert copies == [(1, 2)]
    assert alloc.tables[2].blocks == [0, 2] and slots == [2 * 4 + 2]
    assert alloc.refcounts[:3] == [2, 1, 1]
    alloc.append(1, 1, copies)                   # parent now owns block 1 alone: no copy
    assert copies == [(1, 2)]
    alloc.check_invariants()
    alloc.free(1)
    alloc.free(2)
    assert alloc.num_used == 0
    alloc.check_invariants()


def test_full_shared_block_needs_no_copy():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    alloc.add_sequence(1)
    copies = []
    alloc.append(1, 4, copies)
    alloc.fork(1, 2)
    alloc.append(2, 1, copies)
    assert copies == [] and alloc.tables[2].blocks == [0, 1]


def test_exhaustion_changes_nothing_and_names_the_knob():
    alloc = BlockAllocator(num_blocks=2, block_size=4)
    alloc.add_sequence(1)
    alloc.append(1, 5, [])
    with pytest.raises(PoolExhaustedError, match=r"needs 1 more blocks.*0 of 2 are free.*num_blocks"):
        alloc.append(1, 4, [])
    assert alloc.tables[1].num_tokens == 5 and alloc.num_free == 0
    alloc.check_invariants()


def test_truncate_and_grow_and_peak():
    alloc = BlockAllocator(num_blocks=2, block_size=4)
    alloc.add_sequence(1)
    alloc.append(1, 8, [])
    alloc.grow(2)
    assert alloc.num_blocks == 4 and alloc.num_free == 2
    alloc.append(1, 3, [])
    alloc.truncate(1, 5)
    assert alloc.tables[1].blocks == [0, 1] and alloc.num_used == 2 and alloc.peak_used == 3
    alloc.check_invariants()


def test_invalid_arguments():
    with pytest.raises(ValueError, match="block_size"):
        BlockAllocator(4, block_size=0)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(-1)


OPS = st.lists(st.tuples(st.sampled_from(["add", "append", "fork", "free", "truncate", "grow"]),
                         st.integers(0, 5), st.integers(0, 40)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, block_size=st.sampled_from([1, 2, 4, 16]))
def test_invariants_hold_under_random_operations(ops, block_size):
    alloc = BlockAllocator(num_blocks=12, block_size=block_size)
    live: list[int] = []
    next_id = 0
    for op, pick, amount in ops:
        target = live[pick % len(live)] if live else None
        if op == "add" or target is None:
            next_id += 1
            alloc.add_sequence(next_id)
            live.append(next_id)
        elif op == "append":
            before = (alloc.num_free, list(alloc.tables[target].blocks), alloc.tables[target].num_tokens)
            copies = []
            try:
                slots = alloc.append(target, amount, copies)
            except PoolExhaustedError:
                assert before == (alloc.num_free, alloc.tables[target].blocks, alloc.tables[target].num_tokens)
            else:
                table = alloc.tables[target]
                assert len(slots) == amount and len(set(slots)) == amount
                for src, dst in copies:
                    assert alloc.refcounts[dst] == 1 and src != dst
                if slots:     # the new slots are the table's last positions, in order
                    n = table.num_tokens
                    expect = [table.blocks[j // block_size] * block_size + j % block_size for j in range(n - amount, n)]
                    assert slots == expect
        elif op == "fork":
            next_id += 1
            alloc.fork(target, next_id)
            live.append(next_id)
        elif op == "free":
            alloc.free(target)
            live.remove(target)
        elif op == "truncate":
            alloc.truncate(target, amount % (alloc.tables[target].num_tokens + 1))
        elif op == "grow":
            alloc.grow(amount % 4)
        alloc.check_invariants()
    for seq in live:
        alloc.free(seq)
    assert alloc.num_used == 0
    alloc.check_invariants()


@settings(max_examples=200, deadline=None)
@given(ops=OPS, block_size=st.sampled_from([1, 3, 4]))
def test_copy_on_write_keeps_every_sequence_content(ops, block_size):
    """Simulate the pool: apply the copy pairs and writes; every sequence reads back exactly its tokens."""
    alloc = BlockAllocator(num_blocks=16, block_size=block_size)
    pool: dict[int, object] = {}
    history: dict[int, list] = {}
    next_id = 0
    for step, (op, pick, amount) in enumerate(ops):
        live = list(history)
        target = live[pick % len(live)] if live else None
        if op in ("add", "grow") or target is None:
            next_id += 1
            alloc.add_sequence(next_id)
            history[next_id] = []
        elif op == "append":
            copies = []
            try:
                slots = alloc.append(target, amount % 7, copies)
            except PoolExhaustedError:
                continue
            for src, dst in copies:
                for off in range(block_size):
                    pool[dst * block_size + off] = pool.get(src * block_size + off)
            for i, slot in enumerate(slots):
                token = (target, step, i)
                pool[slot] = token
                history[target].append(token)
        elif op == "fork":
            next_id += 1
            alloc.fork(target, next_id)
            history[next_id] = list(history[target])
        elif op == "free":
            alloc.free(target)
            del history[target]
        elif op == "truncate":
            keep = amount % (len(history[target]) + 1)
            alloc.truncate(target, keep)
            del history[target][keep:]
        for seq, tokens in history.items():
            blocks = alloc.tables[seq].blocks
            read = [pool.get(blocks[j // block_size] * block_size + j % block_size) for j in range(len(tokens))]
            assert read == tokens, f"sequence {seq} reads back other data"
