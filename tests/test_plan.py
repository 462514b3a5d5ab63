"""Exact-state tests of the step plan builders (``hf_paged.plan``): every field of the one ragged step
description, for generate's padded batches and the engine's packed forwards, and the padded view the
PyTorch reference derives from it."""
from __future__ import annotations

import pytest
import torch

from hf_paged.blocks import BlockTable
from hf_paged.plan import packed_plan, padded_plan, padded_view, plan_on

CPU = torch.device("cpu")


def as_lists(plan):
    return {name: getattr(plan, name).tolist() for name in
            ("slot_mapping", "token_row", "token_pos", "query_start", "block_tables", "context_lens", "decode_lens")}


def test_padded_prefill_plan():
    """Two left-padded rows of 3 columns, block size 4: row 0 has 2 real tokens, row 1 has 3."""
    tables = [BlockTable([5], 2), BlockTable([2], 3)]
    queries = torch.tensor([[False, True, True], [True, True, True]])
    plan = padded_plan(tables, queries, queries, [0, 0], [20, 21, 8, 9, 10], 4, CPU)
    assert as_lists(plan) == {
        "slot_mapping": [-1, 20, 21, 8, 9, 10], "token_row": [0, 0, 0, 1, 1, 1], "token_pos": [-1, 0, 1, 0, 1, 2],
        "query_start": [0, 3, 6], "block_tables": [[5], [2]], "context_lens": [2, 3], "decode_lens": []}
    assert (plan.num_decode, plan.max_context, plan.max_query_len, plan.decode_context, plan.batch_shape) == \
        (0, 3, 3, 0, (2, 3))
    assert not plan.is_decode and plan.num_tokens == 6 and plan.num_rows == 2
    view = padded_view(plan)
    assert view.index is None and view.query_pos.tolist() == [[-1, 0, 1], [0, 1, 2]]
    assert view.block_tables.tolist() == [[5], [2]] and view.context_lens.tolist() == [2, 3]


def test_padded_decode_plan_with_a_pad_row_and_a_row_that_writes_nothing():
    """Decode: row 0 real (stored 4 -> 5, a new block), row 1 a pad, row 2 shares row 0's blocks (a
    duplicate prompt row: it reads but writes nothing)."""
    tables = [BlockTable([1, 7], 5), BlockTable([3], 2), BlockTable([1, 7], 5)]
    queries = torch.tensor([[True], [False], [True]])
    writes = torch.tensor([[True], [False], [False]])
    plan = padded_plan(tables, queries, writes, [4, 2, 4], [28], 4, CPU)
    assert as_lists(plan) == {
        "slot_mapping": [28, -1, -1], "token_row": [0, 1, 2], "token_pos": [4, -1, 4], "query_start": [0, 1, 2, 3],
        "block_tables": [[1, 7], [3, 0], [1, 7]], "context_lens": [5, 2, 5], "decode_lens": [5, 0, 5]}
    assert plan.is_decode and plan.num_decode == 3 and plan.decode_context == 5 and plan.max_query_len == 1
    assert padded_view(plan) is None


def test_packed_plan_decodes_first_then_chunks():
    """Engine step: two decodes, then a fresh 3-token prompt and a 2-token chunk after 3 stored tokens."""
    entries = [(BlockTable([4, 6], 6), 5, 1), (BlockTable([0], 3), 2, 1), (BlockTable([9], 3), 0, 3),
               (BlockTable([2, 8], 5), 3, 2)]
    plan = packed_plan(entries, 4, CPU)
    assert as_lists(plan) == {
        "slot_mapping": [25, 2, 36, 37, 38, 11, 32], "token_row": [0, 1, 2, 2, 2, 3, 3],
        "token_pos": [5, 2, 0, 1, 2, 3, 4], "query_start": [0, 1, 2, 5, 7],
        "block_tables": [[4, 6], [0, 0], [9, 0], [2, 8]], "context_lens": [6, 3, 3, 5], "decode_lens": [6, 3]}
    assert (plan.num_decode, plan.max_context, plan.max_query_len, plan.decode_context, plan.batch_shape) == \
        (2, 6, 3, 6, (1, 7))
    view = padded_view(plan)
    assert view.query_pos.tolist() == [[0, 1, 2], [3, 4, -1]]
    assert view.index.tolist() == [0, 1, 2, 3, 4]
    assert view.block_tables.tolist() == [[9, 0], [2, 8]] and view.context_lens.tolist() == [3, 5]


def test_packed_plan_refuses_decodes_after_chunks():
    entries = [(BlockTable([1], 3), 0, 3), (BlockTable([2], 2), 1, 1)]
    with pytest.raises(ValueError, match="decode"):
        packed_plan(entries, 4, CPU)


def test_plan_on_moves_every_tensor_and_keeps_the_rest():
    plan = packed_plan([(BlockTable([3], 2), 1, 1)], 4, CPU)
    moved = plan_on(plan, torch.device("meta"))
    assert all(getattr(moved, n).device.type == "meta" for n in ("slot_mapping", "token_row", "token_pos",
                                                                 "query_start", "block_tables", "context_lens"))
    assert (moved.num_decode, moved.max_context, moved.batch_shape) == (plan.num_decode, plan.max_context, (1, 1))
