"""64-bit addressing: the kernels, run on the CPU shim, over KV pools of more than 2**32 elements (8 GiB
each in bf16, 16 GiB in fp32), with the sequences' blocks at the end of the pool, so that element
offsets exceed 2**31 (a signed 32-bit index goes negative) and 2**32 (an unsigned one, and every
32-bit byte offset, wraps).

The pools are anonymous MAP_NORESERVE mappings (``untouched_tensor``): only the pages the test writes
become memory. ``hf_paged.backends.torch_backend`` indexes with int64 and is the reference.
"""
from __future__ import annotations

import harness
import pytest
import torch
from recording_launcher import untouched_tensor

from hf_paged.backends import kernel_registry as reg
from hf_paged.backends import torch_backend as ta
from hf_paged.backends.synthetic import assign_blocks

TOL = {torch.bfloat16: 1.6e-2, torch.float32: 2e-5}
KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE = 2, 2, 64, 16
# 2**21 + 64 blocks of 16 x 64: 2**31 + 65536 elements per KV head, 2**32 + 131072 per pool.
NUM_BLOCKS = 2**21 + 64
LENGTHS = [37, 50]          # stored tokens per row after the extend step below
NEW = [5, 50]               # of which written by this step (the second row: a whole prefill)


@pytest.fixture(scope="module")
def backend():
    libraries = harness.build(units=[(reg.ATTENTION_SOURCE, HEAD_DIM, ""), (reg.CACHE_SOURCE, 0, "")])
    return harness.shim_backend(libraries, schedule="warp_ahead")


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def cache(backend, request):
    """(k_pool, v_pool, block_tables, context_lens, key, value, slots): the rows' blocks are the pool's
    last ones (shuffled), every token written by the backend's write_kv. bf16 and fp32 pools take
    different attention kernels (fast_attention.cu, attention.cu)."""
    dtype = request.param
    shape = (KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM)
    try:
        k_pool, v_pool = untouched_tensor(shape, dtype), untouched_tensor(shape, dtype)
    except OSError as exc:
        pytest.skip(f"this machine refuses a {k_pool_bytes(shape, dtype) >> 30} GiB MAP_NORESERVE mapping ({exc}); the 64-bit addressing "
                    f"test needs one (vm.overcommit_memory=2 refuses it)")
    assert k_pool.numel() > 2**32 and k_pool.stride(0) > 2**31
    gen = torch.Generator().manual_seed(64)
    blocks = [-(-n // BLOCK_SIZE) for n in LENGTHS]
    last = NUM_BLOCKS - 1 - torch.randperm(sum(blocks) + 2, generator=gen)   # the pool's last blocks
    tables = assign_blocks(last, blocks)
    tokens = sum(LENGTHS)
    slots = torch.cat([tables[b].long().repeat_interleave(BLOCK_SIZE)[:n] * BLOCK_SIZE
                       + torch.arange(n) % BLOCK_SIZE for b, n in enumerate(LENGTHS)])
    key = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    value = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    backend.write_kv(k_pool, v_pool, key, value, slots)
    return k_pool, v_pool, tables, torch.tensor(LENGTHS, dtype=torch.int32), key, value, slots


def k_pool_bytes(shape, dtype) -> int:
    return int(torch.tensor(shape).prod()) * torch.empty((), dtype=dtype).element_size()


def assert_close(out, ref):
    assert out.dtype == ref.dtype and torch.isfinite(out.float()).all()
    tol = TOL[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_write_kv_lands_past_2_pow_32(cache):
    k_pool, v_pool, _, _, key, value, slots = cache
    flat_k, flat_v = k_pool.view(KV_HEADS, -1, HEAD_DIM), v_pool.view(KV_HEADS, -1, HEAD_DIM)
    assert int(slots.min()) * HEAD_DIM + k_pool.stride(0) > 2**32    # last head: past any 32-bit offset
    assert torch.equal(flat_k[:, slots], key.transpose(0, 1))
    assert torch.equal(flat_v[:, slots], value.transpose(0, 1))


@pytest.mark.parametrize("partition", [None, 16])     # one split; split-K with the merge kernel
def test_decode_over_a_huge_pool(backend, cache, partition):
    k_pool, v_pool, tables, lens, *_ = cache
    query = torch.randn(len(LENGTHS), KV_HEADS * GROUP, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(k_pool.dtype)
    ref = ta.decode_attention(query, k_pool, v_pool, tables, lens, HEAD_DIM ** -0.5)
    backend.partition_size = partition
    try:
        out = backend.decode_attention(query, k_pool, v_pool, tables, lens, HEAD_DIM ** -0.5)
    finally:
        backend.partition_size = None
    assert_close(out, ref)


def test_extend_over_a_huge_pool(backend, cache):
    k_pool, v_pool, tables, lens, *_ = cache
    q_len = max(NEW)
    pos = torch.full((len(LENGTHS), q_len), -1, dtype=torch.int32)
    for b, (n, new) in enumerate(zip(LENGTHS, NEW)):
        pos[b, :new] = torch.arange(n - new, n, dtype=torch.int32)
    query = torch.randn(len(LENGTHS), KV_HEADS * GROUP, q_len, HEAD_DIM,
                        generator=torch.Generator().manual_seed(2)).to(k_pool.dtype)
    ref = ta.extend_attention(query, k_pool, v_pool, tables, lens, pos, HEAD_DIM ** -0.5, sliding_window=20)
    out = backend.extend_attention(query, k_pool, v_pool, tables, lens, pos, HEAD_DIM ** -0.5, sliding_window=20)
    assert_close(out, ref)


def test_copy_blocks_at_the_end_of_a_huge_pool(backend, cache):
    """Copy-on-write between the pool's last blocks (destinations no row reads: spare blocks)."""
    k_pool, v_pool, tables, *_ = cache
    src = tables[1, :2].long()
    used = set(tables.flatten().tolist())
    dst = torch.tensor([b for b in range(NUM_BLOCKS - 1, NUM_BLOCKS - 40, -1) if b not in used][:2])
    backend.copy_blocks([k_pool, v_pool], torch.stack([src, dst], dim=1))
    for pool in (k_pool, v_pool):
        assert torch.equal(pool[:, dst], pool[:, src]) and pool[:, src].abs().sum() > 0
