"""Host-side cost of paging, without a model: ``pytest bench/test_host_overhead.py`` (pytest-benchmark).

Not part of the test suite (``testpaths = ["tests"]``). Each benchmark does one step for a batch of
B sequences; ``extra_info["us_per_seq"]`` is the mean time divided by B (µs per sequence per step).
Operations: allocate (new sequence + 256-token prompt), append (one decode token each), fork (one
child per sequence, as beam search does), free, and per-step planning (``build_plan``, decode).
"""
from __future__ import annotations

import pytest
import torch

from hf_paged.allocator import BlockAllocator
from hf_paged.backends import select_backend
from hf_paged.plan import build_plan

BATCHES = [1, 16, 256]
BLOCK = 16
PROMPT = 256
CONTEXT = 512  # tokens per sequence before the benchmarked decode step


def _allocator(batch: int, tokens: int) -> BlockAllocator:
    alloc = BlockAllocator(num_blocks=2 * batch * (tokens // BLOCK + 2), block_size=BLOCK)
    copies = []
    for seq in range(batch):
        alloc.add_sequence(seq)
        alloc.append(seq, tokens, copies)
    return alloc


def _record(benchmark, batch: int) -> None:
    benchmark.extra_info["batch"] = batch
    benchmark.extra_info["us_per_seq"] = benchmark.stats.stats.mean * 1e6 / batch


@pytest.mark.parametrize("batch", BATCHES)
def test_allocate(benchmark, batch):
    def setup():
        return (BlockAllocator(num_blocks=batch * (PROMPT // BLOCK + 1), block_size=BLOCK),), {}

    def allocate(alloc):
        copies = []
        for seq in range(batch):
            alloc.add_sequence(seq)
            alloc.append(seq, PROMPT, copies)

    benchmark.pedantic(allocate, setup=setup, rounds=50 if batch < 256 else 10)
    _record(benchmark, batch)


@pytest.mark.parametrize("batch", BATCHES)
def test_append_decode_step(benchmark, batch):
    alloc = _allocator(batch, CONTEXT)
    copies: list = []

    def step():
        for seq in range(batch):
            alloc.append(seq, 1, copies)

    benchmark.pedantic(step, rounds=200, iterations=1)  # crosses a block boundary every 16 rounds, as decode does
    _record(benchmark, batch)


@pytest.mark.parametrize("batch", BATCHES)
def test_fork(benchmark, batch):
    def setup():
        return (_allocator(batch, CONTEXT),), {}

    def fork(alloc):
        for seq in range(batch):
            alloc.fork(seq, batch + seq)

    benchmark.pedantic(fork, setup=setup, rounds=30 if batch < 256 else 10)
    _record(benchmark, batch)


@pytest.mark.parametrize("batch", BATCHES)
def test_free(benchmark, batch):
    def setup():
        return (_allocator(batch, CONTEXT),), {}

    def free(alloc):
        for seq in range(batch):
            alloc.free(seq)

    benchmark.pedantic(free, setup=setup, rounds=30 if batch < 256 else 10)
    _record(benchmark, batch)


@pytest.mark.parametrize("batch", BATCHES)
def test_plan_decode_step(benchmark, batch):
    """The per-step planning a decode forward does: allocator appends + ``build_plan`` tensors."""
    alloc = _allocator(batch, CONTEXT)
    backend = select_backend(torch.device("cpu"))
    queries = torch.ones(batch, 1, dtype=torch.bool)

    def step():
        copies, slots, before = [], [], []
        for seq in range(batch):
            before.append(alloc.tables[seq].num_tokens)
            slots.extend(alloc.append(seq, 1, copies))
        tables = [alloc.tables[s] for s in range(batch)]
        return build_plan(tables, queries, queries, before, slots, torch.device("cpu"), backend)

    benchmark.pedantic(step, rounds=100, iterations=1)
    _record(benchmark, batch)


@pytest.mark.parametrize("batch", BATCHES)
def test_cache_plan_step(benchmark, batch):
    """``PagedCache.plan_step`` for one decode forward: what the decoder pre-hook runs once per step
    (mask slice to the host, EOS check, appends, ``build_plan``). A 1-layer geometry keeps tensors small."""
    from transformers import LlamaConfig

    from hf_paged.cache import PagedCache

    config = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                         head_dim=64, vocab_size=128)
    rounds = 100
    cache = PagedCache(config, block_size=BLOCK, num_blocks=batch * ((CONTEXT + rounds) // BLOCK + 2))
    mask = torch.ones(batch, CONTEXT + rounds + 1, dtype=torch.int64)
    cache.plan_step(mask[:, :CONTEXT], None, batch, CONTEXT, torch.float32, torch.device("cpu"))
    tokens = torch.full((batch, 1), 7, dtype=torch.int64)

    def step():
        cols = cache.get_seq_length()
        cache.plan_step(mask[:, :cols + 1], tokens, batch, 1, torch.float32, torch.device("cpu"))

    benchmark.pedantic(step, rounds=rounds, iterations=1)
    _record(benchmark, batch)
