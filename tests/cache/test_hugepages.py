"""hf_paged.hugepages: big buffers start on a 2 MiB boundary and are advised onto huge pages before their
first touch; small ones are ordinary; the engine's packed weights and the CPU pools use them."""
from __future__ import annotations

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


def test_engine_packed_weights_share_one_huge_page_buffer(monkeypatch):
    """The kernel's packed float32 weights are moved into one buffer (past MIN_BYTES), numbers unchanged."""
    from hf_paged.engine.prepack import PrepackedLinears
    monkeypatch.setattr("hf_paged.engine.prepack.MIN_BYTES", 0)
    monkeypatch.setattr(hugepages, "MIN_BYTES", 0)
    model = make_model("llama", seed=9)
    packed = PrepackedLinears(model, group_siblings=True)
    kernel = {id(p.packed): p.packed for p in (layer.packed for layer in packed.layers) if p.ops is not None}
    assert len(kernel) > 2
    storages = {t.untyped_storage().data_ptr() for t in kernel.values()}
    assert len(storages) == 1, "one buffer"
    x = torch.randn(3, model.config.hidden_size)
    q = model.model.layers[0].self_attn.q_proj
    with packed.installed(), torch.inference_mode():
        torch.testing.assert_close(q(x), torch.nn.functional.linear(x, q.weight), rtol=1e-5, atol=1e-5)


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
