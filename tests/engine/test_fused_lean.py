"""The lean decoder-layer forward (hf_paged.engine.fused_lean): engine-step logits bit for bit those of the
module-by-module fused forwards on every family (float32 and bfloat16, decode and prefill steps, the
prefill chunks over LIBRARY_ROWS that take F.linear), the lean forward actually running (its direct form,
straight to the step's C++ write and attention, on the steps whose products are packed), and each check
that keeps a layer off it: a hook on a module it would bypass, a weight changed in place between steps;
quantised pools in the direct form too; the direct form as one C++ call (``lean_layer``) equal to its Python
calls, and kept off where the step's kernel ops are wrapped."""
from __future__ import annotations

import pytest
import torch

from hf_paged.engine import LLM, prepack
from hf_paged.engine.fused_lean import LeanLayer
from tiny_models import FAMILIES, make_model

PROMPTS = [[3, 9, 27, 4, 11], list(range(5, 40)), [7] * 18, [3 + i % 250 for i in range(160)]]   # the last: a 160-row chunk


def packs(dtype: torch.dtype) -> bool:
    """Whether the engine packs linears of ``dtype`` here, which the lean forward needs: bfloat16 only where
    oneDNN has a bf16 matmul (AVX-512 BF16 or AMX). On an AVX2-only CPU (a Zen 3) no layer can run lean in
    bf16: the runs below are then the fused modules' three times, still compared bit for bit."""
    return prepack.prepack_available(dtype)


def run(model, lean: bool, monkeypatch, prompts=PROMPTS, llm=None, direct=None, one_call=None, library=None,
        **knobs):
    """(each step's logits, tokens, lean layer calls) of a greedy engine run; ``direct``: a list that gets the
    layer of each direct-form call; ``one_call``: a list that gets one entry per ``lean_layer`` call, or False
    to run the direct form's Python calls instead of that op; ``library``: $HF_PAGED_LIBRARY_GEMM for a new
    engine ("1": F.linear over LIBRARY_ROWS rows, as on Intel; "0": the kernel for every step, as on AMD)."""
    if library is not None:
        monkeypatch.setenv("HF_PAGED_LIBRARY_GEMM", library)
    llm = llm or LLM(model, max_num_batched_tokens=256, num_blocks=128, **knobs)
    llm.engine.fused.lean = lean
    steps, calls, runner = [], [], llm.engine.runner
    forward, lean_call, direct_call = runner.forward, LeanLayer.__call__, LeanLayer._direct
    monkeypatch.setattr(runner, "forward", lambda *args: steps.append(forward(*args).clone()) or steps[-1])
    monkeypatch.setattr(LeanLayer, "__call__", lambda self, *a: calls.append(self.layer_idx) or lean_call(self, *a))
    if direct is not None:
        monkeypatch.setattr(LeanLayer, "_direct", lambda self, *a: direct.append(self.layer_idx) or direct_call(self, *a))
    if one_call is False:
        llm.engine.fused.one_call = False
    elif one_call is not None:
        for name in ("lean_layer", "lean_layer_quant", "lean_layer_kivi"):
            layer_op = getattr(torch.ops.hf_paged_fused, name)
            monkeypatch.setattr(torch.ops.hf_paged_fused, name,
                                lambda *a, _op=layer_op, _name=name: one_call.append(_name) or _op(*a), raising=False)
    outs = llm.generate(prompts, max_new_tokens=5, do_sample=False, ignore_eos=True, use_tqdm=False)
    monkeypatch.undo()
    return steps, [o.outputs[0].token_ids for o in outs], calls


