"""KIVI's C++ write (torch.ops.hf_paged_cpu.kivi_write, cuda/kivi_write_cpu.cpp) against its PyTorch path.

The same writes go to two pairs of pools, one through the op, one through PyTorch ops (``op=None``); after
every write their codes, scales, open slots, sinks and fresh rows must be equal bit for bit. The writes cover
prefill blocks started and sealed by one write, blocks sealed from their open slot, sinks, skipped tokens
(slot -1), a rewrite into sealed blocks (reopened from codes), open-slot growth past the reserved capacity,
and values whose groups are smaller than head_dim.
"""
from __future__ import annotations

import pytest
import torch

from hf_paged.backends.cpu_backend import load_kernel
from hf_paged.kivi import BLOCK_SIZE as BS, KiviPool, KiviWrite, write_kv

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def op():
    try:
        load_kernel()
    except RuntimeError as err:        # no compiler: the kernel tests are meaningless here
        pytest.skip(f"CPU kernel not built: {err}")
    return torch.ops.hf_paged_cpu.kivi_write


# (sequence, first position, tokens) per write; sequences' tables are random blocks.
WRITES = [
    [(0, 0, 70), (1, 0, 5)],          # two whole blocks + an open one (sinks); a short prompt
    [(0, 70, 1), (1, 5, 1)],          # decode into open slots
    [(1, 6, 27), (0, 71, 1)],         # block 0 of seq 1 sealed from its slot (sink), block 1 opened
    [(2, 0, 64), (3, 0, 31)],         # two whole blocks; a block one short of full
    [(3, 31, 1), (2, 64, 1)],         # seq 3's block 0 sealed from its slot; seq 2 opens block 2
    [(0, 40, 24)],                    # a rewrite: seq 0 truncated to 40 (block 1 reopened from codes, resealed)
    [(0, 64, 8), (1, 33, 31), (2, 65, 3)],
]


def pools(head_dim, dtype, num_blocks):
    return (KiviPool.new(True, 2, num_blocks, BS, head_dim, dtype, "cpu", 1),
            KiviPool.new(False, 2, num_blocks, BS, head_dim, dtype, "cpu", 1))


def assert_same(a: KiviPool, b: KiviPool, what: str) -> None:
    assert torch.equal(a.data, b.data), f"{what}: codes"
    assert torch.equal(a.scales, b.scales), f"{what}: scales"
    assert a.open.held == b.open.held and a.sink.held == b.sink.held, f"{what}: slots"
    assert torch.equal(a.open.block_slot, b.open.block_slot) and torch.equal(a.sink.block_slot, b.sink.block_slot)
    for block, slot in a.open.held.items():
        assert torch.equal(a.open.rows[:, slot], b.open.rows[:, slot]), f"{what}: open rows of block {block}"
    for block, slot in a.sink.held.items():
        assert torch.equal(a.sink.rows[:, slot], b.sink.rows[:, slot]), f"{what}: sink of block {block}"
    assert a.fresh.blocks == b.fresh.blocks, f"{what}: fresh blocks"
    assert torch.equal(a.fresh.rows, b.fresh.rows), f"{what}: fresh rows"
    assert torch.equal(a.fresh.block_slot, b.fresh.block_slot)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_op_equals_the_pytorch_write(op, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 16
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [order[4 * s:4 * s + 4] for s in range(4)]
    with_op, without = pools(head_dim, dtype, num_blocks), pools(head_dim, dtype, num_blocks)
    for step, write in enumerate(WRITES):
        slots, positions = [], []
        for seq, first, count in write:
            for p in range(first, first + count):
                slots.append(tables[seq][p // BS] * BS + p % BS)
                positions.append(p)
        skipped = torch.rand(len(slots), generator=gen) < 0.1 * (step % 2)   # padding tokens: slot -1
        slot_mapping = torch.tensor(slots).masked_fill(skipped, -1)
        # keys with an outlier channel and a wide range, values plain; row 0 far off (the sink's channel range)
        key = torch.randn(len(slots), 2, head_dim, generator=gen) * 2
        key[:, :, 5] += 6
        key[torch.tensor(positions) == 0] *= 20
        value = torch.randn(len(slots), 2, head_dim, generator=gen)
        plan = KiviWrite.of(slot_mapping, torch.tensor(positions), BS)
        write_kv(*with_op, key.to(dtype), value.to(dtype), plan, op)
        write_kv(*without, key.to(dtype), value.to(dtype), plan, None)
        for a, b, name in zip(with_op, without, ("keys", "values")):
            assert_same(a, b, f"write {step}, {name}")
    assert with_op[0].open.rows.shape[1] > 1, "the open store was meant to grow past its reserved slot"


def test_op_seals_with_codes_a_one_percent_error_would_change(op):
    """Negative control: a write whose seal is off by one code step in one element is caught."""
    k_a, _ = pools(64, torch.float32, 4)
    k_b, _ = pools(64, torch.float32, 4)
    x = torch.randn(BS, 2, 64, generator=torch.Generator().manual_seed(3))
    plan = KiviWrite.of(torch.arange(BS) + BS, torch.arange(BS) + BS, BS)
    k_a.write_planned(x, plan, op)
    k_b.write_planned(x, plan, None)
    assert_same(k_a, k_b, "equal writes")
    k_b.data[0, 1, 7, 3] ^= 1
    with pytest.raises(AssertionError, match="codes"):
        assert_same(k_a, k_b, "a flipped code")


def test_op_refuses_bad_arguments(op):
    k, _ = pools(64, torch.float32, 4)
    empty = torch.empty(0, dtype=torch.int64)
    fresh = k.open.rows.new_empty((2, 1, BS, 64))
    states = torch.randn(BS, 2, 64)
    with pytest.raises(RuntimeError, match="outside the pool's 4 blocks"):
        op(states, empty, empty, k.open.rows, torch.tensor([9]), torch.tensor([-1]), torch.arange(BS),
           torch.tensor([False]), k.data, k.scales, True, fresh)
    with pytest.raises(RuntimeError, match="outside the 32 states"):
        op(states, empty, empty, k.open.rows, torch.tensor([1]), torch.tensor([-1]), torch.arange(BS) + 1,
           torch.tensor([False]), k.data, k.scales, True, fresh)
    with pytest.raises(RuntimeError, match="in the open rows' dtype"):
        op(states.double(), empty, empty, k.open.rows, torch.tensor([1]), torch.tensor([-1]), torch.arange(BS),
           torch.tensor([False]), k.data, k.scales, True, fresh)
