"""Host-side cost of paging, without a model (pytest-benchmark): part of the suite, where each
benchmark runs once as a test (pytest-benchmark's default), and timed by ``python -m bench quick``
(section "host"), which runs this file with ``--benchmark-json``.

Each benchmark does one step for a batch of B sequences; ``extra_info["us_per_seq"]`` is the mean
time divided by B (µs per sequence per step). Operations: allocate (new table + 256-token prompt),
append (one decode token each), fork (one child per sequence, as beam search does), release, and
per-step planning (``padded_plan``, decode).
"""
from __future__ import annotations

import pytest
import torch

from hf_paged.blocks import BlockPool, BlockTable
from hf_paged.plan import padded_plan

BATCHES = [1, 16, 256]
BLOCK = 16
PROMPT = 256
CONTEXT = 512  # tokens per sequence before the benchmarked decode step


def _filled(batch: int, tokens: int) -> tuple[BlockPool, list[BlockTable]]:
    pool = BlockPool(num_blocks=2 * batch * (tokens // BLOCK + 2), block_size=BLOCK)
    tables = [BlockTable() for _ in range(batch)]
    for table in tables:
        table.append(pool, tokens, [])
    return pool, tables


def _record(benchmark, batch: int) -> None:
    benchmark.extra_info["batch"] = batch
    if benchmark.stats is not None:      # None under --benchmark-disable
        benchmark.extra_info["us_per_seq"] = benchmark.stats.stats.mean * 1e6 / batch


@pytest.mark.parametrize("batch", BATCHES)
def test_allocate(benchmark, batch):
    def setup():
        return (BlockPool(num_blocks=batch * (PROMPT // BLOCK + 1), block_size=BLOCK),), {}

    def allocate(pool):
        copies = []
        for _ in range(batch):
            BlockTable().append(pool, PROMPT, copies)

    benchmark.pedantic(allocate, setup=setup, rounds=50 if batch < 256 else 10)
    _record(benchmark, batch)


@pytest.mark.parametrize("batch", BATCHES)
def test_append_decode_step(benchmark, batch):
    pool, tables = _filled(batch, CONTEXT)
    copies: list = []

    def step():
        for table in tables:
            table.append(pool, 1, copies)

    benchmark.pedantic(step, rounds=200, iterations=1)  # crosses a block boundary every 16 rounds, as decode does
    _record(benchmark, batch)


@pytest.mark.parametrize("batch", BATCHES)
def test_fork(benchmark, batch):
    def setup():
        return _filled(batch, CONTEXT), {}

    def fork(pool, tables):
        for table in tables:
            table.fork(pool)

    benchmark.pedantic(fork, setup=setup, rounds=30 if batch < 256 else 10)
    _record(benchmark, batch)


@pytest.mark.parametrize("batch", BATCHES)
def test_release(benchmark, batch):
    def setup():
        return _filled(batch, CONTEXT), {}

    def release(pool, tables):
        for table in tables:
            table.release(pool)

    benchmark.pedantic(release, setup=setup, rounds=30 if batch < 256 else 10)
    _record(benchmark, batch)


@pytest.mark.parametrize("batch", BATCHES)
def test_plan_decode_step(benchmark, batch):
    """The per-step planning a decode forward does: table appends + ``padded_plan`` tensors."""
    pool, tables = _filled(batch, CONTEXT)
    queries = torch.ones(batch, 1, dtype=torch.bool)

    def step():
        copies, slots, before = [], [], []
        for table in tables:
            before.append(table.num_tokens)
            slots.extend(table.append(pool, 1, copies))
        return padded_plan(tables, queries, queries, before, slots, BLOCK, torch.device("cpu"))

    benchmark.pedantic(step, rounds=100, iterations=1)
    _record(benchmark, batch)


@pytest.mark.parametrize("batch", BATCHES)
def test_cache_plan_step(benchmark, batch):
    """``PagedCache.plan_step`` for one decode forward: what the decoder pre-hook runs once per step
    (mask slice to the host, EOS check, appends, ``padded_plan``, backend prepare). A 1-layer geometry keeps tensors small."""
    from transformers import LlamaConfig

    from hf_paged.cache import PagedCache

    config = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                         head_dim=64, vocab_size=128)
    rounds = 100
    cache = PagedCache(config, block_size=BLOCK, num_blocks=batch * ((CONTEXT + rounds) // BLOCK + 2))
    mask = torch.ones(batch, CONTEXT + rounds + 1, dtype=torch.int64)
    cache.plan_step(mask[:, :CONTEXT], None, batch, CONTEXT, torch.float32, torch.device("cpu"))
    cache.end_step()                # as after each forward
    tokens = torch.full((batch, 1), 7, dtype=torch.int64)

    def step():
        cols = cache.get_seq_length()
        cache.plan_step(mask[:, :cols + 1], tokens, batch, 1, torch.float32, torch.device("cpu"))
        cache.end_step()

    benchmark.pedantic(step, rounds=rounds, iterations=1)
    _record(benchmark, batch)
