"""bfloat16 in the engine's CPU steps (hf_paged.engine.cpu_bf16, fused ops, prepacked linears): engine-step
logits of bf16 tiny models of every family with the fused ops against the model's own bf16 modules (within
one bf16 step; bit for bit on AVX2); the native-bf16 decision from CPU flags and the warning where the CPU lacks them."""
from __future__ import annotations

import logging

import pytest
import torch
from tiny_models import FAMILIES, make_model

from hf_paged.engine import LLM
from hf_paged.engine.cpu_bf16 import NATIVE_FLAGS, bf16_warning, native_bf16
from hf_paged.engine.cpu_ops import load_fused_ops


@pytest.fixture(scope="module")
def ops():
    try:
        return load_fused_ops()
    except RuntimeError as err:         # no C++ compiler on this machine
        pytest.skip(f"fused CPU ops cannot be built here: {err}")


def engine_steps(model, fused: bool, prompts):
    """(each step's float32 logits and how many fused forwards were installed, tokens) of a greedy run."""
    llm = LLM(model, fused_ops=fused, max_num_batched_tokens=24, num_blocks=64)
    assert (llm.engine.fused is not None) == fused
    steps, runner = [], llm.engine.runner
    forward = runner.forward

    def recording(*args):
        installed = sum(type(m.__dict__.get("forward")).__module__.startswith("hf_paged.engine.fused")
                        for m in model.modules() if "forward" in m.__dict__)
        steps.append((forward(*args).float(), installed))
        return steps[-1][0]

    runner.forward = recording
    outs = llm.generate(prompts, max_new_tokens=6, do_sample=False, ignore_eos=True, use_tqdm=False)
    return steps, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_engine_steps_with_fused_ops_equal_the_modules_own(ops, family):
    model = make_model(family, seed=5, dtype=torch.bfloat16)
    prompts = [[3, 9, 27, 4, 11], list(range(5, 40)), [7] * 18]
    fused_steps, fused_tokens = engine_steps(model, True, prompts)
    plain_steps, plain_tokens = engine_steps(model, False, prompts)
    assert len(fused_steps) == len(plain_steps) > 3
    layers = model.config.num_hidden_layers
    for (got, installed), (want, none) in zip(fused_steps, plain_steps):
        assert installed >= 5 * layers + 1 and none == 0
        # The ops round to bf16 every intermediate that the eager modules materialise in bf16 and sum in
        # float32 (cuda/fused_ops_cpu.cpp): on an AVX2 CPU the steps come out bit for bit on all five
        # families. One bf16 step (2^-8) of the largest logit leaves room for another ISA's float32 sum
        # order in PyTorch's own kernels; a missed bf16 rounding of an intermediate is larger than that.
        assert (got - want).abs().max() <= 2 ** -8 * want.abs().max()
    assert fused_tokens == plain_tokens
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_native_bf16_follows_the_cpu_flags():
    for flag in NATIVE_FLAGS:
        assert native_bf16({"avx2", "avx512f", flag})
    assert not native_bf16({"avx2", "fma", "avx512f", "avx512_vnni"})
    cpu = torch.device("cpu")
    message = bf16_warning(torch.bfloat16, cpu, {"avx2"})
    assert all(f in message for f in NATIVE_FLAGS) and "--dtype float32" in message
    assert bf16_warning(torch.bfloat16, cpu, {"avx2", "amx_bf16", "amx_tile"}) is None
    assert bf16_warning(torch.float32, cpu, {"avx2"}) is None
    assert bf16_warning(torch.bfloat16, torch.device("meta"), {"avx2"}) is None


def test_engine_warns_for_bf16_only_where_the_cpu_lacks_it(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_paged.engine"):
        LLM(make_model("llama", seed=0, dtype=torch.bfloat16), num_blocks=16)
        LLM(make_model("llama", seed=0), num_blocks=16)
    warned = [r for r in caplog.records if "bf16 instructions" in r.getMessage()]
    assert len(warned) == (0 if native_bf16() else 1)
