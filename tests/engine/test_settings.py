"""The engine resolves every setting as ``model.generate`` does (issue 10, defect 2), and a request that
fails alone says so clearly.

Each engine result is compared with ``model.generate`` on the prompt alone with the *same* keyword
arguments — so unset settings (top_k, max_length, ...) must come out as generate fills them in.
"""
from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from tiny_models import VOCAB, make_model
from hf_paged.engine import LLM
from hf_paged.engine.settings import resolve_generation


def reference(model, prompt, seed=None, **settings):
    ids = torch.tensor([prompt])
    if seed is not None:
        torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")              # generate's "default max_length" warning
        return model.generate(ids, attention_mask=torch.ones_like(ids), **settings)


def prompts_of(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_sampling_without_top_k_uses_generates_default(family):
    """Unset top_k is transformers' default 50 at generate time, not "no top-k"."""
    model = make_model(family, seed=11)
    prompts = prompts_of([1, 5, 12, 30], seed=1)
    llm = LLM(model, block_size=4, num_blocks=64)
    assert resolve_generation(model.generation_config, do_sample=True, seed=0).top_k == 50
    differs_from_top_k_0 = 0
    for seed in (3,):
        outs = llm.generate(prompts, do_sample=True, seed=seed, max_new_tokens=10)
        for prompt, out in zip(prompts, outs):
            expected = reference(model, prompt, seed=seed, do_sample=True, max_new_tokens=10)
            assert out.sequences.tolist() == expected.tolist(), (seed, len(prompt))
            no_top_k = reference(model, prompt, seed=seed, do_sample=True, max_new_tokens=10, top_k=0)
            differs_from_top_k_0 += no_top_k.tolist() != expected.tolist()
    assert differs_from_top_k_0 > 0, "the case does not tell top_k=50 from top_k=0"


def test_model_generation_config_then_kwargs_win():
    model = make_model("qwen2", seed=12)
    model.generation_config.top_k, model.generation_config.temperature = 7, 0.6
    prompts = prompts_of([4, 9], seed=2)
    llm = LLM(model, block_size=4, num_blocks=64)
    for settings in (dict(do_sample=True), dict(do_sample=True, top_k=0, temperature=1.4)):
        outs = llm.generate(prompts, seed=9, max_new_tokens=8, **settings)
        for prompt, out in zip(prompts, outs):
            assert out.sequences.tolist() == reference(model, prompt, seed=9, max_new_tokens=8, **settings).tolist()


@pytest.mark.parametrize("family", ["llama", "glm"])
def test_max_new_tokens_unset_matches_generate(family):
    """generate with max_length unset makes 20 new tokens whatever the prompt length (≥ 20 included)."""
    model = make_model(family, seed=13)
    prompts = prompts_of([1, 7, 9, 19, 20, 33], seed=3)
    outs = LLM(model, block_size=4, num_blocks=128).generate(prompts)
    for prompt, out in zip(prompts, outs):
        expected = reference(model, prompt)
        assert out.error is None and out.sequences.tolist() == expected.tolist(), len(prompt)
    assert [len(o.outputs[0].token_ids) for o in outs] == [20] * len(prompts)   # no EOS in these


def test_default_max_length_is_capped_by_the_models_context():
    model = make_model("qwen3", seed=14, max_position_embeddings=32)
    prompts = prompts_of([5, 25, 31, 32, 40], seed=4)
    outs = LLM(model, block_size=4, num_blocks=64).generate(prompts)
    for prompt, out in zip(prompts, outs):
        if len(prompt) < 32:
            assert out.sequences.tolist() == reference(model, prompt).tolist(), len(prompt)
        else:                                   # generate raises for these; the engine fails them alone
            with pytest.raises(ValueError, match="Input length"):
                reference(model, prompt)
            assert out.finish_reason == "error" and "max_length=32" in out.error


@pytest.mark.parametrize("where", ["kwarg", "model"])
def test_explicit_max_length_counts_the_prompt_and_never_raises_the_call(where):
    model = make_model("llama", seed=15)
    settings = {}
    if where == "kwarg":
        settings["max_length"] = 25
    else:
        model.generation_config.max_length = 25
    prompts = prompts_of([5, 24, 25, 30, 3], seed=5)
    outs = LLM(model, block_size=4, num_blocks=64).generate(prompts, **settings)     # does not raise
    for prompt, out in zip(prompts, outs):
        if len(prompt) < 25:
            expected = reference(model, prompt, **settings)
            assert out.sequences.tolist() == expected.tolist() and expected.shape[1] == 25
        else:
            with pytest.raises(ValueError, match="Input length"):
                reference(model, prompt, **settings)
            assert out.finish_reason == "error" and "max_length=25" in out.error and "max_new_tokens" in out.error


LENGTH_CASES = [dict(zip(("max_new_tokens", "max_length", "min_new_tokens", "min_length"), values))
                for values in itertools.product((None, 6), (None, 12, 40), (None, 3), (None, 4, 30))]


@pytest.mark.parametrize("model_max_length", [None, 15])
def test_new_token_counts_equal_generates_own_computation(model_max_length):
    """(max, min) new tokens against transformers' ``_prepare_generation_config`` +
    ``_prepare_generated_length``, the two steps generate runs."""
    model = make_model("qwen2", seed=16, max_position_embeddings=64)
    model.generation_config.max_length = model_max_length
    for case, prompt_len in itertools.product(LENGTH_CASES, (1, 10, 20, 50, 64, 70)):
        kwargs = {k: v for k, v in case.items() if v is not None}
        params = resolve_generation(model.generation_config, **kwargs)
        has_default_max = kwargs.get("max_length") is None and model.generation_config.max_length is None
        has_default_min = kwargs.get("min_length") is None and model.generation_config.min_length is None
        config, _ = model._prepare_generation_config(None, **kwargs)
        ids = torch.ones(1, prompt_len, dtype=torch.long)
        config = model._prepare_generated_length(config, has_default_max, has_default_min, "input_ids", prompt_len, ids)
        expected = (config.max_length - prompt_len, max(0, config.min_length - prompt_len))
        got = params.new_tokens_for(prompt_len, model.config.max_position_embeddings)
        assert got == expected, (kwargs, prompt_len)


def test_resolution_equals_generates_config():
    model = make_model("glm4", seed=17)
    model.generation_config.top_p, model.generation_config.do_sample = 0.8, True
    for kwargs in (dict(), dict(do_sample=False), dict(top_k=5, temperature=0.5), dict(top_p=1.0, top_k=0),
                   dict(eos_token_id=[1, 7], max_new_tokens=4, min_new_tokens=2)):
        params = resolve_generation(model.generation_config, seed=0, **kwargs)
        config, _ = model._prepare_generation_config(None, **kwargs)
        assert (params.do_sample, params.top_k, params.top_p, params.temperature, params.max_new_tokens,
                params.max_length) == (config.do_sample, config.top_k, config.top_p, config.temperature,
                                       config.max_new_tokens, config.max_length), kwargs
        eos = config.eos_token_id
        assert params.eos_token_ids == frozenset([eos] if isinstance(eos, int) else eos)


def test_bad_settings_are_refused_by_name():
    model = make_model("llama", seed=18)
    gc = model.generation_config
    with pytest.raises(ValueError, match="top_kk"):
        resolve_generation(gc, top_kk=3)
    with pytest.raises(ValueError, match="num_beams"):
        resolve_generation(gc, num_beams=2)
    for name, value in (("dola_layers", "high"), ("token_healing", True)):     # once silently ignored
        with pytest.raises(ValueError, match=name):
            resolve_generation(gc, **{name: value})
    with pytest.raises(ValueError, match="min_tokens .* or min_new_tokens"):
        resolve_generation(gc, min_tokens=2, min_new_tokens=2)
    with pytest.raises(ValueError, match="temperature"):       # transformers' own warper refuses it
        resolve_generation(gc, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        resolve_generation(gc, max_new_tokens=0)


def test_a_request_that_fails_alone_says_so():
    model = make_model("qwen3", seed=19)
    llm = LLM(model, block_size=4, num_blocks=8, max_model_len=64)
    outs = llm.generate([[5, 6, 7], [9] * 40], max_new_tokens=4)      # 44 tokens > the 32-token pool
    ok, failed = outs
    assert ok.error is None and ok.finish_reason == "length" and len(ok.outputs) == 1
    assert failed.finish_reason == "error" and "whole KV pool" in failed.error and failed.finished
    assert len(failed.outputs) == 0 and list(failed.outputs) == [] and not failed.outputs
    with pytest.raises(RuntimeError, match="request 1 failed: .*whole KV pool") as info:
        _ = failed.outputs[0]
    assert not isinstance(info.value, IndexError)
    with pytest.raises(RuntimeError, match="request 1 failed"):
        _ = failed.sequences
