"""The engine's prepacked linears (hf_paged.engine.prepack): same outputs as F.linear, installed only
inside the engine's steps, stale weights never used, and enforce_eager skips them."""
from __future__ import annotations

import pytest
import torch

from hf_paged.engine import LLM, Engine
from hf_paged.engine.prepack import PrepackedLinears, prepack_available
from tiny_models import make_model

pytestmark = pytest.mark.skipif(not prepack_available(torch.float32), reason="this torch build has no oneDNN")


def test_packed_forward_equals_linear_and_is_removed_on_exit():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 80, bias=False))
    x = torch.randn(3, 5, 64)
    with torch.inference_mode():
        ref = model(x)
    packed = PrepackedLinears(model)
    assert len(packed.layers) == 2 and packed.bytes > 0
    with packed.installed(), packed.installed(), packed.running():                # nested: one installation
        assert all("forward" in m.__dict__ for m in model)
        with torch.inference_mode():
            out = model(x)
    assert all("forward" not in m.__dict__ for m in model)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_changed_or_replaced_weights_and_grad_fall_back_to_linear():
    torch.manual_seed(1)
    layer = torch.nn.Linear(32, 16)
    packed = PrepackedLinears(layer)
    x = torch.randn(4, 32)
    with packed.installed(), packed.running():
        with torch.no_grad():
            layer.weight.mul_(2)                                    # in place: the packed copy is stale
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
            layer.weight = torch.nn.Parameter(torch.randn(16, 32))  # replaced
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        y = layer(x.requires_grad_())                               # training: autograd through F.linear
        y.sum().backward()
        assert x.grad is not None


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_tokens_equal_with_and_without_prepacking(family):
    model = make_model(family, seed=3)
    prompts = [[3, 9, 27, 4, 11], list(range(5, 40)), [7] * 18]
    outs = {}
    for eager in (False, True):
        llm = LLM(model, enforce_eager=eager, max_num_batched_tokens=32, num_blocks=64)
        assert (llm.engine.prepacked is None) == eager
        outs[eager] = [o.outputs[0].token_ids for o in
                       llm.generate(prompts, max_new_tokens=12, do_sample=False, ignore_eos=True, use_tqdm=False)]
    assert outs[False] == outs[True]
    assert all("forward" not in m.__dict__ for m in model.modules()), "the model is left as it was"


def test_enforce_eager_must_be_a_bool():
    with pytest.raises(ValueError, match="enforce_eager"):
        Engine(make_model("llama", seed=0), enforce_eager="yes")


def test_inference_tensors_and_a_model_built_in_inference_mode():
    """Inference tensors keep no version counter: packing and calling still work."""
    with torch.inference_mode():
        layer = torch.nn.Linear(16, 8)
        packed = PrepackedLinears(layer)
        x = torch.randn(3, 16)
        with packed.installed(), packed.running():
            out = layer(x)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_no_packing_when_the_copies_would_crowd_memory(monkeypatch, caplog):
    import logging

    from hf_paged.engine import prepack
    layer = torch.nn.Linear(64, 64)
    monkeypatch.setattr(prepack, "available_bytes", lambda: 2 * 64 * 64 * 4 - 1)
    with caplog.at_level(logging.WARNING, logger="hf_paged.engine"):
        packed = PrepackedLinears(layer)
    assert packed.layers == [] and "not prepacking" in caplog.text and "enforce_eager" in caplog.text
    monkeypatch.setattr(prepack, "available_bytes", lambda: 2 * 64 * 64 * 4)
    assert len(PrepackedLinears(layer).layers) == 1


