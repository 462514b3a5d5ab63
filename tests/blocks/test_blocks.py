"""The block layer (pool, tables, prefix cache): exact state after each operation, and invariants
under random operation sequences (hypothesis)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged.blocks import BlockPool, BlockTable, PoolExhaustedError, PrefixCache, blocks_for_budget


def test_append_fills_blocks_in_order():
    pool = BlockPool(num_blocks=4, block_size=4)
    table = BlockTable()
    copies = []
    assert table.append(pool, 6, copies) == [0, 1, 2, 3, 4, 5]
    assert table.blocks == [0, 1] and table.num_tokens == 6
    assert table.append(pool, 1, copies) == [6]
    assert copies == [] and pool.num_used == 2 and pool.num_free == 2
    pool.check_invariants([table.blocks])


def test_fork_shares_and_copy_on_write_records_pair():
    pool = BlockPool(num_blocks=8, block_size=4)
    parent = BlockTable()
    copies = []
    parent.append(pool, 6, copies)                 # blocks [0, 1], last block half full
    child = parent.fork(pool)
    assert pool.refcounts[:2] == [2, 2] and pool.num_used == 2
    slots = child.append(pool, 1, copies)          # child writes into the shared half-full block: CoW
    assert copies == [(1, 2)]
    assert child.blocks == [0, 2] and slots == [2 * 4 + 2]
    assert pool.refcounts[:3] == [2, 1, 1]
    parent.append(pool, 1, copies)                 # parent now owns block 1 alone: no copy
    assert copies == [(1, 2)]
    pool.check_invariants([parent.blocks, child.blocks])
    parent.release(pool)
    child.release(pool)
    assert pool.num_used == 0
    pool.check_invariants([])


def test_full_shared_block_needs_no_copy():
    pool = BlockPool(num_blocks=8, block_size=4)
    parent = BlockTable()
    copies = []
    parent.append(pool, 4, copies)
    child = parent.fork(pool)
    child.append(pool, 1, copies)
    assert copies == [] and child.blocks == [0, 1]


def test_exhaustion_changes_nothing_and_names_the_knob():
    pool = BlockPool(num_blocks=2, block_size=4)
    table = BlockTable()
    table.append(pool, 5, [])
    with pytest.raises(PoolExhaustedError, match=r"needs 1 more blocks.*0 of 2 are free.*num_blocks"):
        table.append(pool, 4, [])
    assert table.num_tokens == 5 and pool.num_free == 0
    pool.check_invariants([table.blocks])


def test_truncate_and_grow_and_peak():
    pool = BlockPool(num_blocks=2, block_size=4)
    table = BlockTable()
    table.append(pool, 8, [])
    pool.grow(2)
    assert pool.num_blocks == 4 and pool.num_free == 2
    table.append(pool, 3, [])
    table.truncate(pool, 5)
    assert table.blocks == [0, 1] and pool.num_used == 2 and pool.peak_used == 3
    pool.check_invariants([table.blocks])


def test_invalid_arguments_and_budget_arithmetic():
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, block_size=0)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(-1, block_size=4)
    assert blocks_for_budget(1000, bytes_per_token=10, block_size=4, knob="x") == 25
    with pytest.raises(ValueError, match="max_memory_bytes=39 bytes holds no block.*Raise max_memory_bytes"):
        blocks_for_budget(39, bytes_per_token=10, block_size=4, knob="max_memory_bytes")


class Keeper:
    """A pool keeper that keeps the blocks it was told to and records evictions."""

    def __init__(self):
        self.kept, self.evictions = set(), []

    def keeps(self, block):
        return block in self.kept

    def evicted(self, block):
        self.kept.discard(block)
        self.evictions.append(block)


def test_kept_blocks_are_reused_last_and_revived_intact():
    keeper = Keeper()
    pool = BlockPool(num_blocks=4, block_size=2, keeper=keeper)
    table = BlockTable()
    table.append(pool, 4, [])
    keeper.kept = set(table.blocks)
    blocks = list(table.blocks)
    table.release(pool)
    assert pool.num_free == 4 and pool.num_kept == 2
    other = BlockTable()
    other.append(pool, 4, [])                      # the two plain free blocks go first
    assert not set(other.blocks) & set(blocks) and keeper.evictions == []
    for block in blocks:                           # revive: held again, no longer free
        pool.hold(block)
    assert pool.num_free == 0 and pool.num_kept == 0
    pool.check_invariants([other.blocks, blocks])


def test_lru_eviction_only_when_the_pool_needs_the_block():
    pool = BlockPool(num_blocks=4, block_size=2)
    cache = PrefixCache(pool)
    table = BlockTable()
    table.append(pool, 4, [])
    cache.commit(table, [5, 6, 7, 8], [])
    first, second = table.blocks
    table.release(pool)
    assert pool.num_free == 4 and pool.num_kept == 2
    assert cache.match([5, 6, 7, 8, 9], 5)[0] == [first, second]
    assert cache.match([5, 6, 7, 9], 4)[0] == [first]              # chained: the second block differs
    BlockTable().append(pool, 4, [])                                # the two uncached blocks go first
    assert pool.evictions == 0 and cache.match([5, 6, 7, 8], 4)[0] == [first, second]
    BlockTable().append(pool, 2, [])                                # then the LRU cached one: a prefix's tail
    assert pool.evictions == 1 and cache.match([5, 6, 7, 8], 4)[0] == [first]
    cache.check_invariants()


def test_prefix_hits_are_taken_back_and_a_collision_is_refused():
    pool = BlockPool(num_blocks=6, block_size=2)
    cache = PrefixCache(pool)
    table = BlockTable()
    table.append(pool, 5, [])
    hashes: list[int] = []
    cache.commit(table, [1, 2, 3, 4, 5], hashes)
    assert len(hashes) == 2
    hits, _ = cache.match([1, 2, 3, 4, 9], 4)
    assert hits == table.blocks[:2]
    assert cache.blocks_to_revive(hits) == 0
    table.release(pool)
    assert cache.blocks_to_revive(hits) == 2
    again = cache.table_from_hits(hits)
    assert again.num_tokens == 4 and pool.refcounts[hits[0]] == 1
    cache.block_tokens[hits[0]] = (7, 7)                            # a forged collision: never served
    assert cache.match([1, 2, 3, 4], 4)[0] == []
    pool.check_invariants([again.blocks])

OPS = st.lists(st.tuples(st.sampled_from(["add", "append", "fork", "free", "truncate", "grow"]),
                         st.integers(0, 5), st.integers(0, 40)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, block_size=st.sampled_from([1, 2, 4, 16]))
def test_invariants_hold_under_random_operations(ops, block_size):
    pool = BlockPool(num_blocks=12, block_size=block_size)
    live: list[BlockTable] = []
    for op, pick, amount in ops:
        target = live[pick % len(live)] if live else None
        if op == "add" or target is None:
            live.append(BlockTable())
        elif op == "append":
            before = (pool.num_free, list(target.blocks), target.num_tokens)
            copies = []
            try:
                slots = target.append(pool, amount, copies)
            except PoolExhaustedError:
                assert before == (pool.num_free, target.blocks, target.num_tokens)
            else:
                assert len(slots) == amount and len(set(slots)) == amount
                for src, dst in copies:
                    assert pool.refcounts[dst] == 1 and src != dst
                if slots:     # the new slots are the table's last positions, in order
                    n = target.num_tokens
                    expect = [target.blocks[j // block_size] * block_size + j % block_size for j in range(n - amount, n)]
                    assert slots == expect
        elif op == "fork":
            live.append(target.fork(pool))
        elif op == "free":
            target.release(pool)
            live.remove(target)
        elif op == "truncate":
            target.truncate(pool, amount % (target.num_tokens + 1))
        elif op == "grow":
            pool.grow(amount % 4)
        pool.check_invariants(t.blocks for t in live)
    for table in live:
        table.release(pool)
    assert pool.num_used == 0
    pool.check_invariants([])


@settings(max_examples=200, deadline=None)
@given(ops=OPS, block_size=st.sampled_from([1, 3, 4]))
def test_copy_on_write_keeps_every_sequence_content(ops, block_size):
    """Simulate the pool: apply the copy pairs and writes; every sequence reads back exactly its tokens."""
    blocks = BlockPool(num_blocks=16, block_size=block_size)
    tables: dict[int, BlockTable] = {}
    pool: dict[int, object] = {}
    history: dict[int, list] = {}
    next_id = 0
    for step, (op, pick, amount) in enumerate(ops):
        live = list(history)
        target = live[pick % len(live)] if live else None
        if op in ("add", "grow") or target is None:
            next_id += 1
            tables[next_id] = BlockTable()
            history[next_id] = []
        elif op == "append":
            copies = []
            try:
                slots = tables[target].append(blocks, amount % 7, copies)
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
            tables[next_id] = tables[target].fork(blocks)
            history[next_id] = list(history[target])
        elif op == "free":
            tables.pop(target).release(blocks)
            del history[target]
        elif op == "truncate":
            keep = amount % (len(history[target]) + 1)
            tables[target].truncate(blocks, keep)
            del history[target][keep:]
        for seq, tokens in history.items():
            held = tables[seq].blocks
            read = [pool.get(held[j // block_size] * block_size + j % block_size) for j in range(len(tokens))]
            assert read == tokens, f"sequence {seq} reads back other data"


PREFIX_OPS = st.lists(st.tuples(st.sampled_from(["start", "extend", "fork", "release"]),
                                st.integers(0, 7), st.integers(1, 9)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops=PREFIX_OPS, block_size=st.sampled_from([1, 2, 4]))
def test_prefix_cache_serves_only_stored_tokens_under_random_operations(ops, block_size):
    """Sequences over a tiny vocabulary (many shared prefixes) start from prefix hits, grow, fork and
    release in random order on a small pool: every hit's blocks hold exactly the tokens asked for,
    and pool and cache invariants hold after every operation."""
    pool = BlockPool(num_blocks=10, block_size=block_size)
    cache = PrefixCache(pool)
    stored: dict[int, int] = {}            # slot -> token written there (the pool's content)
    live: list[tuple[BlockTable, list[int], list[int]]] = []      # (table, token ids, chain hashes)

    def write(table, tokens, start):
        copies = []
        slots = table.append(pool, len(tokens) - start, copies)
        for src, dst in copies:
            for off in range(block_size):
                stored[dst * block_size + off] = stored.get(src * block_size + off)
        for slot, token in zip(slots, tokens[start:]):
            stored[slot] = token

    for op, pick, amount in ops:
        if op == "start" or not live:
            tokens = [(pick + i) % 3 for i in range(amount)]
            hits, hashes = cache.match(tokens, len(tokens) - 1)
            cached = len(hits) * block_size
            new = BlockTable(list(hits), cached)
            need = cache.blocks_to_revive(hits) + new.blocks_needed(pool, len(tokens) - cached)
            if need > pool.num_free:
                continue
            table = cache.table_from_hits(hits)
            assert [stored.get(s) for s in table.slots(0, cached, block_size)] == tokens[:cached]
            write(table, tokens, cached)
            cache.commit(table, tokens, hashes)
            live.append((table, tokens, hashes))
        else:
            table, tokens, hashes = live[pick % len(live)]
            if op == "extend":
                more = tokens + [amount % 3] * amount
                if table.blocks_needed(pool, amount) > pool.num_free:
                    continue
                write(table, more, len(tokens))
                tokens[:] = more
                cache.commit(table, tokens, hashes)
            elif op == "fork":
                live.append((table.fork(pool), list(tokens), list(hashes)))
            else:
                table.release(pool)
                live.remove((table, tokens, hashes))
        pool.check_invariants(t.blocks for t, _, _ in live)
        cache.check_invariants()
        for table, tokens, _ in live:
            assert [stored.get(s) for s in table.slots(0, table.num_tokens, block_size)] == tokens
