"""Host-side cost of paging, without a model: the ``host`` section of ``python -m bench quick`` / ``full``.

Each operation does one step for a batch of B sequences (B in ``BATCHES``): ``allocate`` (a new table
and a 256-token prompt each), ``append`` (one decode token each, on 512-token tables whose last block is
full), ``fork`` (one child per sequence, as beam search does), ``release`` (every table of 512 tokens),
and ``plan_step`` (``PagedCache.plan_step`` + ``end_step`` for one decode forward on a 1-layer geometry:
the mask to the host, the EOS check, appends, the step's plan, the backend's preparation).

``measure`` times ``rounds`` calls of each (``time.perf_counter`` around the step alone, state rebuilt
outside the timing where the step consumes it) and reports µs per sequence, min / median / max over
the rounds. ``counts`` gives what one step does to the pool (blocks taken, copy-on-write copies), which
``tests/bench/test_host.py`` checks exactly: the bench asserts counts, never times.
"""
from __future__ import annotations

import time

from .common import spread

BATCHES = (1, 16, 256)
BLOCK = 16
PROMPT = 256
CONTEXT = 512  # tokens per sequence before the measured step: 32 full blocks


def _filled(batch: int, tokens: int = CONTEXT):
    from hf_paged.blocks import BlockPool, BlockTable

    pool = BlockPool(num_blocks=2 * batch * (tokens // BLOCK + 2), block_size=BLOCK)
    tables = [BlockTable() for _ in range(batch)]
    for table in tables:
        table.append(pool, tokens, [])
    return {"pool": pool, "tables": tables, "copies": []}


def _empty(batch: int):
    from hf_paged.blocks import BlockPool

    return {"pool": BlockPool(num_blocks=batch * (PROMPT // BLOCK + 1), block_size=BLOCK), "tables": [], "copies": []}


def _allocate(state, batch: int) -> None:
    from hf_paged.blocks import BlockTable

    for _ in range(batch):
        table = BlockTable()
        table.append(state["pool"], PROMPT, state["copies"])
        state["tables"].append(table)


def _append(state, batch: int) -> None:
    for table in state["tables"]:
        table.append(state["pool"], 1, state["copies"])


def _fork(state, batch: int) -> None:
    state["children"] = [table.fork(state["pool"]) for table in state["tables"]]


def _release(state, batch: int) -> None:
    for table in state["tables"]:
        table.release(state["pool"])


def _cache(batch: int, extra_steps: int = 256):
    """A PagedCache of one small layer after a 512-token prefill of ``batch`` rows."""
    import torch
    from transformers import LlamaConfig

    from hf_paged import PagedCache

    config = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                         head_dim=64, vocab_size=128)
    cache = PagedCache(config, block_size=BLOCK, num_blocks=batch * ((CONTEXT + extra_steps) // BLOCK + 2))
    mask = torch.ones(batch, CONTEXT + extra_steps + 1, dtype=torch.int64)
    cache.plan_step(mask[:, :CONTEXT], None, batch, CONTEXT, torch.float32, torch.device("cpu"))
    cache.end_step()
    return {"cache": cache, "mask": mask, "tokens": torch.full((batch, 1), 7, dtype=torch.int64)}


def _plan_step(state, batch: int) -> None:
    import torch

    cache = state["cache"]
    cols = cache.get_seq_length()
    cache.plan_step(state["mask"][:, :cols + 1], state["tokens"], batch, 1, torch.float32, torch.device("cpu"))
    cache.end_step()


# name -> (build the state for a batch, the step, whether the step consumes its state: rebuilt every round)
OPS = {"allocate": (_empty, _allocate, True), "append": (_filled, _append, False),
       "fork": (_filled, _fork, True), "release": (_filled, _release, True), "plan_step": (_cache, _plan_step, False)}


def _blocks_used(state) -> int:
    if "cache" in state:
        return state["cache"].stats()["blocks_used"]
    return state["pool"].num_used


def counts(op: str, batch: int) -> dict:
    """What one step of ``op`` does for ``batch`` sequences: blocks taken from the pool (negative: given
    back) and copy-on-write copies recorded."""
    build, step, _ = OPS[op]
    state = build(batch)
    before, copies = _blocks_used(state), len(state.get("copies", []))
    step(state, batch)
    return {"blocks_taken": _blocks_used(state) - before, "copies": len(state.get("copies", [])) - copies}


def measure(rounds: int = 50, batches=BATCHES) -> dict:
    """``{op: {str(batch): {"us_per_seq": min/median/max, "rounds", "counts"}}}``. ``append`` and
    ``plan_step`` run ``rounds`` consecutive decode steps, crossing a block boundary every 16, as decode does."""
    out: dict = {}
    for op, (build, step, fresh) in OPS.items():
        for batch in batches:
            state, times = build(batch), []
            for _ in range(rounds):
                if fresh and times:
                    state = build(batch)
                t0 = time.perf_counter()
                step(state, batch)
                times.append((time.perf_counter() - t0) * 1e6 / batch)
            out.setdefault(op, {})[str(batch)] = {"us_per_seq": spread(times), "rounds": rounds,
                                                  "counts": counts(op, batch)}
    return out
