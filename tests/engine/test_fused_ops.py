"""The engine's fused CPU ops (hf_paged.engine.fused): each op against the PyTorch formula of the module it
stands for, engine-step logits with and without them on every family (within 1e-5 relative, tokens equal),
installed only inside the engine's steps, and modules with hooks or of unknown classes left alone."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from hf_paged.engine import LLM, Engine
from hf_paged.engine.fused import FusedOps
from tiny_models import FAMILIES, make_model


def rms_norm_reference(x, weight, eps):
    """transformers' LlamaRMSNorm.forward."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_reference(x, cos, sin, interleaved):
    """transformers' apply_rotary_pos_emb for one tensor [T, H, D] (llama; glm when interleaved)."""
    cos, sin = cos[:, None], sin[:, None]
    if not interleaved:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin
    cos = cos[..., :cos.shape[-1] // 2].repeat_interleave(2, -1)
    sin = sin[..., :sin.shape[-1] // 2].repeat_interleave(2, -1)
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    turned = torch.stack((-rot[..., 1::2], rot[..., 0::2]), -1).flatten(-2)
    return torch.cat([rot * cos + turned * sin, rest], -1)


def ulp_close(got, want):
    """float32: within 2e-6 relative of the largest value; bfloat16: within one bf16 step of it."""
    tol = 2e-6 if want.dtype == torch.float32 else 2 ** -7
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= tol * scale, (got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_op_equals_the_module_formula(ops, dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(19, 200, generator=gen) * 3).to(dtype)
    res = torch.randn(19, 200, generator=gen).to(dtype)
    w = torch.randn(200, generator=gen).to(dtype)
    ulp_close(ops.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
    total, normed = ops.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(total, res + x)
    ulp_close(normed, rms_norm_reference(res + x, w, 1e-6))
    gate_up = (torch.randn(19, 2 * 96, generator=gen) * 6).to(dtype)        # strided halves, as GLM's chunk
    gate, up = gate_up[:, :96], gate_up[:, 96:]
    ulp_close(ops.silu_mul(gate, up), F.silu(gate) * up)
    for interleaved, rotary_dim in ((False, 64), (True, 32)):
        q = torch.randn(19, 4, 64, generator=gen).to(dtype)
        k = torch.randn(19, 2, 64, generator=gen).to(dtype)
        angles = torch.randn(19, rotary_dim // 2, generator=gen) * 5
        cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
        want_q, want_k = rotate_reference(q, cos, sin, interleaved), rotate_reference(k, cos, sin, interleaved)
        ops.rotary_(q, k, cos, sin, interleaved)
        ulp_close(q, want_q)
        ulp_close(k, want_k)


def test_ops_refuse_wrong_shapes(ops):
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        ops.rms_norm(torch.randn(3, 8), torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="R = D unless interleaved"):
        ops.rotary_(torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 4), torch.randn(3, 4), False)


def engine_steps(model, fused: bool, prompts):
    """(each step's float32 logits, tokens) of a greedy engine run, fused ops on or off."""
    llm = LLM(model, fused_ops=fused, max_num_batched_tokens=24, num_blocks=64)
    assert (llm.engine.fused is not None) == fused
    steps, runner = [], llm.engine.runner
    forward = runner.forward

    def recording(*args):
        installed = sum("forward" in m.__dict__ and type(m.__dict__["forward"]).__module__.startswith(
            "hf_paged.engine.fused") for m in model.modules())
        steps.append((forward(*args).float(), installed))
        return steps[-1][0]

    runner.forward = recording
    outs = llm.generate(prompts, max_new_tokens=6, do_sample=False, ignore_eos=True, use_tqdm=False)
    return steps, [o.outputs[0].token_ids for o in outs]


# (+ relatives with five fused forwards per layer or more; Mixtral's have four: test_relatives.py)
@pytest.mark.parametrize("family", sorted(FAMILIES) + ["mistral", "qwen2_moe", "qwen3_moe"])
def test_engine_step_logits_with_and_without_fused_ops(ops, family):
    model = make_model(family, seed=5)
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.inference_mode():
        before = model(ids).logits
    prompts = [[3, 9, 27, 4, 11], list(range(5, 40)), [7] * 18]
    fused_steps, fused_tokens = engine_steps(model, True, prompts)
    plain_steps, plain_tokens = engine_steps(model, False, prompts)
    assert fused_tokens == plain_tokens
    assert len(fused_steps) == len(plain_steps) > 3
    layers = model.config.num_hidden_layers
    for (got, installed), (want, none) in zip(fused_steps, plain_steps):
        # per layer: decoder layer, attention, MLP and its norms (GLM-4: two more), plus the final norm
        assert installed >= 5 * layers + 1 and none == 0
        scale = want.abs().max()
        assert (got - want).abs().max() <= 1e-5 * scale
    assert all("forward" not in m.__dict__ for m in model.modules()), "the model is left as it was"
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before)           # the model's own forward outside the steps


def test_hooked_and_unknown_modules_keep_their_forward(ops):
    model = make_model("llama", seed=1)
    layer = model.model.layers[0]
    calls = []
    layer.mlp.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    layer.self_attn.q_proj.register_forward_pre_hook(lambda mod, args: None)   # rotary_ would write its output
    model.model.norm = torch.nn.LayerNorm(model.config.hidden_size)             # a class the ops do not know
    fused = FusedOps(model)
    with fused.installed(), fused.running():
        assert "forward" not in layer.mlp.__dict__ and "forward" not in layer.self_attn.__dict__
        assert "forward" not in model.model.norm.__dict__
        assert "forward" in layer.input_layernorm.__dict__ and "forward" in model.model.layers[1].mlp.__dict__
        with torch.inference_mode():
            model(torch.tensor([[5, 6, 7]]))
    assert calls and all("forward" not in m.__dict__ for m in model.modules())


def test_grad_and_other_dtypes_run_the_modules_own_forward(ops):
    model = make_model("qwen3", seed=2)
    ids = torch.tensor([[5, 6, 7, 8]])
    want = model(ids).logits
    fused = FusedOps(model)
    with fused.installed(), fused.running():
        got = model(ids).logits                 # grad enabled: every fused forward defers to the class's
        got.sum().backward()
    assert torch.equal(got, want) and model.model.layers[0].mlp.up_proj.weight.grad is not None
    half = make_model("llama", seed=2, dtype=torch.float16)
    with torch.inference_mode():
        want = half(ids).logits
        fused = FusedOps(half)
        with fused.installed(), fused.running():
            assert torch.equal(half(ids).logits, want)


def test_fused_ops_must_be_a_bool():
    with pytest.raises(ValueError, match="fused_ops"):
        Engine(make_model("llama", seed=0), fused_ops="no")


def test_every_known_norm_class_passes_the_per_call_test():
    """norm_fusible tells known RMSNorm classes by module and name (no import per call); a transformers that
    defined one elsewhere (an alias of another family's) would lose its fused norms without this."""
    from hf_paged.engine.fused_base import _is_known_norm, _known_norms

    assert all(_is_known_norm(cls) for cls in _known_norms())
    assert not _is_known_norm(torch.nn.LayerNorm)


@pytest.mark.parametrize("family", ["llama", "qwen3", "glm"])
def test_plain_forwards_while_an_engine_session_is_open_get_the_models_own_modules(ops, family):
    """The fused forwards and prepacked linears stay installed for a whole session (a stream paused between
    steps, another thread's engine call): the model's own forwards meanwhile, padded and cached, equal the
    default path exactly (the lean layer took no mask: padded rows attended to their pads)."""
    model = make_model(family, seed=3)
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 8, 7, 6, 5]])
    mask = (ids != 0).long()
    with torch.inference_mode():
        want = model(input_ids=ids, attention_mask=mask).logits
        want_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    stream = LLM(model, max_num_seqs=4).stream([[5, 6, 7, 8, 9, 10]] * 3, max_new_tokens=6)
    next(stream)
    seen = {}

    def plain():
        with torch.inference_mode():
            seen["logits"] = model(input_ids=ids, attention_mask=mask).logits
            seen["tokens"] = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)

    assert any("forward" in m.__dict__ for m in model.modules()), "the session's forwards are installed"
    plain()
    assert torch.equal(seen["logits"], want) and torch.equal(seen["tokens"], want_tokens)
    seen.clear()
    other = threading.Thread(target=plain)
    other.start()
    other.join()
    assert torch.equal(seen["logits"], want) and torch.equal(seen["tokens"], want_tokens)
    assert len(list(stream)) > 0


def test_the_engine_runs_without_the_fused_ops(monkeypatch):
    """A machine where the fused ops cannot be built (no C++ compiler) runs the model's own forwards."""
    model = make_model("llama", seed=4)
    prompts = [[3, 9, 27, 4, 11], [7] * 9]
    want = [o.completions[0].token_ids for o in LLM(model, fused_ops=False).generate(prompts, max_new_tokens=6)]

    def unavailable():
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr("hf_paged.engine.fused.load_fused_ops", unavailable)
    got = [o.completions[0].token_ids for o in LLM(model).generate(prompts, max_new_tokens=6)]
    assert got == want
