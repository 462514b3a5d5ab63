"""End to end on the CPU: a tiny Llama generates through PagedCache with the CUDA kernels run by the
shim (write_kv, copy_blocks, decode, extend) and gives the same tokens as the PyTorch paths."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList

import harness
import hf_paged
from hf_paged.backends import TorchBackend
from hf_paged.attention_interface import cache_keyword
from hf_paged.integrations.patching import patch, unpatch

PAD, EOS = 0, 1


def tiny_llama(dtype):
    config = LlamaConfig(vocab_size=256, hidden_size=256, num_hidden_layers=2, intermediate_size=256,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                         pad_token_id=PAD, eos_token_id=EOS, bos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    return model


def left_padded(lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), max(lengths)), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, -n:] = torch.randint(3, 256, (n,), generator=gen)
        mask[row, -n:] = 1
    return ids, mask


@pytest.mark.parametrize("mode", [dict(do_sample=False), dict(do_sample=False, num_beams=4, num_return_sequences=2)],
                         ids=["greedy", "beam4"])
def test_generate_through_shim_kernels(shim_libraries, mode):
    model = tiny_llama(torch.float32)
    ids, mask = left_padded([9, 1, 17])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, **mode)
    reference = model.generate(**kw)                       # transformers' DynamicCache + sdpa
    patch(model, block_size=8)
    try:
        torch_paged = model.generate(cache_implementation="paged", **kw)
        backend = harness.shim_backend(shim_libraries, schedule="warp_ahead")
        cache = hf_paged.PagedCache(model.config, block_size=8, dtype=model.dtype, backend=backend)
        kernel_paged = model.generate(**{cache_keyword(model): cache}, **kw)
    finally:
        unpatch(model)
    launched = set(backend.launcher.launches)
    assert {"hfp_write_kv_f32", "hfp_extend_f32_d64", "hfp_decode_f32_d64"} <= launched
    if "num_beams" in mode:
        assert "hfp_copy_blocks" in launched
    assert torch.equal(torch_paged, reference)
    assert torch.equal(kernel_paged, reference)


class SnapshotCodes(StoppingCriteria):
    """After every generate step: a copy of every layer's key and value codes and scales."""

    def __init__(self, cache):
        self.cache, self.steps = cache, []

    def __call__(self, input_ids, scores, **kwargs):
        self.steps.append([(p.data.clone(), p.scales.clone()) for p in (*self.cache.key_pools, *self.cache.value_pools)])
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def first_rounding_step(a: SnapshotCodes, b: SnapshotCodes, kv_cache_dtype: str) -> int:
    """The first step whose stored codes differ between the two runs (len(steps) if none), after checking
    that the difference there is a rounding one: a few codes one step apart under equal scales. Two
    attention implementations sum in different orders, so an element computed after them can land on the
    other side of a code boundary (seen with int8 on an AVX-512 CPU, whose GEMMs sum differently)."""
    for step, (xs, ys) in enumerate(zip(a.steps, b.steps)):
        if all(torch.equal(x, y) for pair in zip(xs, ys) for x, y in zip(*pair)):
            continue
        flips = written = 0
        for (codes_a, scales_a), (codes_b, scales_b) in zip(xs, ys):
            if kv_cache_dtype == "int8":
                ca, cb = codes_a.view(torch.int8).int(), codes_b.view(torch.int8).int()
            else:                                   # int4: two unsigned nibbles per byte
                ca = torch.stack([codes_a & 15, codes_a >> 4], -1).int()
                cb = torch.stack([codes_b & 15, codes_b >> 4], -1).int()
            assert (ca - cb).abs().max() <= 1, f"step {step}: codes differ by more than one step"
            # a flipped code can move an int4 group's minimum/scale a little; int8's per-row scale stays
            assert kv_cache_dtype != "int8" or torch.equal(scales_a, scales_b), f"step {step}: scales differ"
            flips += int((ca != cb).sum())
            written += int((ca != 0).sum())
        assert 0 < flips <= max(4, written // 500), f"step {step}: {flips} of {written} codes differ"
        return step
    return len(a.steps)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_quantised_generate_through_shim_kernels_matches_the_torch_path(shim_libraries, kv_cache_dtype):
    """The wiring above the kernels (rotation in KVPools.write and Step.attend, f32 rotated writes,
    per-group copy_blocks) with the quantised kernels: the same codes and logits as the quantised PyTorch
    path, step after step, up to the first step where a code rounds the other way (checked to be only
    that); from there on the two runs may part, as any two summation orders may under quantisation."""
    model = tiny_llama(torch.float32)
    ids, mask = left_padded([9, 1, 17])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, num_beams=3,
              output_scores=True, return_dict_in_generate=True)
    patch(model, block_size=8)
    try:
        # the PyTorch path itself (not the CPU kernel, whose fused rotate-and-quantise write may round a code
        # at a boundary the other way)
        torch_cache = hf_paged.PagedCache(model.config, block_size=8, dtype=model.dtype, backend=TorchBackend(),
                                          kv_cache_dtype=kv_cache_dtype)
        torch_codes = SnapshotCodes(torch_cache)
        torch_paged = model.generate(**{cache_keyword(model): torch_cache}, **kw,
                                     stopping_criteria=StoppingCriteriaList([torch_codes]))
        backend = harness.shim_backend(shim_libraries, schedule="warp_ahead")
        cache = hf_paged.PagedCache(model.config, block_size=8, dtype=model.dtype, backend=backend,
                                    kv_cache_dtype=kv_cache_dtype)
        kernel_codes = SnapshotCodes(cache)
        kernel_paged = model.generate(**{cache_keyword(model): cache}, **kw,
                                      stopping_criteria=StoppingCriteriaList([kernel_codes]))
    finally:
        unpatch(model)
    tag = {"int8": "int8", "int4": "int4"}[kv_cache_dtype]
    launched = set(backend.launcher.launches)
    assert {f"hfp_write_kv_{tag}_f32", f"hfp_extend_{tag}_f32_d64", f"hfp_decode_{tag}_f32_d64"} <= launched, launched
    assert any(name.startswith("hfp_copy_blocks") for name in launched)
    assert len(kernel_codes.steps) == len(torch_codes.steps) == len(kernel_paged.scores)
    same_until = first_rounding_step(kernel_codes, torch_codes, kv_cache_dtype)
    # a step's scores read the codes that step wrote: equal through the last step before any code differs
    for a, b in zip(kernel_paged.scores[:same_until], torch_paged.scores[:same_until]):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    if same_until == len(kernel_codes.steps):
        assert torch.equal(kernel_paged.sequences, torch_paged.sequences)


