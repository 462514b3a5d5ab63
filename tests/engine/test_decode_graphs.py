"""Decode steps on static per-bucket buffers (hf_paged.engine.graphs), tested as far as a CPU allows: the
buckets, the buffers and their pad rows, bucketed-padded eager steps against the default engine's, and the
first-use check's fallback with fake captures. The CUDA capture itself runs only on a GPU (bench/gpu_check)."""
from __future__ import annotations

import logging

import pytest
import torch

from tiny_models import VOCAB, make_model
from hf_paged.blocks import BlockTable
from hf_paged.engine import Engine
from hf_paged.engine.graphs import DecodeBuffers, bucket_for, capture_sizes, eager_replay
from hf_paged.plan import packed_plan


def engine_with(capture, model, **knobs) -> Engine:
    """An engine whose decode steps go through ``capture`` (on the CPU the default is eager steps)."""
    class GraphEngine(Engine):
        def _graph_capture(self, device, geometry):
            return capture
    return GraphEngine(model, **knobs)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(n),), generator=gen).tolist()
            for n in torch.randint(1, 20, (count,), generator=gen)]


def run(engine: Engine, requests, logits_log=None) -> list[list[int]]:
    """Greedy outputs of ``requests``; ``logits_log`` collects every step's logits."""
    if logits_log is not None:
        execute = engine.runner.execute

        def logged(batch):
            result = execute(batch)
            logits_log.append(result[0].clone())
            return result
        engine.runner.execute = logged
    ids = [engine.add_request(p, max_new_tokens=6, do_sample=False, ignore_eos=True) for p in requests]
    engine.run()
    return [engine.output(i).completions[0].token_ids for i in ids]


def test_capture_sizes_are_vllms_and_buckets_are_the_smallest_that_fit():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(12) == [1, 2, 4, 8, 16]
    assert capture_sizes(1) == [1]
    sizes = capture_sizes(40)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 9, 17, 40)] == [1, 2, 4, 8, 16, 24, 40]
    assert bucket_for(41, sizes) is None


class _Seq:
    """The fields of an engine Sequence that a decode row reads."""
    def __init__(self, blocks, computed, token):
        self.block_table = BlockTable(blocks, computed + 1)
        self.num_computed, self.token_ids = computed, [0] * computed + [token]


def test_buffers_hold_the_packed_plans_rows_and_pads_touch_only_the_scratch_block():
    bs, scratch, width = 4, 9, 5
    seqs = [_Seq([3, 5], 5, 11), _Seq([7], 0, 12), _Seq([1, 2, 4], 11, 13)]
    buffers = DecodeBuffers.new(8, width, bs, scratch, torch.device("cpu"))
    buffers.fill([(s, 1) for s in seqs])
    want = packed_plan([(s.block_table, s.num_computed, 1) for s in seqs], bs, torch.device("cpu"))
    got = buffers.plan
    n = len(seqs)
    assert torch.equal(got.slot_mapping[:n], want.slot_mapping)
    assert torch.equal(got.token_pos[:n], want.token_pos)
    assert torch.equal(got.context_lens[:n], want.context_lens)
    assert torch.equal(got.decode_lens[:n], want.decode_lens)
    for row, s in enumerate(seqs):      # the used blocks as the packed plan's; the rest name the scratch block
        used = s.num_computed // bs + 1
        assert torch.equal(got.block_tables[row, :used], want.block_tables[row, :used])
        assert (got.block_tables[row, used:] == scratch).all()
    assert torch.equal(buffers.input_ids[0, :n], torch.tensor([11, 12, 13]))
    assert torch.equal(buffers.position_ids[0, :n], want.token_pos.long())
    # Pad rows: slot in the scratch block, tables naming only it, one stored key (their own), position 0.
    assert (got.slot_mapping[n:] // bs == scratch).all()
    assert (got.block_tables[n:] == scratch).all()
    assert (got.context_lens[n:] == 1).all() and (got.token_pos[n:] == 0).all()
    assert got.writes_all and got.is_decode and got.num_tokens == 8
    # A refill with fewer rows leaves no trace of the earlier ones in the rows that became pads.
    buffers.fill([(seqs[0], 1)])
    assert (got.block_tables[1:] == scratch).all() and (got.slot_mapping[1:] // bs == scratch).all()


def test_a_row_wider_than_the_buckets_tables_is_refused():
    buffers = DecodeBuffers.new(2, 2, 4, 9, torch.device("cpu"))
    with pytest.raises(ValueError, match="enforce_eager"):
        buffers.fill([(_Seq([1, 2, 3], 9, 5), 1)])


@pytest.mark.parametrize("family", ["llama", "qwen2", "glm4"])
def test_bucketed_padded_decode_steps_equal_the_default_engines(family):
    model = make_model(family, seed=3)
    requests = prompts(11, seed=4)
    knobs = dict(block_size=4, num_blocks=96, max_num_seqs=11, max_num_batched_tokens=64)
    plain_logits, graph_logits = [], []
    plain = run(Engine(model, **knobs), requests, plain_logits)
    engine = engine_with(eager_replay, model, **knobs)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16]
    assert run(engine, requests, graph_logits) == plain
    assert graphs.enabled and graphs.replayed_steps > 0 and len(graphs.buffers) >= 2, graphs.buffers.keys()
    assert len(graph_logits) == len(plain_logits)
    for want, got in zip(plain_logits, graph_logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    engine.check_invariants()
    assert engine.pool.num_used == 0


def _raising_capture(forward, device):
    raise RuntimeError("operation not permitted when stream is capturing")


def _wrong_capture(forward, device):
    def replay():
        return forward() + 5.0
    return replay


@pytest.mark.parametrize("capture, message", [(_raising_capture, "capturing the decode step of bucket"),
                                              (_wrong_capture, "disagrees with the eager one")])
def test_a_failing_capture_is_logged_and_the_engine_stays_eager(capture, message, caplog):
    model = make_model("llama", seed=5)
    requests = prompts(5, seed=6)
    knobs = dict(block_size=4, num_blocks=64, max_num_seqs=5)
    plain = run(Engine(model, **knobs), requests)
    engine = engine_with(capture, model, **knobs)
    with caplog.at_level(logging.ERROR, logger="hf_paged.engine"):
        assert run(engine, requests) == plain
    assert not engine.runner.graphs.enabled and engine.runner.graphs.replayed_steps == 0
    assert sum(message in r.getMessage() and "enforce_eager" in r.getMessage() for r in caplog.records) == 1


def test_graphs_are_off_on_the_cpu_and_with_enforce_eager():
    model = make_model("llama")
    assert Engine(model, num_blocks=16).runner.graphs is None
    assert engine_with(None, model, num_blocks=16).runner.graphs is None
