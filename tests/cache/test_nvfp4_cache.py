"""kv_cache_dtype="nvfp4" end to end (the codec: test_nvfp4_codec.py; the KL/regret bounds of generate,
beams, sampling and the engine with prefix hits: integrations/test_kv_quant_quality.py): no CUDA kernel
reads it, so every device runs the PyTorch path; the engine under preemption gives the tokens it gives
without memory pressure; the server's flag takes the value."""
import logging

import torch

import hf_paged
from hf_paged.backends import TorchBackend
from hf_paged.backends.kernel_registry import has_kernels
from hf_paged.cache import KVPools
from hf_paged.cli import build_parser
from hf_paged.kv_formats import QuantizedPool, kv_format
from tiny_models import make_model


class _KernelBackend:
    """Stands in for the CUDA backend: a backend that is not the PyTorch path."""


def test_no_kernel_reads_nvfp4_so_the_pytorch_path_serves_it(caplog):
    fmt = kv_format("nvfp4")
    assert not has_kernels(fmt) and not has_kernels(kv_format("kivi"))
    assert has_kernels(None) and has_kernels(kv_format("int4"))
    pools = KVPools(make_model("llama").config, backend=_KernelBackend(), kv_format=fmt)
    pools.allocate_pools(4, 16, torch.float32, torch.device("cpu"))
    assert isinstance(pools.backend, TorchBackend) and isinstance(pools.key_pools[0], QuantizedPool)
    assert pools.key_pools[0].rotation is not None
    kept = KVPools(make_model("llama").config, backend=_KernelBackend(), kv_format=kv_format("int4"))
    kept.allocate_pools(4, 16, torch.float32, torch.device("cpu"))
    assert isinstance(kept.backend, _KernelBackend)             # formats with kernels keep the given backend
    with caplog.at_level(logging.INFO, logger="hf_paged.cache"):
        pools._without_cuda_kernels(torch.device("cpu"), [torch.device("cpu")])
        assert not caplog.records                               # the CPU: nothing to say
        pools.backend = _KernelBackend()
        pools._without_cuda_kernels(torch.device("cuda"), [torch.device("cuda")])
    assert [r.getMessage() for r in caplog.records] == [
        "kv_cache_dtype='nvfp4' has no CUDA kernel: attention runs on the PyTorch path"]
    assert isinstance(pools.backend, TorchBackend)


def test_engine_under_preemption_and_prefix_hits_gives_the_unpressured_tokens(one_torch_thread):
    model = make_model("llama", seed=3)
    prompts = [list(range(3, 43)), list(range(3, 43)) + [7, 8], list(range(50, 95)), list(range(9, 30))]
    roomy = hf_paged.LLM(model, kv_cache_dtype="nvfp4", block_size=16, num_blocks=64, max_num_seqs=8)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, max_new_tokens=30, do_sample=False,
                                                            ignore_eos=True)]
    tight = hf_paged.LLM(model, kv_cache_dtype="nvfp4", block_size=16, num_blocks=9, max_num_seqs=4,
                         enable_prefix_caching=True)
    outs = tight.generate(prompts * 2, max_new_tokens=30, do_sample=False, ignore_eos=True)
    assert tight.engine.counters.preemptions > 0 and tight.stats()["prefix_hit_tokens"] > 0
    assert [o.outputs[0].token_ids for o in outs] == want * 2
    assert tight.stats()["bytes_per_token"] == 2 * 2 * 2 * (32 + 4 + 2)      # 2 layers x K/V x 2 heads, D=64


def test_serve_takes_nvfp4():
    args = build_parser().parse_args(["serve", "m", "--kv-cache-dtype", "nvfp4"])
    assert args.kv_cache_dtype == "nvfp4"
