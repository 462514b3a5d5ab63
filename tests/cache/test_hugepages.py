"""hf_paged.hugepages: big buffers start on a 2 MiB boundary and are advised onto huge pages before their
first touch; small ones are ordinary; the engine's packed weights and the CPU pools use them."""
from __future__ import annotations

import pytest
import torch

from hf_paged import hugepages
from hf_paged.hugepages import HUGE_PAGE, MIN_BYTES, huge_page_buffer
from tiny_models import make_model


def test_big_buffers_are_aligned_and_advised_small_ones_are_ordinary(monkeypatch):
    advised = []
    advise = hugepages._advise
    monkeypatch.setattr(hugepages, "_advise", lambda address, n: advised.append((address, n)) or advise(address, n))
    numel = MIN_BYTES // 4 + 5                       # not a whole number of huge pages
    big = huge_page_buffer(numel, torch.float32)
    assert big.shape == (numel,) and big.dtype == torch.float32 and big.data_ptr() % HUGE_PAGE == 0
    assert advised == [(big.data_ptr(), -(-numel * 4 // HUGE_PAGE) * HUGE_PAGE)], "advised before any write"
    big.fill_(1.5)
    assert float(big[-1]) == 1.5 and float(big.sum()) == 1.5 * numel
    small = huge_page_buffer(1000, torch.bfloat16)
    assert small.shape == (1000,) and small.dtype == torch.bfloat16 and len(advised) == 1


def test_a_refused_advice_leaves_an_ordinary_buffer(monkeypatch):
    monkeypatch.setattr(hugepages, "_advise", lambda address, n: False)
    buf = huge_page_buffer(MIN_BYTES // 2, torch.bfloat16)
    buf.zero_()
    assert buf.numel() == MIN_BYTES // 2 and float(buf.abs().sum()) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_engine_packed_weights_share_one_huge_page_buffer(dtype, monkeypatch):
    """The kernel's packed float32 (and, where built, bf16) weights are moved into one buffer (past MIN_BYTES),
    each at a 64-byte boundary, numbers unchanged."""
    from hf_paged.engine.cpu_ops import load_fused_ops
    from hf_paged.engine.prepack import LIBRARY_ENV, PrepackedLinears
    if dtype == torch.bfloat16 and not load_fused_ops().linear_bf16_available():
        pytest.skip("no bf16 kernel in this build (AVX-512 BF16): bf16 weights are oneDNN's")
    if dtype == torch.float32 and not load_fused_ops().linear_hardware_fma():
        pytest.skip("this build's linear kernel has no hardware FMA: float32 weights are oneDNN's")
    monkeypatch.setenv(LIBRARY_ENV, "0")
    monkeypatch.setattr("hf_paged.engine.prepack.MIN_BYTES", 0)
    monkeypatch.setattr(hugepages, "MIN_BYTES", 0)
    model = make_model("llama", seed=9).to(dtype)
    packed = PrepackedLinears(model, group_siblings=True)
    kernel = {id(p.packed): p.packed for p in (layer.packed for layer in packed.layers) if p.ops is not None}
    assert len(kernel) > 2
    storages = {t.untyped_storage().data_ptr() for t in kernel.values()}
    assert len(storages) == 1, "one buffer"
    assert all(t.data_ptr() % 64 == 0 and t.dtype == dtype for t in kernel.values())
    x = torch.randn(3, model.config.hidden_size).to(dtype)
    q = model.model.layers[0].self_attn.q_proj
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    with packed.installed(), packed.running(), torch.inference_mode():
        torch.testing.assert_close(q(x), torch.nn.functional.linear(x, q.weight), rtol=tol, atol=tol)


def test_cpu_pools_are_zeroed_views_of_one_buffer(monkeypatch):
    from hf_paged.cache.paged_cache import PagedCache
    monkeypatch.setattr(hugepages, "MIN_BYTES", 0)
    model = make_model("qwen2", seed=1)
    cache = PagedCache(model.config)
    cache.allocate_pools(num_blocks=8, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    pools = cache.key_pools + cache.value_pools
    assert len(pools) == 2 * model.config.num_hidden_layers
    assert len({p.untyped_storage().data_ptr() for p in pools}) == 1
    assert all(p.shape == pools[0].shape and p.is_contiguous() and float(p.abs().sum()) == 0 for p in pools)
    pools[0].fill_(1.0)                                              # views do not overlap
    assert all(float(p.abs().sum()) == 0 for p in pools[1:])


@pytest.mark.parametrize("kv", ["int8", "int4", "nvfp4"])
def test_quantised_cpu_pools_are_views_of_one_buffer(kv, monkeypatch):
    """Quantised CPU pools: every layer's codes and scales in one buffer (zero codes, unit scales, as
    QuantizedPool.zeros makes them), no two tensors overlapping, each on a cache line, one R shared; a greedy
    run on them gives the tokens of pools allocated one by one."""
    from hf_paged.cache.paged_cache import PagedCache
    from hf_paged.engine import LLM
    from hf_paged.kv_formats import QuantizedPool
    monkeypatch.setattr(hugepages, "MIN_BYTES", 0)
    model = make_model("llama", seed=2)
    cache = PagedCache(model.config, kv_cache_dtype=kv)
    cache.allocate_pools(num_blocks=8, block_size=16, dtype=torch.float32, device=torch.device("cpu"))
    pools = cache.key_pools + cache.value_pools
    tensors = [t for pool in pools for t in (pool.data, pool.scales)]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert len({id(pool.rotation) for pool in pools}) == 1 and pools[0].rotation is not None
    fresh = QuantizedPool.zeros(pools[0].fmt, *pools[0].shape, device=torch.device("cpu"))
    for pool in pools:
        assert torch.equal(pool.data, fresh.data) and torch.equal(pool.scales, fresh.scales)
        assert pool.data.is_contiguous() and pool.scales.is_contiguous()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "no two tensors overlap"
    assert all(start % 64 == 0 for start, _ in spans)

    def tokens():
        llm = LLM(model, kv_cache_dtype=kv, num_blocks=64, max_num_batched_tokens=128)
        outs = llm.generate([[5, 9, 2, 44, 7] * 7, [3, 1, 4, 1, 5, 9, 2, 6]], max_new_tokens=6, do_sample=False,
                            ignore_eos=True, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    one_buffer = tokens()
    monkeypatch.setattr(PagedCache, "_cpu_quantised_pools", lambda self, shape, count, rotation: [
        QuantizedPool.zeros(self.kv_format, *shape, device=torch.device("cpu"), rotation=rotation)
        for _ in range(count)])
    assert tokens() == one_buffer


def test_collapse_merges_near_ranges_and_advises_their_whole_huge_pages(monkeypatch):
    calls = []
    monkeypatch.setattr(hugepages, "_advise", lambda address, n, advice=14: calls.append((address, n, advice)) or True)
    P = HUGE_PAGE
    ranges = [(10 * P + 100, P), (11 * P + 4196, 3 * P), (40 * P, P // 2), (50 * P - 64, 2 * P + 128)]
    done = hugepages.collapse_onto_huge_pages(ranges)
    # the first two merge (gap 4 KiB): 10P+100 .. 14P+4196 -> whole pages 11P .. 14P; the third has no whole page;
    # the fourth: 50P-64 .. 52P+64 -> 50P .. 52P
    assert calls == [(11 * P, 3 * P, 25), (50 * P, 2 * P, 25)] and done == 5 * P
    monkeypatch.setattr(hugepages, "_advise", lambda address, n, advice=14: False)      # an older kernel
    assert hugepages.collapse_onto_huge_pages(ranges) == 0


def test_onednn_packed_weights_are_collapsed(monkeypatch):
    from hf_paged.engine import prepack
    monkeypatch.setenv(prepack.LIBRARY_ENV, "1")          # bf16 on oneDNN (as on CPUs with AMX)
    from hf_paged.engine.prepack import PrepackedLinears, prepack_available
    if not prepack_available(torch.bfloat16):
        import pytest
        pytest.skip("oneDNN has no bf16 kernels on this CPU")
    seen = []
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)
    monkeypatch.setattr(prepack, "collapse_onto_huge_pages", lambda ranges: seen.extend(ranges) or 0)
    model = make_model("llama", seed=3).to(torch.bfloat16)
    packed = PrepackedLinears(model, group_siblings=True)
    assert len(seen) == len({id(layer.packed) for layer in packed.layers}) > 0
    assert all(n > 0 and address > 0 for address, n in seen)


def test_a_failing_onednn_address_query_leaves_packing_intact(monkeypatch):
    """Where torch's mkldnn address ops raise, the weights are packed as before (only the pages differ)."""
    from hf_paged.engine import prepack
    monkeypatch.setenv(prepack.LIBRARY_ENV, "1")          # bf16 on oneDNN (as on CPUs with AMX)
    from hf_paged.engine.prepack import PrepackedLinears, prepack_available
    if not prepack_available(torch.bfloat16):
        import pytest
        pytest.skip("oneDNN has no bf16 kernels on this CPU")

    real = torch.ops.mkldnn

    class Ops:                                          # torch.ops.mkldnn with a data_ptr that raises
        def __getattr__(self, name):
            if name == "data_ptr":
                def raise_(*args):
                    raise RuntimeError("data_ptr: not an mkldnn tensor")
                return raise_
            return getattr(real, name)
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)
    monkeypatch.setattr(prepack.torch.ops, "mkldnn", Ops(), raising=False)
    model = make_model("llama", seed=5).to(torch.bfloat16)
    packed = PrepackedLinears(model, group_siblings=True)
    assert packed.layers