@pytest.mark.parametrize("library", ["1", "0"], ids=["library", "kernel"])   # $HF_PAGED_LIBRARY_GEMM (Intel / AMD)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lean_layers_equal_the_fused_modules_bit_for_bit(ops, family, dtype, library, monkeypatch):
    model = make_model(family, seed=7, dtype=dtype)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():                    # norm weights start at ones: make each norm's its own
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
    direct, one_call = [], []
    lean_steps, lean_tokens, calls = run(model, True, monkeypatch, direct=direct, one_call=one_call, library=library)
    fused_steps, fused_tokens, none = run(model, False, monkeypatch, library=library)
    python_steps, python_tokens, _ = run(model, True, monkeypatch, one_call=False, library=library)
    layers = model.config.num_hidden_layers
    if packs(dtype):
        assert len(calls) == layers * len(lean_steps) and not none, "every layer of every step ran lean, or none"
        # direct on every step whose products are packed: all of them in bf16 (oneDNN) and with the kernel for
        # every step, the decode steps in f32 with the library (the first step's 218 prompt rows go through
        # F.linear; a build without hardware FMA leaves float32 to oneDNN too); each as one lean_layer call
        library_steps = 1 if dtype == torch.float32 and library == "1" and ops.linear_hardware_fma() else 0
        assert len(direct) == len(calls) - library_steps * layers, (len(direct), len(calls))
        assert one_call == ["lean_layer"] * len(direct)
    else:
        assert not calls and not direct and not one_call and not none
    assert lean_tokens == fused_tokens == python_tokens and len(lean_steps) == len(fused_steps) > 3
    for got, want, python in zip(lean_steps, fused_steps, python_steps):
        assert torch.equal(got, want) and torch.equal(python, want)
    assert all("forward" not in m.__dict__ for m in model.modules()), "the model is left as it was"


def test_a_hook_keeps_its_layer_off_the_lean_forward(ops, monkeypatch):
    model = make_model("llama", seed=3)
    seen = []
    model.model.layers[1].self_attn.o_proj.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    _, hooked, calls = run(model, True, monkeypatch)
    assert seen and calls and 1 not in calls and 0 in calls, "layer 1 runs its modules, so its hook fires"
    _, fused, _ = run(model, False, monkeypatch)
    assert hooked == fused


def test_a_weight_changed_between_runs_is_seen(ops, monkeypatch):
    """A weight changed in place after a run: the next run's first request finds the weights changed
    (``Engine._check_weights``) and prepacks every layer again, so the lean path serves the changed model, with
    the fused modules' results on it. (Within a run, prepacked weights are checked once per step: a layer whose
    weight changed leaves the lean path.)"""
    model = make_model("qwen2", seed=4)
    llm = LLM(model, max_num_batched_tokens=256, num_blocks=128)
    _, before, _ = run(model, True, monkeypatch, llm=llm)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-3.0)
    lean_steps, changed, calls = run(model, True, monkeypatch, llm=llm)
    assert calls and 0 in calls and 1 in calls
    fused_steps, fused, _ = run(model, False, monkeypatch, llm=llm)
    assert changed == fused != before
    assert all(torch.equal(a, b) for a, b in zip(lean_steps, fused_steps))


QUANTISED_CASES = [(kv, family, torch.float32) for kv in ("int8", "fp8_e4m3", "fp8_e5m2", "int4", "nvfp4", "kivi")
                   for family in ("llama", "qwen3", "glm4")] + [("int8", "llama", torch.bfloat16),
                                                              ("nvfp4", "qwen3", torch.bfloat16),
                                                              ("kivi", "qwen3", torch.bfloat16)]


