"""KIVI's C++ writes (torch.ops.hf_paged_cpu.kivi_write and kivi_write_kv, cuda/kivi_write_cpu.cpp) against
their PyTorch path.

The same writes go to two pairs of pools, one through the ops, one through PyTorch ops (``ops=None``); after
every write their codes, scales, open slots, sinks and fresh rows must be equal bit for bit. The writes cover
prefill blocks started and sealed by one write, blocks sealed from their open slot, sinks, skipped tokens
(slot -1), a rewrite into sealed blocks (reopened from codes), open-slot growth past the reserved capacity,
and values whose groups are smaller than head_dim. Pools whose keys and values share their maps (as a cache's
do) take one ``kivi_write_kv`` per write, values rotated inside it: checked against the PyTorch path given the
values rotated by ``rotate_rows`` (the same C++ rotation, so the same rounded rows).
"""
from __future__ import annotations

import pytest
import torch

from hf_paged.backends.cpu_backend import CpuKernelBackend, load_kernel
from hf_paged.kivi import BLOCK_SIZE as BS, KiviPool, KiviWrite, write_kv
from hf_paged.kivi_stores import KiviMaps
from hf_paged.kv_formats import rotation_matrix

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def op():
    try:
        load_kernel()
    except RuntimeError as err:        # no compiler: the kernel tests are meaningless here
        pytest.skip(f"CPU kernel not built: {err}")
    return torch.ops.hf_paged_cpu.kivi_write


@pytest.fixture(scope="module")
def backend(op):
    return CpuKernelBackend(load_kernel())


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


def pools(head_dim, dtype, num_blocks, shared=False, rotation=None):
    """Keys and values, with their own maps each, or (``shared``) one KiviMaps for both, as a cache's pools."""
    maps = KiviMaps.empty(num_blocks, 1, 1, "cpu", shared=True) if shared else None
    return (KiviPool.new(True, 2, num_blocks, BS, head_dim, dtype, "cpu", 1, maps=maps),
            KiviPool.new(False, 2, num_blocks, BS, head_dim, dtype, "cpu", 1, rotation=rotation, maps=maps))


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


class Spy:
    """The backend's KIVI ops, counting calls."""
    def __init__(self, backend):
        self.backend, self.calls = backend, {"kivi_write_kv": 0, "kivi_write": 0}

    def __getattr__(self, name):
        def call(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return getattr(self.backend, name)(*args)
        return call


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_op_equals_the_pytorch_write(backend, head_dim, dtype, seed):
    """Pools with their own maps: the per-pool op (and rotate_rows' absence: these values are not rotated)."""
    spy = Spy(backend)
    with_op, without = pools(head_dim, dtype, 16), pools(head_dim, dtype, 16)
    for step, key, value, plan in writes(head_dim, dtype, seed, 16):
        write_kv(*with_op, key, value, plan, spy)
        write_kv(*without, key, value, plan, None)
        for a, b, name in zip(with_op, without, ("keys", "values")):
            assert_same(a, b, f"write {step}, {name}")
    assert with_op[0].open.rows.shape[1] > 1, "the open store was meant to grow past its reserved slot"
    assert spy.calls["kivi_write_kv"] == 0 and spy.calls["kivi_write"] >= len(WRITES), spy.calls


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_one_call_per_layer_equals_the_pytorch_write(backend, head_dim, dtype, seed):
    """Keys and values sharing their maps: one kivi_write_kv per write (values rotated inside: Hadamard at
    64/128, a general orthogonal R at 192), the per-pool ops (after rotate_rows) for the write that reopens a
    block; equal to the PyTorch path given the rotated values."""
    rotation = rotation_matrix(head_dim, torch.device("cpu"))
    spy = Spy(backend)
    with_op, without = pools(head_dim, dtype, 16, shared=True, rotation=rotation), pools(head_dim, dtype, 16)
    reopening = 0
    for step, key, value, plan in writes(head_dim, dtype, seed, 16):
        # the states as the engine passes them (views of a wider product: rows strided), and once with the
        # channels strided (the op's general loop)
        both = torch.stack([key, value], 2)                                 # [N, H, 2, D]
        k_in, v_in = both[:, :, 0], both[:, :, 1]
        if step == 3:
            k_in, v_in = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (key, value))
        write_kv(*with_op, k_in, v_in, plan, spy)
        done = with_op[0].maps.last[1]                                       # (the transition it applied)
        reopening += bool(done.reopen_first or done.reopen_after)
        flat = value.reshape(-1, head_dim).float()
        rotated = backend.rotate_rows(flat, rotation, False)[0].view(value.shape).to(dtype)
        write_kv(*without, key, rotated, plan, None)
        for a, b, name in zip(with_op, without, ("keys", "values")):
            assert_same(a, b, f"write {step}, {name}")
    assert with_op[0].open.rows.shape[1] > 1 and with_op[1].open.rows.shape[1] > 1, "the open rows were meant to grow"
    assert reopening >= 1, "WRITES[5] (the rewrite) reopens a block"
    calls = spy.calls
    assert calls["kivi_write_kv"] == len(WRITES) - reopening and calls["rotate_rows"] == reopening, calls
    assert calls["kivi_write"] <= 2 * reopening, calls            # (a pool with nothing to seal or copy skips it)


def writes(head_dim, dtype, seed, num_blocks):
    """(step, keys, values, plan) of WRITES over random block tables."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [order[4 * s:4 * s + 4] for s in range(4)]
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
        yield step, key.to(dtype), value.to(dtype), KiviWrite.of(slot_mapping, torch.tensor(positions), BS)


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


def test_one_call_refuses_bad_arguments(backend):
    k, v = pools(64, torch.float32, 4, shared=True)
    empty = torch.empty(0, dtype=torch.int64)
    no_seal = (empty, empty, empty, empty, empty, torch.empty(0, dtype=torch.bool))   # no copy, no seal
    states = torch.randn(4, 2, 64)
    pool_args = (k.open.rows, k.sink.rows, k.data, k.scales, v.open.rows, v.sink.rows, v.data, v.scales)
    op = backend.kivi_write_kv
    with pytest.raises(RuntimeError, match="into entry row 1 of 1"):        # one sink row reserved
        op(states, states, None, *no_seal, torch.tensor([0]), torch.tensor([1]), empty, empty, *pool_args)
    with pytest.raises(RuntimeError, match="row 4 of 4"):
        op(states, states, None, *no_seal, empty, empty, torch.tensor([4]), torch.tensor([0]), *pool_args)
    with pytest.raises(RuntimeError, match="open rows' dtype"):
        op(states.half(), states.half(), None, *no_seal, empty, empty, empty, empty, *pool_args)
    with pytest.raises(RuntimeError, match="rotation must be fp32"):
        op(states, states, torch.eye(32), *no_seal, empty, empty, empty, empty, *pool_args)


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
