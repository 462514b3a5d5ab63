"""The families' relatives (Mistral, Mixtral, SmolLM3, Granite, Qwen2-MoE, Qwen3-MoE: hf_paged.families):
patched generate equals transformers' default path in tokens and logits (greedy, sampling, beams, left padding, prompts
longer than the sliding windows), the engine gives each prompt's own greedy tokens with and without its
fused ops, and the fused forwards leave MoE blocks to their own forward (tiny random models, fp32)."""
from __future__ import annotations

import pytest
import torch

from hf_paged.engine import LLM
from hf_paged.families import config_geometry
from tiny_models import RELATIVES, make_batch, make_model, patched

LENGTHS = [6, 1, 23, 15]        # a 1-token prompt, and prompts past every tiny model's window (7-11)
ATOL = 1e-5


@pytest.mark.parametrize("family", sorted(RELATIVES))
def test_greedy_tokens_and_logits_equal_the_default_path(family):
    model = make_model(family, seed=3)
    ids, mask = make_batch(LENGTHS, seed=4)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=14, min_new_tokens=14, do_sample=False,
                  output_logits=True, return_dict_in_generate=True)
    reference = model.generate(**kwargs)
    with patched(model):
        paged = model.generate(cache_implementation="paged", **kwargs)
    assert torch.equal(paged.sequences, reference.sequences)
    for step, (a, b) in enumerate(zip(reference.logits, paged.logits)):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0, msg=f"{family}: logits differ at step {step}")


@pytest.mark.parametrize("family", sorted(RELATIVES))
def test_sampling_and_beams_equal_the_default_path(family):
    model = make_model(family, seed=5)
    ids, mask = make_batch([9, 3, 17], seed=6)
    modes = (dict(do_sample=True, top_k=20, temperature=0.8, num_return_sequences=2),
             dict(do_sample=False, num_beams=3, num_return_sequences=2, output_scores=True,
                  return_dict_in_generate=True))
    for mode in modes:
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, **mode)
        torch.manual_seed(11)
        reference = model.generate(**kwargs)
        with patched(model):
            torch.manual_seed(11)
            paged = model.generate(cache_implementation="paged", **kwargs)
        if isinstance(reference, torch.Tensor):
            assert torch.equal(paged, reference), mode
        else:
            assert torch.equal(paged.sequences, reference.sequences), mode
            torch.testing.assert_close(paged.sequences_scores, reference.sequences_scores, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", sorted(RELATIVES))
def test_engine_gives_each_prompts_own_greedy_tokens(family):
    model = make_model(family, seed=7)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 21, 2, 30, 12)]
    want = []
    for p in prompts:
        out = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=12, min_new_tokens=12, do_sample=False)
        want.append(out[0, len(p):].tolist())
    for knobs in (dict(), dict(fused_ops=False), dict(enforce_eager=True)):
        llm = LLM(model, block_size=4, max_num_batched_tokens=16, num_blocks=96, **knobs)
        outs = llm.generate(prompts, max_new_tokens=12, min_new_tokens=12, do_sample=False, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want, knobs


def test_windows_follow_what_each_attention_applies():
    assert config_geometry(make_model("mistral").config).sliding_windows == (9, 9)
    assert config_geometry(make_model("mistral", sliding_window=None).config).sliding_windows == (0, 0)
    assert config_geometry(make_model("mixtral").config).sliding_windows == (0, 0)
    assert config_geometry(make_model("qwen2_moe").config).sliding_windows == (7, 0, 7)     # layer_types
    assert config_geometry(make_model("qwen3_moe").config).sliding_windows == (11, 11)
    assert config_geometry(make_model("smollm3").config).sliding_windows == (0, 0, 0, 8)


def test_fused_forwards_leave_moe_blocks_to_their_own():
    model = make_model("qwen2_moe", seed=9)         # layers 0 and 2 MoE, layer 1 dense
    llm = LLM(model, num_blocks=32)
    assert llm.engine.fused is not None, "the fused CPU ops did not build (the log says why)"
    moe = model.model.layers[0].mlp
    fused = {f.module: f for f in llm.engine.fused.forwards}
    assert moe not in fused and moe.shared_expert in fused and model.model.layers[1].mlp in fused
    llm.generate([[5, 6, 7, 8]], max_new_tokens=3, do_sample=False, use_tqdm=False)
    lean = [fused[layer].lean is not None for layer in model.model.layers]
    assert lean == [False, True, False]             # the dense layer alone runs as direct op calls
    assert all("forward" not in m.__dict__ for m in model.modules())