@pytest.mark.parametrize(("kv", "family", "dtype"), QUANTISED_CASES)
def test_quantised_pools_take_the_direct_form_too(ops, kv, family, dtype, monkeypatch):
    """Quantised pools: the direct form writes through ``KVPools.write_rows`` (the backend's quantising write,
    KIVI's plan) and attends through ``Step.attend``, or makes those calls in one C++ op (``lean_layer_quant``,
    ``lean_layer_kivi``; bf16: with oneDNN's packed weights where the kernel does not take bf16); the logits equal
    the fused modules' and the Python direct form's bit for bit."""
    model = make_model(family, seed=5, dtype=dtype)
    direct, one_call, knobs = [], [], dict(kv_cache_dtype=kv, block_size=32 if kv == "kivi" else 16)
    lean_steps, lean_tokens, calls = run(model, True, monkeypatch, direct=direct, one_call=one_call, **knobs)
    fused_steps, fused_tokens, _ = run(model, False, monkeypatch, **knobs)
    python_steps, python_tokens, _ = run(model, True, monkeypatch, one_call=False, **knobs)
    assert lean_tokens == fused_tokens == python_tokens
    if packs(dtype):
        assert calls and direct
        assert one_call == ["lean_layer_kivi" if kv == "kivi" else "lean_layer_quant"] * len(direct)
    else:
        assert not calls and not direct and not one_call
    assert len(lean_steps) == len(fused_steps) == len(python_steps) > 3
    for got, want, python in zip(lean_steps, fused_steps, python_steps):
        assert torch.equal(got, want) and torch.equal(python, want)


@pytest.mark.parametrize("kv", ["auto", "int8", "kivi"])
def test_a_wrapped_kernel_op_sees_its_calls(ops, kv, monkeypatch):
    """The one-call layer makes the write and attention calls itself; a step whose backend has other ops than
    the extension's (here a counting wrapper) keeps the Python direct form, which calls them. Prefix caching
    off: with it, the second run's first step would compute only the uncached rows, through other linears
    (our kernel instead of MKL's sgemm, whose rounding differs on some CPUs, e.g. AMD Zen 4)."""
    model = make_model("qwen3", seed=6)
    llm = LLM(model, max_num_batched_tokens=256, num_blocks=128, kv_cache_dtype=kv, enable_prefix_caching=False,
              block_size=32 if kv == "kivi" else 16)
    backend, seen, one_call = llm.engine.cache.backend, [], []
    name = "op" if kv == "auto" else "quant_op"
    kernel = getattr(backend, name)
    monkeypatch.setattr(backend, name, lambda *a: seen.append(1) or kernel(*a))
    wrapped_steps, wrapped, _ = run(model, True, monkeypatch, llm=llm, one_call=one_call)
    assert seen and not one_call
    plain_steps, plain, _ = run(model, True, monkeypatch, llm=llm, one_call=one_call)
    assert one_call, "unwrapped, the same engine takes the one-call layer"
    assert wrapped == plain and all(torch.equal(a, b) for a, b in zip(wrapped_steps, plain_steps))


def test_kivi_one_call_layer_follows_the_plan_across_prefix_hits(ops, monkeypatch):
    """KIVI in one call (``lean_layer_kivi``) with prefix caching: a second run of prompts sharing whole blocks with
    the first starts inside cached blocks' successors, so its writes open, fill and seal blocks after a hit; two
    engines, one on the one-call layer and one on the Python direct form, give the same logits bit for bit, every
    direct call of the first being one call."""
    model = make_model("llama", seed=7)
    shared = [5 + i % 97 for i in range(70)]                            # two whole 32-token blocks and 6 more
    first = [shared + [11, 12, 13], shared[:40] + [9] * 30]
    second = [shared + [21, 22], shared[:64] + [8] * 3, shared[:33]]
    knobs = dict(kv_cache_dtype="kivi", block_size=32, max_num_batched_tokens=256, num_blocks=128)
    one, python = LLM(model, **knobs), LLM(model, **knobs)
    got, want, direct, one_call = [], [], [], []
    for prompts in (first, second):
        got.append(run(model, True, monkeypatch, prompts=prompts, llm=one, direct=direct, one_call=one_call))
        want.append(run(model, True, monkeypatch, prompts=prompts, llm=python, one_call=False))
    assert one.stats().prefix_hit_tokens > 0 and python.stats().prefix_hit_tokens == one.stats().prefix_hit_tokens
    assert direct and one_call == ["lean_layer_kivi"] * len(direct)
    for (steps, tokens, _), (ref_steps, ref_tokens, _) in zip(got, want):
        assert tokens == ref_tokens and len(steps) == len(ref_steps)
        assert all(torch.equal(a, b) for a, b in zip(steps, ref_steps))
