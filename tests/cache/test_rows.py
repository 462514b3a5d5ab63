"""Exact-state tests of the row book (``hf_paged.cache.rows``): generate's rows, their finished (parked)
blocks, resumption, loss when the pool reuses parked blocks, beam reorders and crops — the pool's
refcounts and free queue checked after every operation."""
from __future__ import annotations

import pytest
import torch

from hf_paged.blocks import BlockPool
from hf_paged.cache.rows import RowBook


def book_with_rows(tokens: list[int], num_blocks: int = 8, block_size: int = 4) -> RowBook:
    """A row book whose rows hold ``tokens`` stored tokens each, appended in row order."""
    book = RowBook(BlockPool(num_blocks, block_size))
    book.start(len(tokens))
    for table, n in zip(book.tables, tokens):
        table.append(book.pool, n, [])
    book.written.append(torch.ones(len(tokens), max(tokens), dtype=torch.bool))
    book.columns = max(tokens)
    return book


def test_rows_take_blocks_in_queue_order():
    book = book_with_rows([5, 3])
    assert [t.blocks for t in book.tables] == [[0, 1], [2]]
    assert book.pool.state() == ((1, 1, 1, 0, 0, 0, 0, 0), (3, 4, 5, 6, 7), ())
    book.check_invariants()


def test_finish_parks_blocks_and_resume_takes_them_back():
    book = book_with_rows([5, 3])
    book.finish(0, column=5)
    assert book.finished == [True, False] and book.finish_column == [5, 0]
    assert book.tables[0].blocks == [] and book.pool.refcounts[:3] == [0, 0, 1]
    # kept blocks go to the queue's tail, released last to first: plain free blocks are used first, and a
    # row's first block is evicted last
    assert book.pool.state() == ((0, 0, 1, 0, 0, 0, 0, 0), (3, 4, 5, 6, 7, 1, 0), (0, 1))
    assert book.keeps(0) and book.keeps(1) and not book.keeps(2)
    book.check_invariants()
    book.check_resumable(0, torch.ones(2, 5, dtype=torch.bool))
    book.resume(0)
    assert book.finished == [False, False] and book.tables[0].blocks == [0, 1] and book.tables[0].num_tokens == 5
    assert book.pool.state() == ((1, 1, 1, 0, 0, 0, 0, 0), (3, 4, 5, 6, 7), ())
    book.check_invariants()


def test_a_parked_block_taken_by_the_pool_loses_the_row():
    book = book_with_rows([5, 3], num_blocks=4)
    book.finish(0, column=5)
    assert book.pool.state()[1] == (3, 1, 0)
    book.tables[1].append(book.pool, 2, [])          # row 1: 3 -> 5 tokens, takes plain block 3
    book.tables[1].append(book.pool, 4, [])          # 5 -> 9: takes kept block 1, which loses row 0
    assert book.tables[1].blocks == [2, 3, 1] and book.pool.evictions == 1
    # row 0's other parked block is no longer kept: a plain free block again
    assert not book.keeps(0) and book.pool.state() == ((0, 1, 1, 1), (0,), ())
    with pytest.raises(ValueError, match="reused by other rows"):
        book.check_resumable(0, torch.ones(2, 9, dtype=torch.bool))
    book.check_invariants()


def test_resuming_a_row_whose_skipped_columns_are_real_is_refused():
    book = book_with_rows([5, 3])
    book.finish(0, column=3)
    book.columns = 5
    mask = torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="columns 3..4"):
        book.check_resumable(0, mask)
    mask[0, 3:] = False
    book.check_resumable(0, mask)


def test_reorder_forks_tables_without_copying():
    book = book_with_rows([5, 3])
    book.reorder([1, 1])
    assert [t.blocks for t in book.tables] == [[2], [2]] and book.pool.refcounts[:3] == [0, 0, 2]
    assert book.pool.state()[1] == (0, 1, 3, 4, 5, 6, 7)
    assert book.written[0].shape == (2, 5)
    book.check_invariants()


def test_crop_truncates_live_rows_and_the_parked_tables_of_finished_ones_cut_short():
    """A finished row cut short keeps its parked prefix (kept, resumable: "regenerate the answer")."""
    book = book_with_rows([5, 3])
    book.finish(1, column=3)
    book.crop(2)
    assert book.tables[0].blocks == [0] and book.tables[0].num_tokens == 2 and book.columns == 2
    assert book.finish_column == [0, 2] and book.keeps(2)
    assert book.pool.state() == ((1, 0, 0, 0, 0, 0, 0, 0), (1, 3, 4, 5, 6, 7, 2), (2,))
    book.check_invariants()
    book.resume(1)
    assert book.tables[1].blocks == [2] and book.tables[1].num_tokens == 2
    assert book.pool.state() == ((1, 0, 1, 0, 0, 0, 0, 0), (1, 3, 4, 5, 6, 7), ())
    book.check_invariants()
    book = book_with_rows([5, 6])
    book.finish(1, column=6)
    book.crop(3)                                             # its second block goes back plain free
    assert book._parked[1].blocks == [2] and not book.keeps(3) and book.keeps(2)
    book.check_invariants()


def test_clear_returns_every_block():
    book = book_with_rows([5, 3])
    book.finish(1, column=3)
    book.clear()
    assert len(book) == 0 and book.columns == 0 and book.pool.num_free == 8 and book.pool.num_kept == 0
    book.check_invariants()