@pytest.mark.parametrize("family", ["llama", "qwen2", "glm"])
def test_sibling_groups_give_each_modules_own_numbers(fp32_kernel, family, monkeypatch):
    """q/k/v (with biases in qwen2 and glm) and gate/up packed as one weight: the same bits as packed apart;
    with the library for large steps (as on Intel CPUs), those steps are F.linear per module."""
    from hf_paged.engine.prepack import LIBRARY_ENV, LIBRARY_ROWS, sibling_outputs
    monkeypatch.setenv(LIBRARY_ENV, "1")
    model = make_model(family, seed=4)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    x = torch.randn(5, model.config.hidden_size)
    apart = PrepackedLinears(model)
    with apart.installed(), apart.running(), torch.inference_mode():
        ref = [m(x) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
        mlp_ref = None if family == "glm" else [m(x) for m in (mlp.gate_proj, mlp.up_proj)]   # glm: gate_up_proj
        assert sibling_outputs((attn.q_proj, attn.k_proj, attn.v_proj), x) is None      # not grouped
    grouped = PrepackedLinears(model, group_siblings=True)
    assert grouped.bytes == apart.bytes, "a group holds its members' weights once"
    with grouped.installed(), grouped.running(), torch.inference_mode():
        got = sibling_outputs((attn.q_proj, attn.k_proj, attn.v_proj), x)
        assert got is not None and all(torch.equal(a, b) for a, b in zip(got, ref))
        assert all(torch.equal(m(x), r) for m, r in zip((attn.q_proj, attn.k_proj, attn.v_proj), ref))   # alone
        assert sibling_outputs((attn.k_proj, attn.q_proj, attn.v_proj), x) is None                     # other order
        wide = torch.randn(LIBRARY_ROWS + 1, model.config.hidden_size)        # prefill-sized: F.linear per module
        assert all(torch.equal(a, torch.nn.functional.linear(wide, m.weight, m.bias)) for a, m in
                   zip(sibling_outputs((attn.q_proj, attn.k_proj, attn.v_proj), wide), (attn.q_proj, attn.k_proj, attn.v_proj)))
        if mlp_ref is not None:
            pair = sibling_outputs((mlp.gate_proj, mlp.up_proj), x)
            assert pair is not None and all(torch.equal(a, b) for a, b in zip(pair, mlp_ref))
        with torch.no_grad():
            attn.k_proj.weight.mul_(2)                                       # a stale member: the group stands down
        assert sibling_outputs((attn.q_proj, attn.k_proj, attn.v_proj), x) is None
        torch.testing.assert_close(attn.k_proj(x), torch.nn.functional.linear(x, attn.k_proj.weight, attn.k_proj.bias))


def test_a_hooked_sibling_keeps_its_call_in_the_fused_forward():
    """The fused attention calls q/k/v as one packed group only when none of them has hooks."""
    model = make_model("llama", seed=2)
    seen = []
    model.model.layers[1].self_attn.v_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    llm = LLM(model, max_num_batched_tokens=32, num_blocks=64)
    llm.generate([[3, 9, 27, 4, 11]], max_new_tokens=3, do_sample=False, ignore_eos=True, use_tqdm=False)
    assert len(seen) == 3, "the hook ran at every step"


needs_mkl = pytest.mark.skipif(not __import__("hf_paged.engine.prepack", fromlist=["x"]).mkl_packing_available(),
                               reason="this torch build has no MKL packed GEMM")


@needs_mkl
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_mkl_copy_for_budget_sized_steps_gives_f_linears_bits(fp32_kernel, family, monkeypatch):
    """Steps of exactly ``prefill_rows`` rows read MKL's packed copy (grouped q/k/v with qwen2's biases, gate/up,
    o, down): the same bits as F.linear per module; other large steps and a group's member alone run F.linear;
    the LM head gets no copy."""
    from hf_paged.engine import prepack
    from hf_paged.engine.prepack import LIBRARY_ENV, LIBRARY_ROWS, _PrefillPack, sibling_outputs
    monkeypatch.setenv(LIBRARY_ENV, "1")        # the library over LIBRARY_ROWS rows, as on Intel CPUs
    calls = []
    product = _PrefillPack.product
    monkeypatch.setattr(_PrefillPack, "product", lambda self, flat, bias: calls.append(flat.shape[0]) or
                        product(self, flat, bias))
    model = make_model(family, seed=6)
    with torch.no_grad():                   # (transformers initialises biases to zero)
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_()
    rows = LIBRARY_ROWS + 8
    packed = PrepackedLinears(model, group_siblings=True, prefill_rows=rows)
    head = model.get_output_embeddings()
    assert all((layer.packed.prefill is None) == (layer.module is head) for layer in packed.layers)
    assert packed.prefill_bytes > 0
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
    F = torch.nn.functional
    with packed.installed(), packed.running(), torch.inference_mode():
        for n in (rows, rows + 1, LIBRARY_ROWS + 1):
            x = torch.randn(n, model.config.hidden_size)
            before = len(calls)
            got = sibling_outputs(qkv, x)
            assert all(torch.equal(a, F.linear(x, m.weight, m.bias)) for a, m in zip(got, qkv))
            assert torch.equal(attn.o_proj(x[:, :attn.o_proj.in_features]),
                               F.linear(x[:, :attn.o_proj.in_features], attn.o_proj.weight))
            assert torch.equal(mlp.up_proj(x), F.linear(x, mlp.up_proj.weight))           # a member alone
            assert len(calls) - before == (2 if n == rows else 0), "MKL's copy for exactly its rows only"
        with pytest.raises(ValueError, match="for 136 rows, got 3"):
            attn.o_proj.forward.packed.prefill.product(torch.randn(3, attn.o_proj.in_features), None)


@needs_mkl
def test_no_mkl_copies_when_memory_is_short_or_steps_are_small(monkeypatch, caplog):
    import logging

    from hf_paged.engine import prepack
    monkeypatch.setenv(prepack.LIBRARY_ENV, "1")
    model = make_model("llama", seed=7)
    assert PrepackedLinears(model, prefill_rows=prepack.LIBRARY_ROWS).prefill_bytes == 0    # our kernel takes them
    weights = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    monkeypatch.setattr(prepack, "available_bytes", lambda: 3 * weights)      # ours fit, MKL's would not
    with caplog.at_level(logging.WARNING, logger="hf_paged.engine"):
        packed = PrepackedLinears(model, prefill_rows=512)
    assert packed.layers and packed.prefill_bytes == 0 and "no MKL copies" in caplog.text


@needs_mkl
@pytest.mark.parametrize("family", ["llama", "glm"])
def test_engine_budget_steps_through_mkls_copy_keep_the_tokens(fp32_kernel, family, monkeypatch):
    """An engine whose token budget is over LIBRARY_ROWS fills whole steps through MKL's copies: the same tokens
    as the same engine with the copies dropped, and the copies were read."""
    from hf_paged.engine.prepack import LIBRARY_ENV, LIBRARY_ROWS, _PrefillPack
    monkeypatch.setenv(LIBRARY_ENV, "1")        # the library over LIBRARY_ROWS rows, as on Intel CPUs
    calls = []
    product = _PrefillPack.product
    monkeypatch.setattr(_PrefillPack, "product", lambda self, flat, bias: calls.append(flat.shape[0]) or
                        product(self, flat, bias))
    model = make_model(family, seed=8)
    budget = LIBRARY_ROWS + 16
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (90, 130, 70, 150)]
    outs = []
    for keep in (True, False):
        llm = LLM(model, max_num_batched_tokens=budget, num_blocks=128)
        if not keep:
            for layer in llm.engine.prepacked.layers:
                layer.packed.prefill = None
        outs.append([o.outputs[0].token_ids for o in
                     llm.generate(prompts, max_new_tokens=6, do_sample=False, ignore_eos=True, use_tqdm=False)])
    assert calls and set(calls) == {budget}
    assert outs[0] == outs[1]


