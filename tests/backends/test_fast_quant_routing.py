"""CudaBackend routes decodes over quantised pools to the quantised fast decode (cuda/fast_quant.cuh) where it
is eligible — int8 / fp8_e4m3 / fp8_e5m2 / int4 pools, rotated or not, fp16/bf16 queries, GQA groups up to 4,
with or without a sliding window — and to attention.cu otherwise (groups above 4, fp32 queries,
``fast_kernels=False``, a failed first-use self-check); and extends (prefill, chunked prefill) over those
pools to the quantised tensor-core extend (cuda/fast_quant_extend.cuh) for every group, the same way. Run
on the CPU shim against quantized_torch."""
from __future__ import annotations

import pytest
import torch
from test_fast_quant_extend import extend_case
from test_fast_quant_kernels import _case
from test_generate_shim import left_padded, tiny_llama

import harness
import hf_paged
from hf_paged import kv_formats
from hf_paged.attention_interface import cache_keyword
from hf_paged.backends import TorchBackend, cuda_fast
from hf_paged.backends import kernel_registry as reg
from hf_paged.backends import quantized_torch as qt
from hf_paged.integrations.patching import patch, unpatch

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2", "int4"]


def _fast_name(fmt_name, dtype, head_dim):
    return reg.decode_fast_kernel(reg.DTYPE_TAGS[dtype], head_dim, reg.KV_FORMAT_TAGS[fmt_name]).name


def _first_name(fmt_name, dtype, head_dim):
    return reg.decode_kernel(reg.DTYPE_TAGS[dtype], head_dim, reg.KV_FORMAT_TAGS[fmt_name]).name


def _extend_names(fmt_name, dtype, head_dim):
    """(the quantised tensor-core extend, attention.cu's quantised extend)"""
    tag, fmt = reg.DTYPE_TAGS[dtype], reg.KV_FORMAT_TAGS[fmt_name]
    return reg.ragged_kernel(tag, head_dim, fmt).name, reg.extend_kernel(tag, head_dim, fmt).name


def _decode(backend, case, window=0):
    query, k_pool, v_pool, tables, lens = case
    scale = query.shape[-1] ** -0.5
    out = backend.decode_attention(query, k_pool, v_pool, tables, lens, scale, window)
    ref = qt.decode_attention(query, k_pool, v_pool, tables, lens, scale, sliding_window=window)
    return out.float(), ref.float()


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("window", [0, 9])
def test_decode_attention_routes_to_the_quantised_fast_decode(shim_libraries, fmt_name, window):
    backend = harness.shim_backend(shim_libraries, schedule="warp_ahead")
    out, ref = _decode(backend, _case(fmt_name, 64, torch.float16, 4), window)
    assert backend.launcher.launches == [_fast_name(fmt_name, torch.float16, 64)]
    torch.testing.assert_close(out, ref, atol=1e-3 * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("reason", ["group 8", "fp32 query", "fast_kernels=False"])
def test_ineligible_decodes_stay_on_attention_cu(shim_libraries, reason):
    group = 8 if reason == "group 8" else 2
    query, *rest = _case("int8", 64, torch.float16, group)
    if reason == "fp32 query":
        query = query.float()
    backend = harness.shim_backend(shim_libraries, fast_kernels=reason != "fast_kernels=False")
    assert cuda_fast.eligible_quantised(query, rest[0]) == (reason == "fast_kernels=False")
    out, ref = _decode(backend, (query, *rest))
    assert backend.launcher.launches == [_first_name("int8", query.dtype, 64)]
    torch.testing.assert_close(out, ref, atol=1e-3 * ref.abs().max().item(), rtol=0)


def test_formats_without_fast_kernels_are_not_eligible():
    query = torch.zeros(1, 4, 64, dtype=torch.float16)
    data, scales = torch.zeros(2, 4, 16, 64, dtype=torch.uint8), torch.ones(2, 4, 16, 8, dtype=torch.bfloat16)
    for name in ("nvfp4", "kivi", "int8"):
        pool = kv_formats.QuantizedPool(data, scales, kv_formats.kv_format(name), 64)
        assert cuda_fast.eligible_quantised(query, pool) == (name == "int8"), name   # int8: the control


@pytest.mark.parametrize("fmt_name", ["int8", "int4"])
def test_generate_on_rotated_quantised_pools_uses_the_fast_kernels(shim_libraries, fmt_name):
    """Rotated pools end to end (prefill on the quantised tensor-core extend, decode on the quantised fast
    decode): Step.attend rotates the query once before the kernels and unrotates their output; the tokens
    and scores are those of the quantised PyTorch path."""
    model = tiny_llama(torch.float16)                        # 8 query heads / 2 KV heads: group 4
    ids, mask = left_padded([9, 1, 17])
    kw = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 8, "do_sample": False,
          "output_scores": True, "return_dict_in_generate": True}
    patch(model, block_size=8)
    try:
        torch_cache = hf_paged.PagedCache(model.config, block_size=8, dtype=model.dtype, backend=TorchBackend(),
                                          kv_cache_dtype=fmt_name)
        want = model.generate(**{cache_keyword(model): torch_cache}, **kw)
        backend = harness.shim_backend(shim_libraries, schedule="warp_ahead")
        cache = hf_paged.PagedCache(model.config, block_size=8, dtype=model.dtype, backend=backend,
                                    kv_cache_dtype=fmt_name)
        got = model.generate(**{cache_keyword(model): cache}, **kw)
    finally:
        unpatch(model)
    assert cache.key_pools[0].rotation is not None                   # the formats rotate by default
    fast_extend, first_extend = _extend_names(fmt_name, torch.float16, 64)
    assert _fast_name(fmt_name, torch.float16, 64) in backend.launcher.launches
    assert fast_extend in backend.launcher.launches                  # the prompt: the tensor-core extend
    assert _first_name(fmt_name, torch.float16, 64) not in backend.launcher.launches
    assert first_extend not in backend.launcher.launches
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, atol=5e-3, rtol=1e-3)


