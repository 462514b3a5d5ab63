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


@pytest.mark.parametrize("family", sorted(FAMILIES) + ["mistral"])   # (the MoE relatives: routing may flip in bf16)
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


@pytest.mark.parametrize("op", ["silu_mul", "rotary_", "rms_norm"])
def test_bf16_vector_blocks_equal_the_scalar_path(ops, op):
    """The bf16 ops' vector paths (AVX-512 SiLU blocks, vectorised conversions: nearest even, NaN to c10's 0x7FC0):
    silu_mul gives the bits of the same op one column at a time (each column a scalar tail), NaN and inf
    included; rotary_ the module formula's numbers; rms_norm the formula within a bf16 step (its sum of squares
    runs in another order than torch's)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 70, generator=gen).to(torch.bfloat16)
    x[0, :4] = float("nan")
    x[1, :3], x[1, 3:6] = float("inf"), -float("inf")
    if op == "silu_mul":
        whole = ops.silu_mul(x, x)
        cols = torch.stack([ops.silu_mul(x[:, i:i + 1].contiguous(), x[:, i:i + 1].contiguous())[:, 0]
                            for i in range(x.shape[1])], 1)
        assert torch.equal(whole.view(torch.int16), cols.view(torch.int16))
    elif op == "rotary_":      # against the module formula, rounded where the eager ops round
        q, k = x[:, :64].reshape(40, 2, 32).clone(), x[:, 4:36].reshape(40, 1, 32).clone()
        cos, sin = torch.randn(40, 32, generator=gen).to(torch.bfloat16), torch.randn(40, 32, generator=gen).to(torch.bfloat16)
        ref_q, ref_k = q.float(), k.float()
        ops.rotary_(q, k, cos, sin, False)

        def formula(t):
            half = t.shape[-1] // 2
            rot = torch.cat([-t[..., half:], t[..., :half]], -1)
            return ((t * cos.float()[:, None]).to(torch.bfloat16).float() + (rot * sin.float()[:, None]).to(torch.bfloat16).float()).to(torch.bfloat16)
        # the same numbers (NaN where NaN: torch's own vector conversion keeps a NaN's sign, c10's scalar one and ours
        # give 0x7FC0)
        torch.testing.assert_close(q, formula(ref_q), rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(k, formula(ref_k), rtol=0, atol=0, equal_nan=True)
    else:
        w = torch.randn(70, generator=gen).to(torch.bfloat16)
        got = ops.rms_norm(x[2:], w, 1e-6)
        xf = x[2:].float()
        ref = (w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16).float()).to(torch.bfloat16)
        assert (got.float() - ref.float()).abs().max() <= 2 ** -6 * ref.float().abs().max(), "within a bf16 step of the formula"
