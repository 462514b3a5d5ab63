"""Quantised KV blocks: the codec, the pools (scales travel with their blocks), the tile-wise torch
attention against attention over the fully dequantised pools, and refusals of bad values."""
import pytest
import torch

import hf_paged
from hf_paged.backends import quantized_torch, torch_backend
from hf_paged.cache import KVPools, kv_bytes_per_token
from hf_paged.kv_formats import (FORMATS, KV_CACHE_DTYPES, QuantizedPool, dequantize, kv_format, quantize,
                                 rotation_matrix)
from hf_paged.plan import StepPlan
from tiny_models import make_model

QUANTISED = sorted(FORMATS)
# Largest relative error of one element, as a fraction of its group's scale reference: fp8 keeps
# 3 (e4m3) or 2 (e5m2) mantissa bits of every element; int8 / int4 are uniform over the group's range.
RELATIVE_TO_ELEMENT = {"fp8_e4m3": 2 ** -4, "fp8_e5m2": 2 ** -3}
# nvfp4: half of e2m1's widest gap (4 -> 6) is one step; the step is the group's max / 6, up to the e4m3
# rounding of its scale (2^-4), and 2 * max is the span.
STEP_FRACTION_OF_RANGE = {"int8": 1 / 254, "int4": 1 / 30, "nvfp4": (1 + 2 ** -4) / 12}


@pytest.mark.parametrize("name", QUANTISED)
def test_codec_round_trip_within_the_format_step(name):
    fmt = kv_format(name)
    x = torch.randn(7, 3, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 7).view(7, 1, 1)
    codes, scales = quantize(fmt, x)
    assert codes.dtype == torch.uint8 and codes.shape == (7, 3, fmt.code_bytes(64))
    assert scales.dtype == torch.bfloat16 and scales.shape == (7, 3, fmt.num_scales(64))
    y = dequantize(fmt, codes, scales, torch.float32)
    err = (y - x).abs()
    if name in RELATIVE_TO_ELEMENT:
        # relative to the element, above the subnormal range of the scaled codes
        big = x.abs() > x.abs().amax(-1, keepdim=True) * 2 ** -6
        assert (err[big] <= x.abs()[big] * RELATIVE_TO_ELEMENT[name] * 1.01).all()
    else:
        groups = x.unflatten(-1, (-1, fmt.group or 64))
        span = groups.amax(-1) - groups.amin(-1) if fmt.asymmetric else 2 * groups.abs().amax(-1)
        bound = (span * STEP_FRACTION_OF_RANGE[name] * 1.02).repeat_interleave(fmt.group or 64, -1)
        assert (err <= bound + 1e-30).all()