def test_self_check_passes_on_agreeing_kernels_and_falls_back_on_a_mismatch(shim_libraries, monkeypatch, caplog):
    """The first-use check (on a GPU; pointed at the shim here) compares the quantised fast decode with
    attention.cu's: the real kernels pass; a fake 10% off on one row fails it, which is logged, and
    attention.cu serves the call with correct results."""
    case = _case("int8", 64, torch.float16, 4)
    good = harness.shim_backend(shim_libraries)
    good.self_check_devices = ("cpu",)
    out, ref = _decode(good, case)
    key = (torch.device("cpu"), torch.float16, 64, "int8")
    assert good.checked == {key: True}
    assert good.launcher.launches[-1] == _fast_name("int8", torch.float16, 64)
    torch.testing.assert_close(out, ref, atol=1e-3 * ref.abs().max().item(), rtol=0)

    real = cuda_fast.decode_fast_quantised

    def off_on_one_row(*args):
        result = real(*args)
        result[0] *= 1.1
        return result

    monkeypatch.setattr(cuda_fast, "decode_fast_quantised", off_on_one_row)
    bad = harness.shim_backend(shim_libraries)
    bad.self_check_devices = ("cpu",)
    with caplog.at_level("ERROR", logger="hf_paged.backends.cuda_backend"):
        out, ref = _decode(bad, case)
    assert "disagrees with attention.cu's" in caplog.text and "int8" in caplog.text
    assert bad.checked == {key: False}
    assert bad.launcher.launches[-1] == _first_name("int8", torch.float16, 64)
    torch.testing.assert_close(out, ref, atol=1e-3 * ref.abs().max().item(), rtol=0)


def _extend(backend, case, window=0):
    query, (k_pool, v_pool), _, tables, lens, pos = case
    scale = query.shape[-1] ** -0.5
    out = backend.extend_attention(query, k_pool, v_pool, tables, lens, pos, scale, window)
    ref = qt.extend_attention(query, k_pool, v_pool, tables, lens, pos, scale, window)
    return out.float(), ref.float()


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("group", [1, 8])
def test_extend_attention_routes_to_the_quantised_tensor_core_extend(shim_libraries, fmt_name, group):
    backend = harness.shim_backend(shim_libraries, schedule="warp_ahead")
    out, ref = _extend(backend, extend_case(fmt_name, 64, torch.float16, group, 16), window=9 if group == 8 else 0)
    assert backend.launcher.launches == [_extend_names(fmt_name, torch.float16, 64)[0]]
    torch.testing.assert_close(out, ref, atol=1.5 * 2 ** -10 * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("reason", ["fp32 query", "fast_kernels=False"])
def test_ineligible_extends_stay_on_attention_cu(shim_libraries, reason):
    query, *rest = extend_case("int8", 64, torch.float16, 4, 16)
    if reason == "fp32 query":
        query = query.float()
    backend = harness.shim_backend(shim_libraries, fast_kernels=reason != "fast_kernels=False")
    assert cuda_fast.eligible_quantised_extend(query, rest[0][0]) == (reason == "fast_kernels=False")
    out, ref = _extend(backend, (query, *rest))
    assert backend.launcher.launches == [_extend_names("int8", query.dtype, 64)[1]]
    torch.testing.assert_close(out, ref, atol=2e-3 * ref.abs().max().item(), rtol=0)


def test_extend_self_check_passes_on_agreeing_kernels_and_falls_back_on_a_mismatch(shim_libraries, monkeypatch,
                                                                                   caplog):
    """The first-use check (on a GPU; pointed at the shim here) compares the quantised tensor-core extend
    with attention.cu's quantised extend: the real kernel passes; a fake 10% off on one token fails it,
    which is logged, and attention.cu serves the call with correct results."""
    case = extend_case("int4", 64, torch.bfloat16, 4, 16)
    fast, first = _extend_names("int4", torch.bfloat16, 64)
    key = (torch.device("cpu"), torch.bfloat16, 64, "int4", "extend")
    good = harness.shim_backend(shim_libraries)
    good.self_check_devices = ("cpu",)
    out, ref = _extend(good, case)
    assert good.checked == {key: True}
    assert good.launcher.launches[-1] == fast and first in good.launcher.launches      # the check ran both
    torch.testing.assert_close(out, ref, atol=1.5 * 2 ** -7 * ref.abs().max().item(), rtol=0)

    real = cuda_fast.ragged_attention_quantised

    def off_on_one_token(*args):
        result = real(*args)
        result[0] *= 1.1
        return result

    monkeypatch.setattr(cuda_fast, "ragged_attention_quantised", off_on_one_token)
    bad = harness.shim_backend(shim_libraries)
    bad.self_check_devices = ("cpu",)
    with caplog.at_level("ERROR", logger="hf_paged.backends.cuda_backend"):
        out, ref = _extend(bad, case)
    assert "quantised tensor-core extend" in caplog.text and "int4" in caplog.text
    assert bad.checked == {key: False}
    assert bad.launcher.launches[-1] == first
    torch.testing.assert_close(out, ref, atol=1.5 * 2 ** -7 * ref.abs().max().item(), rtol=0)
