"""Every launch CudaBackend makes fits an sm_90 device (grid, block, shared memory, arguments), fuzzed
over GQA group 1-32, KV heads 1-8, batch 1-300, q_len up to 300k, context up to 128k, block sizes,
head dims, dtypes, sliding windows and split-K partitions. Nothing runs: RecordingLauncher checks and
records each launch (tests/backends/recording_launcher.py).

Inputs the recorder never reads (queries, block tables) are ``untouched_tensor``s: virtual memory only.
The backend allocates its outputs and split-K scratch at their real size (virtual until written), so
each case keeps those under ``VIRTUAL_BYTES``; what the backend may copy (an extend query into a
token-major list, query_pos, work lists) under ``TOUCHED_BYTES`` and ``TOKENS``. The explicit examples
are the boundaries: 65,536 query tokens at group 32 (one token per CTA row block on the old extend
kernel's grid.z), 300,000 at group 8.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from recording_launcher import RecordingLauncher, untouched_tensor

from hf_paged.backends import kernel_registry as reg
from hf_paged.backends.cuda_backend import CudaBackend
from hf_paged.backends.launch_checks import DeviceLimits

LIMITS = DeviceLimits.for_arch("sm_90", sm_count=132)
VIRTUAL_BYTES = 4 << 30      # per output / scratch tensor the backend allocates (never written here)
TOUCHED_BYTES = 640 << 20    # extend queries: the backend may copy them (e.g. into a token-major list)
TOKENS = 1 << 19             # extend query tokens (B x Q): query_pos and the work lists built from it
MAX_CONTEXT = 128 * 1024
PARTITIONS = [None, 16, 32, 48, 64, 256, 1000]
# No shrinking: a failure names the kernel and the value already, and shrinking long prompts takes minutes.
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

try:
    untouched_tensor((1,), torch.float32)
except OSError as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"anonymous MAP_NORESERVE mappings are refused here ({exc})", allow_module_level=True)


@st.composite
def geometry(draw):
    """(kv heads, group, head dim, block size, dtype) the kernels support; one KV head and head dim 64
    often, so that long prompts still fit the memory bounds below."""
    return (draw(st.one_of(st.just(1), st.integers(1, 8))), draw(st.integers(1, reg.MAX_GROUP)),
            draw(st.one_of(st.just(64), st.sampled_from(reg.HEAD_DIMS))),
            draw(st.sampled_from(reg.BLOCK_SIZES)), draw(st.sampled_from(list(reg.DTYPE_TAGS))))


def pools(num_kv_heads, block_size, head_dim, dtype):
    """Two-block pools: block tables of zeros are valid, and nothing is read."""
    k_pool = torch.zeros(num_kv_heads, 2, block_size, head_dim, dtype=dtype)
    return k_pool, torch.zeros_like(k_pool)


def lengths(batch, longest, gen):
    """int32 [batch] context lengths in [0, longest], the last one ``longest``."""
    lens = torch.randint(0, longest + 1, (batch,), generator=gen, dtype=torch.int32)
    lens[-1] = longest
    return lens


@FUZZ
@given(geo=geometry(), batch=st.integers(1, 300), context=st.integers(1, MAX_CONTEXT),
       partition=st.sampled_from(PARTITIONS), window=st.sampled_from([0, 0, 1, 100, 4096]), seed=st.integers(0, 99))
@example(geo=(8, 32, 256, 8, torch.float32), batch=300, context=MAX_CONTEXT, partition=16, window=0, seed=0)
@example(geo=(1, 1, 64, 16, torch.bfloat16), batch=1, context=MAX_CONTEXT, partition=None, window=0, seed=0)
def test_decode_launches_fit_the_device(geo, batch, context, partition, window, seed):
    num_kv_heads, group, head_dim, block_size, dtype = geo
    num_q_heads = num_kv_heads * group
    span = min(context, window) if window else context
    splits = -(-span // partition) if partition else 1
    batch = max(1, min(batch, VIRTUAL_BYTES // (4 * num_q_heads * splits * head_dim)))   # split-K scratch
    gen = torch.Generator().manual_seed(seed)
    k_pool, v_pool = pools(num_kv_heads, block_size, head_dim, dtype)
    query = untouched_tensor((batch, num_q_heads, head_dim), dtype)
    tables = untouched_tensor((batch, -(-context // block_size)), torch.int32)
    launcher = RecordingLauncher(LIMITS)
    out = CudaBackend(launcher, partition_size=partition).decode_attention(
        query, k_pool, v_pool, tables, lengths(batch, context, gen), head_dim ** -0.5, sliding_window=window,
        max_context=context)
    assert out.shape == query.shape and out.dtype == dtype
    assert launcher.launches, "nothing was launched"


@FUZZ
@given(geo=geometry(), batch=st.integers(1, 300),
       q_len=st.one_of(st.integers(1, 300_000), st.integers(60_000, 300_000), st.integers(1, 64)),
       before=st.one_of(st.just(0), st.integers(0, MAX_CONTEXT)), partition=st.sampled_from([None, None, 16, 1000]),
       window=st.sampled_from([0, 0, 1, 4096]), seed=st.integers(0, 99))
@example(geo=(1, 32, 64, 16, torch.bfloat16), batch=1, q_len=65_536, before=0, partition=None, window=0, seed=0)
@example(geo=(1, 32, 64, 16, torch.float32), batch=1, q_len=65_536, before=0, partition=None, window=0, seed=0)
@example(geo=(1, 8, 64, 8, torch.float32), batch=1, q_len=300_000, before=0, partition=None, window=0, seed=0)
@example(geo=(1, 8, 128, 16, torch.float16), batch=1, q_len=300_000, before=0, partition=None, window=0, seed=0)
@example(geo=(2, 1, 64, 32, torch.bfloat16), batch=1, q_len=300_000, before=1000, partition=None, window=0, seed=0)
@example(geo=(8, 32, 256, 8, torch.float32), batch=1, q_len=1, before=MAX_CONTEXT, partition=16, window=0, seed=0)
def test_extend_launches_fit_the_device(geo, batch, q_len, before, partition, window, seed):
    num_kv_heads, group, head_dim, block_size, dtype = geo
    num_q_heads = num_kv_heads * group
    elem = torch.empty((), dtype=dtype).element_size()
    token_bytes = num_q_heads * head_dim * elem                 # one query token, all heads
    context = before + q_len
    splits = -(-context // partition) if partition else 1       # an upper bound on the split-K scratch
    q_len = max(1, min(q_len, TOUCHED_BYTES // token_bytes, VIRTUAL_BYTES // (4 * num_q_heads * splits * head_dim)))
    batch = max(1, min(batch, TOKENS // q_len, TOUCHED_BYTES // (q_len * token_bytes),
                       VIRTUAL_BYTES // (4 * q_len * num_q_heads * splits * head_dim)))
    context = before + q_len
    gen = torch.Generator().manual_seed(seed)
    k_pool, v_pool = pools(num_kv_heads, block_size, head_dim, dtype)
    query = untouched_tensor((batch, num_q_heads, q_len, head_dim), dtype)
    starts = lengths(batch, before, gen)                     # stored tokens before this step, per row
    query_pos = (starts.view(-1, 1) + torch.arange(q_len, dtype=torch.int32)).to(torch.int32)
    tables = untouched_tensor((batch, -(-context // block_size)), torch.int32)
    launcher = RecordingLauncher(LIMITS)
    out = CudaBackend(launcher, partition_size=partition).extend_attention(
        query, k_pool, v_pool, tables, starts + q_len, query_pos, head_dim ** -0.5, sliding_window=window,
        max_context=context)
    assert out.shape == query.shape and out.dtype == dtype
    assert launcher.launches, "nothing was launched"


def test_recording_launcher_refuses_what_a_device_would():
    """The recorder itself: a null required pointer, a misaligned vector pointer, a wrong argument type,
    an oversized grid are each refused with the kernel's name."""
    launcher = RecordingLauncher(LIMITS)
    spec = reg.reduce_kernel("bf16", 128)
    good = (np.uint64(1 << 20), np.uint64(1 << 21), np.uint64(1 << 22), np.int32(3), np.int32(128))
    launcher.launch(spec, torch.device("cpu"), (4, 2, 1), (128, 1, 1), good, 0)
    assert launcher.launches[0].arg("splits") == 3 and launcher.launches[0].null_pointers == ()
    bad = [((np.uint64(0),) + good[1:], "pointer out is null"),
           ((np.uint64((1 << 20) + 8),) + good[1:], "pointer out = 0x100008 is not 16-byte aligned"),
           (good[:3] + (np.int64(3),) + good[4:], "parameter splits .* got int64"),
           (good[:4], "4 arguments for 5 parameters")]
    for args, message in bad:
        with pytest.raises(AssertionError, match=f"hfp_decode_reduce_bf16: {message}"):
            launcher.launch(spec, torch.device("cpu"), (4, 2, 1), (128, 1, 1), args, 0)
    with pytest.raises(ValueError, match="hfp_decode_reduce_bf16: grid.y = 70000 exceeds the device limit 65535"):
        launcher.launch(spec, torch.device("cpu"), (4, 70000, 1), (128, 1, 1), good, 0)
    decode = reg.decode_kernel("bf16", 128)
    assert [p.name for p in launcher.signature(decode)][:4] == ["out", "part_out", "part_lse", "query"]
