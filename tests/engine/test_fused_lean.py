"""The lean decoder-layer forward (hf_paged.engine.fused_lean): engine-step logits bit for bit those of the
module-by-module fused forwards on every family (float32 and bfloat16, decode and prefill steps, the
prefill chunks over LIBRARY_ROWS that take F.linear), the lean forward actually running, and each check
that keeps a layer off it: a hook on a module it would bypass, a weight changed in place between steps."""
from __future__ import annotations

import pytest
import torch

from hf_paged.engine import LLM
from hf_paged.engine.fused_lean import LeanLayer
from tiny_models import FAMILIES, make_model

PROMPTS = [[3, 9, 27, 4, 11], list(range(5, 40)), [7] * 18, [3 + i % 250 for i in range(160)]]   # the last: a 160-row chunk


def run(model, lean: bool, monkeypatch, prompts=PROMPTS, llm=None):
    """(each step's logits, tokens, lean layer calls) of a greedy engine run."""
    llm = llm or LLM(model, max_num_batched_tokens=256, num_blocks=128)
    llm.engine.fused.lean = lean
    steps, calls, runner = [], [], llm.engine.runner
    forward, lean_call = runner.forward, LeanLayer.__call__
    monkeypatch.setattr(runner, "forward", lambda *args: steps.append(forward(*args).clone()) or steps[-1])
    monkeypatch.setattr(LeanLayer, "__call__", lambda self, *a: calls.append(self.layer_idx) or lean_call(self, *a))
    outs = llm.generate(prompts, max_new_tokens=5, do_sample=False, ignore_eos=True, use_tqdm=False)
    monkeypatch.undo()
    return steps, [o.outputs[0].token_ids for o in outs], calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lean_layers_equal_the_fused_modules_bit_for_bit(ops, family, dtype, monkeypatch):
    model = make_model(family, seed=7, dtype=dtype)
    lean_steps, lean_tokens, calls = run(model, True, monkeypatch)
    fused_steps, fused_tokens, none = run(model, False, monkeypatch)
    layers = model.config.num_hidden_layers
    assert len(calls) == layers * len(lean_steps) and not none, "every layer of every step ran lean, or none"
    assert lean_tokens == fused_tokens and len(lean_steps) == len(fused_steps) > 3
    for got, want in zip(lean_steps, fused_steps):
        assert torch.equal(got, want)
    assert all("forward" not in m.__dict__ for m in model.modules()), "the model is left as it was"


def test_a_hook_keeps_its_layer_off_the_lean_forward(ops, monkeypatch):
    model = make_model("llama", seed=3)
    seen = []
    model.model.layers[1].self_attn.o_proj.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    _, hooked, calls = run(model, True, monkeypatch)
    assert seen and calls and 1 not in calls and 0 in calls, "layer 1 runs its modules, so its hook fires"
    _, fused, _ = run(model, False, monkeypatch)
    assert hooked == fused


def test_a_weight_changed_between_steps_is_seen(ops, monkeypatch):
    """Prepacked weights are checked once per step: a weight changed in place after a run makes the next run
    leave the lean (and prepacked) path for that layer, with the fused modules' results on the changed model."""
    model = make_model("qwen2", seed=4)
    llm = LLM(model, max_num_batched_tokens=256, num_blocks=128)
    _, before, _ = run(model, True, monkeypatch, llm=llm)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-3.0)
    lean_steps, changed, calls = run(model, True, monkeypatch, llm=llm)
    assert calls and 0 not in calls and 1 in calls
    fused_steps, fused, _ = run(model, False, monkeypatch, llm=llm)
    assert changed == fused != before
    assert all(torch.equal(a, b) for a, b in zip(lean_steps, fused_steps))