def test_engine_packed_steps_through_the_fast_kernels(shim_libraries, dtype=torch.float16):
    """The engine's packed steps (decode rows and prefill chunks together, chunked prefill under a small
    token budget) through the tensor-core ragged kernel give the tokens of the same engine on the CPU.
    fp16 only: in bf16 the kernel rounds probabilities to bf16 before P @ V (as FlashAttention does), so
    on this random tiny model (near-flat logits) a greedy token can flip; bf16 outputs are checked
    within tolerance in test_fast_kernels.py."""
    from hf_paged import LLM
    model = tiny_llama(dtype)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 30, 1, 17, 44)]
    knobs = dict(block_size=8, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=24)
    reference = LLM(model, **knobs).generate(prompts, max_new_tokens=6)
    llm = LLM(model, **knobs)
    backend = harness.shim_backend(shim_libraries, schedule="warp_ahead")
    llm.engine.cache.backend = backend
    outs = llm.generate(prompts, max_new_tokens=6)
    tag = {torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    assert f"hfp_ragged_{tag}_d64" in backend.launcher.launches
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]


def test_fp16_generate_through_the_fast_kernels(shim_libraries):
    """Padded generate in fp16: prefill on the ragged tensor-core kernel, decode (GQA 4) on the pipelined
    CUDA-core kernel, the same greedy and beam tokens as the PyTorch paged path."""
    model = tiny_llama(torch.float16)
    ids, mask = left_padded([9, 1, 17])
    patch(model, block_size=8)
    try:
        for mode in (dict(do_sample=False), dict(do_sample=False, num_beams=3)):
            kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, **mode)
            torch_paged = model.generate(cache_implementation="paged", **kw)
            backend = harness.shim_backend(shim_libraries, schedule="warp_ahead")
            cache = hf_paged.PagedCache(model.config, block_size=8, dtype=model.dtype, backend=backend)
            kernel_paged = model.generate(**{cache_keyword(model): cache}, **kw)
            assert {"hfp_ragged_f16_d64", "hfp_decode_fast_f16_d64"} <= set(backend.launcher.launches)
            assert torch.equal(kernel_paged, torch_paged), mode
    finally:
        unpatch(model)


def test_a_second_generate_loads_nothing_and_checks_nothing_again(shim_libraries, monkeypatch):
    """One backend per device and process: the caches of two paged generate calls share it, so its
    kernel modules load and the fast kernels' first-use self-check runs once (here the shim's kernels
    stand in for the GPU's, with the self-check enabled on the CPU)."""
    from hf_paged import backends
    from hf_paged.backends import cuda_fast
    shim = harness.shim_backend(shim_libraries, schedule="warp_ahead")
    shim.self_check_devices = ("cpu",)
    built, checks = [], []
    registry = backends.BackendRegistry(build=lambda kind: built.append(kind) or shim)
    monkeypatch.setattr(backends, "_process_backends", lambda: registry)
    real_check = cuda_fast.self_check
    monkeypatch.setattr(cuda_fast, "self_check", lambda *a: checks.append(a[1:]) or real_check(*a))
    model = tiny_llama(torch.float16)
    ids, mask = left_padded([9, 1, 17])
    caches = [hf_paged.PagedCache(model.config, block_size=8) for _ in range(2)]
    patch(model, block_size=8)
    try:
        outputs = [model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                  **{cache_keyword(model): cache}) for cache in caches]
        launches_after_first = len(shim.launcher.launches)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                       cache_implementation="paged")
    finally:
        unpatch(model)
    assert caches[0].backend is caches[1].backend is shim
    assert built == [backends.backend_kind(torch.device("cpu"))]                 # built once
    assert checks == [(torch.device("cpu"), torch.float16, 64)]                  # checked once
    assert shim.checked == {(torch.device("cpu"), torch.float16, 64): True}
    assert len(shim.launcher.launches) > launches_after_first                    # the third call ran on it too
    assert torch.equal(outputs[0], outputs[1])