def test_library_rows_follow_the_cpu_vendor_and_the_knob(monkeypatch):
    """MKL's sgemm over LIBRARY_ROWS rows on Intel, AMD without AVX2 + FMA or a vendor not reported, hf_paged's
    kernel for every step on AMD with AVX-512 or AVX2 + FMA; $HF_PAGED_LIBRARY_GEMM forces either way, a bad
    value is refused naming them."""
    from hf_paged.engine import prepack
    monkeypatch.delenv(prepack.LIBRARY_ENV, raising=False)
    avx512, avx2 = {"avx2", "fma", "avx512f"}, {"avx2", "fma"}
    assert prepack.library_rows("GenuineIntel", avx512) == prepack.LIBRARY_ROWS
    assert prepack.library_rows("AuthenticAMD", avx512) is None
    assert prepack.library_rows("AuthenticAMD", avx2) is None                       # Zen 2 / 3: MKL 1.09-1.34x
    assert prepack.library_rows("AuthenticAMD", {"avx2"}) == prepack.LIBRARY_ROWS
    monkeypatch.setattr(prepack, "cpu_vendor", lambda: None)
    assert prepack.library_rows(flags=avx512) == prepack.LIBRARY_ROWS
    monkeypatch.setenv(prepack.LIBRARY_ENV, "0")
    assert prepack.library_rows("GenuineIntel", avx2) is None
    monkeypatch.setenv(prepack.LIBRARY_ENV, "1")
    assert prepack.library_rows("AuthenticAMD", avx512) == prepack.LIBRARY_ROWS
    monkeypatch.setenv(prepack.LIBRARY_ENV, "mkl")
    with pytest.raises(ValueError, match="HF_PAGED_LIBRARY_GEMM='mkl': use 1 .* or 0"):
        prepack.library_rows()