@pytest.mark.parametrize("name", QUANTISED)
def test_codec_zero_rows_and_stored_scales(name):
    fmt = kv_format(name)
    codes, scales = quantize(fmt, torch.zeros(2, 64))
    assert (dequantize(fmt, codes, scales, torch.float32) == 0).all()
    assert not torch.isnan(scales.float()).any() and (scales.float()[..., :fmt.num_scales(64) // (1 + fmt.asymmetric)] > 0).all()
    # bf16 and fp16 inputs give the same codes as their fp32 values
    x = torch.randn(4, 2, 64, dtype=torch.bfloat16)
    assert torch.equal(quantize(fmt, x)[0], quantize(fmt, x.float())[0])


def test_int4_packs_two_codes_per_byte_low_nibble_first():
    fmt = kv_format("int4")
    x = torch.arange(16, dtype=torch.float32).view(1, 16)           # one group: min 0, scale 1
    codes, scales = quantize(fmt, x)
    assert codes.tolist() == [[0 | 1 << 4, 2 | 3 << 4, 4 | 5 << 4, 6 | 7 << 4, 8 | 9 << 4, 10 | 11 << 4,
                               12 | 13 << 4, 14 | 15 << 4]]
    assert scales.float().tolist() == [[1.0, 0.0]]


def test_unknown_values_are_refused_with_the_known_ones():
    config = make_model("llama").config
    for bad in ("fp4", "float8", "INT8", 8, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match="known: auto, fp8, fp8_e4m3, fp8_e5m2, int8, int4"):
            hf_paged.PagedCache(config, kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="known:"):
        hf_paged.patch(make_model("llama"), kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="known:"):
        hf_paged.LLM(make_model("llama"), kv_cache_dtype="e4m3")
    assert set(KV_CACHE_DTYPES) == {"auto", "fp8", *FORMATS, "kivi"}


def test_int4_refuses_a_head_dim_it_cannot_group():
    model = make_model("llama", hidden_size=160, num_attention_heads=4, num_key_value_heads=2)   # head_dim 40
    with pytest.raises(ValueError, match="groups of 16 along head_dim.*head_dim is 40"):
        hf_paged.PagedCache(model.config, kv_cache_dtype="int4")
    hf_paged.PagedCache(model.config, kv_cache_dtype="int8")          # per-head scales: any head_dim


@pytest.mark.parametrize("name", ["auto", *QUANTISED])
def test_bytes_per_token_counts_the_scales(name):
    config = make_model("llama").config                        # 2 layers x 2 KV heads x head_dim 64
    per_head = {"auto": 64 * 2, "int4": 32 + 2 * 8, "nvfp4": 32 + 4 + 2}.get(name, 64 + 2)
    assert kv_bytes_per_token(config, torch.bfloat16, name) == 2 * 2 * 2 * per_head
    cache = hf_paged.PagedCache(config, kv_cache_dtype=name, dtype=torch.bfloat16, num_blocks=4)
    assert cache.stats()["bytes_per_token"] == 2 * 2 * 2 * per_head
    cache._ensure_pools(torch.bfloat16, torch.device("cpu"), 4)
    assert cache.pool_bytes == cache.stats()["kv_bytes_allocated"]
    if name != "auto":
        assert cache.bytes_per_token / kv_bytes_per_token(config, torch.bfloat16) <= (0.53 if name != "int4" else 0.38)


def _filled_pools(name: str, blocks: int = 6, block_size: int = 4) -> KVPools:
    pools = KVPools(make_model("llama").config, kv_format=kv_format(name))
    pools.allocate_pools(blocks, block_size, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    for layer in range(2):
        k = torch.randn(1, 2, blocks * block_size, 64, generator=gen) * 3
        pools.write(layer, k, -k, torch.arange(blocks * block_size))
    return pools


@pytest.mark.parametrize("name", QUANTISED)
def test_copy_on_write_and_growth_move_the_scales(name):
    pools = _filled_pools(name)
    before = [t.clone() for t in pools.pool_tensors()]
    pools.copy_blocks([(1, 4), (2, 5)])
    for old, new in zip(before, pools.pool_tensors()):
        assert torch.equal(new[:, 4], old[:, 1]) and torch.equal(new[:, 5], old[:, 2])
        assert torch.equal(new[:, :4], old[:, :4])
    pools.grow_pools(3)
    for pool in pools.key_pools + pools.value_pools:
        assert isinstance(pool, QuantizedPool) and pool.shape[1] == 9
        assert (pool.data[:, 6:] == 0).all() and (pool.scales[:, 6:] == 1).all()
    grown = pools.pool_tensors()
    copied = [t.clone() for t in before]
    for t in copied:
        t[:, 4], t[:, 5] = t[:, 1], t[:, 2]
    for old, new in zip(copied, grown):
        assert torch.equal(new[:, :6], old)


def _reference_pool(pool: QuantizedPool) -> torch.Tensor:
    return dequantize(pool.fmt, pool.data, pool.scales, torch.float32)


@pytest.mark.parametrize("name", QUANTISED)
@pytest.mark.parametrize("window", [0, 5])
def test_tilewise_attention_equals_attention_over_the_dequantised_pools(name, window, monkeypatch):
    """Several chunks (CHUNK_TOKENS lowered), GQA 2, pads, a row without keys, a shared block."""
    monkeypatch.setattr(quantized_torch, "CHUNK_TOKENS", 8)
    pools = _filled_pools(name, blocks=8, block_size=4)
    k_pool, v_pool = pools.key_pools[0], pools.value_pools[0]
    k_ref, v_ref = _reference_pool(k_pool), _reference_pool(v_pool)
    tables = torch.tensor([[3, 1, 0, 5, 6], [2, 1, 7, 0, 0], [4, 0, 0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([19, 9, 0], dtype=torch.int32)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 64, generator=gen)
    got = torch_backend.decode_attention(q, k_pool, v_pool, tables, lens, 0.125, window)
    want = torch_backend.decode_attention(q, k_ref, v_ref, tables, lens, 0.125, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got[2] == 0).all()
    query_pos = torch.tensor([[12, 13, 18], [-1, 7, 8], [-1, -1, -1]], dtype=torch.int32)
    q = torch.randn(3, 4, 3, 64, generator=gen)
    got = torch_backend.extend_attention(q, k_pool, v_pool, tables, lens, query_pos, 0.125, window)
    want = torch_backend.extend_attention(q, k_ref, v_ref, tables, lens, query_pos, 0.125, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", QUANTISED)
def test_writes_store_the_codec_of_the_written_rows(name):
    pools = KVPools(make_model("llama").config, kv_format=kv_format(name))
    pools.allocate_pools(4, 4, torch.float32, torch.device("cpu"))
    k = torch.randn(1, 2, 5, 64)
    slots = torch.tensor([13, 2, -1, 7, 0])
    pools.write(1, k, k * 2, slots)
    pool = pools.key_pools[1]
    assert pool.rotation is not None and torch.equal(pool.rotation, rotation_matrix(64))
    codes, scales = quantize(pool.fmt, k[0].transpose(0, 1) @ pool.rotation)      # [5, 2, *]: x R is stored
    flat_codes = pool.data.view(2, 16, -1)
    flat_scales = pool.scales.view(2, 16, -1)
    for n, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_codes[:, slot], codes[n]) and torch.equal(flat_scales[:, slot], scales[n])
    untouched = [s for s in range(16) if s not in slots.tolist()]
    assert (flat_codes[:, untouched] == 0).all()


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_rotation_is_orthogonal_and_fixed(head_dim):
    r = rotation_matrix(head_dim)
    torch.testing.assert_close(r @ r.T, torch.eye(head_dim), atol=2e-6, rtol=0)
    assert torch.equal(r, rotation_matrix(head_dim))


@pytest.mark.parametrize("name", QUANTISED)
def test_a_step_over_rotated_pools_attends_to_the_unrotated_values(name):
    """A step rotates the query and un-rotates the output: the result is attention over the
    stored values taken back to the model's basis (dequantised, times R^T)."""
    pools = _filled_pools(name, blocks=6, block_size=4)
    k_pool, v_pool = pools.key_pools[0], pools.value_pools[0]
    back = [_reference_pool(p) @ p.rotation.T for p in (k_pool, v_pool)]
    tables = torch.tensor([[3, 1, 0, 5], [2, 4, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([15, 6], dtype=torch.int32)
    plan = StepPlan(slot_mapping=torch.full((2,), -1), token_row=torch.arange(2, dtype=torch.int32),
                    token_pos=lens - 1, query_start=torch.arange(3, dtype=torch.int32), block_tables=tables,
                    context_lens=lens, decode_lens=lens, num_decode=2, max_context=15, max_query_len=1,
                    decode_context=15, batch_shape=(2, 1))
    step = torch_backend.TorchBackend().prepare(plan)
    q = torch.randn(2, 4, 64)
    got = step.attend(q, k_pool, v_pool, 0.125, 0)                                  # [T, Hq, D]
    want = torch_backend.decode_attention(q, *back, tables, lens, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
