"""bench/host.py (the ``host`` section of ``python -m bench quick``) measures what the block layer and
``PagedCache.plan_step`` do per decode step; here the counts it reports are checked exactly (blocks
taken from the pool, copy-on-write copies), and one round of the timing runs. No time is asserted."""
from __future__ import annotations

import pytest

from bench import host

PROMPT_BLOCKS, CONTEXT_BLOCKS = host.PROMPT // host.BLOCK, host.CONTEXT // host.BLOCK


@pytest.mark.parametrize("batch", [1, 5])
def test_counts_per_step(batch):
    assert host.counts("allocate", batch) == {"blocks_taken": batch * PROMPT_BLOCKS, "copies": 0}
    assert host.counts("append", batch) == {"blocks_taken": batch, "copies": 0}      # last blocks were full
    assert host.counts("fork", batch) == {"blocks_taken": 0, "copies": 0}            # children share every block
    assert host.counts("release", batch) == {"blocks_taken": -batch * CONTEXT_BLOCKS, "copies": 0}
    assert host.counts("plan_step", batch) == {"blocks_taken": batch, "copies": 0}


def test_measure_reports_every_op_and_batch():
    out = host.measure(rounds=2, batches=(1, 3))
    assert set(out) == set(host.OPS)
    for op, per_batch in out.items():
        assert set(per_batch) == {"1", "3"}
        for batch, entry in per_batch.items():
            assert entry["us_per_seq"]["n"] == 2 and entry["rounds"] == 2
            assert entry["counts"] == host.counts(op, int(batch))