def test_cpu_vendor_reads_cpuinfo(tmp_path):
    from hf_paged.engine.cpu_bf16 import cpu_vendor
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n")
    assert cpu_vendor(info) == "AuthenticAMD"
    info.write_text("processor\t: 0\n")
    assert cpu_vendor(info) is None and cpu_vendor(tmp_path / "absent") is None


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_kernel_for_every_step_keeps_rows_independent_of_the_step(fp32_kernel, family, monkeypatch):
    """With the kernel for every step (AMD's default): no MKL copies, a step of any size through the kernel,
    and each row's output the same bits whatever step it came in (300 rows at once = 7 rows at a time); an
    engine gives the same tokens and logits with prefix caching on as off."""
    from hf_paged.engine import prepack
    from hf_paged.engine.prepack import sibling_outputs
    monkeypatch.setenv(prepack.LIBRARY_ENV, "0")
    model = make_model(family, seed=9)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_()
    packed = PrepackedLinears(model, group_siblings=True, prefill_rows=512)
    assert packed.library_rows is None and packed.prefill_bytes == 0
    attn = model.model.layers[0].self_attn
    qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
    x = torch.randn(300, model.config.hidden_size)
    with packed.installed(), packed.running(), torch.inference_mode():
        whole = sibling_outputs(qkv, x)
        parts = [sibling_outputs(qkv, x[i:i + 7]) for i in range(0, 300, 7)]
    for k, m in enumerate(qkv):
        assert torch.equal(whole[k], torch.cat([p[k] for p in parts]))
        torch.testing.assert_close(whole[k], torch.nn.functional.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
    prompts = [list(range(3, 200)), list(range(3, 150)) + [7, 8]]      # the second shares 9 blocks of 16
    runs = []
    for caching in (False, True):
        llm = LLM(model, max_num_batched_tokens=256, num_blocks=64, enable_prefix_caching=caching)
        steps, forward = [], llm.engine.runner.forward
        monkeypatch.setattr(llm.engine.runner, "forward", lambda *a: steps.append(forward(*a).clone()) or steps[-1])
        outs = [llm.generate([p], max_new_tokens=4, do_sample=False, ignore_eos=True, use_tqdm=False)[0]
                for p in prompts]
        runs.append(([o.outputs[0].token_ids for o in outs], steps[-4:]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1])), "the cached prefix gave other bits"


def test_bf16_linears_take_the_kernel_where_it_is_built(monkeypatch):
    """A bfloat16 model's linears go to hf_paged's bf16 kernel where the extension has it (AVX-512 BF16; every
    step, one copy of the weights, no library over LIBRARY_ROWS rows), else to oneDNN's packed matmul: each
    output within a bf16 step of F.linear's, and a row the same bits alone as in a 300-row step."""
    from hf_paged.engine.cpu_ops import load_fused_ops
    from hf_paged.engine.prepack import LIBRARY_ENV, sibling_outputs
    from hf_paged.engine.cpu_bf16 import cpu_flags
    if not prepack_available(torch.bfloat16):
        pytest.skip("oneDNN has no bf16 kernels on this CPU")
    monkeypatch.delenv(LIBRARY_ENV, raising=False)
    model = make_model("qwen2", seed=10, dtype=torch.bfloat16)
    packed = PrepackedLinears(model, group_siblings=True, prefill_rows=512)
    kernel = bool(load_fused_ops().linear_bf16_available()) and "amx_bf16" not in (cpu_flags() or set())
    assert all((layer.packed.ops is not None) == kernel for layer in packed.layers)
    assert all(layer.packed.library_rows is None for layer in packed.layers) and packed.prefill_bytes == 0
    attn = model.model.layers[0].self_attn
    qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
    x = torch.randn(300, model.config.hidden_size).bfloat16()
    with packed.installed(), packed.running(), torch.inference_mode():
        whole = sibling_outputs(qkv, x)
        one = sibling_outputs(qkv, x[7:8])
    for k, m in enumerate(qkv):
        want = torch.nn.functional.linear(x, m.weight, m.bias).float()
        assert (whole[k].float() - want).abs().max() <= 2 ** -7 * want.abs().max()
        if kernel:
            assert torch.equal(one[k][0], whole[k][7])


def test_bf16_goes_to_the_kernel_unless_the_cpu_has_amx_or_the_knob_says_so(monkeypatch):
    from hf_paged.engine import prepack

    class Built:
        def __init__(self, bf16, fma=True):
            self.bf16, self.fma = bf16, fma

        def linear_bf16_available(self):
            return self.bf16

        def linear_hardware_fma(self):
            return self.fma

    monkeypatch.delenv(prepack.LIBRARY_ENV, raising=False)
    zen4, sapphire = {"avx512f", "avx512_bf16"}, {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
    assert prepack.kernel_takes(Built(True), torch.bfloat16, zen4)
    assert not prepack.kernel_takes(Built(True), torch.bfloat16, sapphire)        # oneDNN's AMX tiles
    assert not prepack.kernel_takes(Built(False), torch.bfloat16, zen4)           # built without AVX-512 BF16
    assert prepack.kernel_takes(Built(False), torch.float32, sapphire) and not prepack.kernel_takes(None, torch.float32)
    assert not prepack.kernel_takes(Built(True), torch.float16, zen4)
    assert not prepack.kernel_takes(Built(False, fma=False), torch.float32, zen4)  # std::fma emulated: oneDNN
    monkeypatch.setenv(prepack.LIBRARY_ENV, "0")
    assert prepack.kernel_takes(Built(True), torch.bfloat16, sapphire)
    monkeypatch.setenv(prepack.LIBRARY_ENV, "1")
    assert not prepack.kernel_takes(Built(True), torch.bfloat16, zen4)
