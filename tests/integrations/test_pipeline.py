"""hf_paged.pipeline over a list of prompts returns what the stock pipeline returns, prompt by prompt."""
from __future__ import annotations

import pytest
import torch
from transformers import pipeline

import hf_paged
from tiny_models import VOCAB, make_model
from tiny_models import word_tokenizer


def _prompts(seed: int, lengths):
    gen = torch.Generator().manual_seed(seed)
    return [" ".join(f"w{int(t)}" for t in torch.randint(3, VOCAB, (n,), generator=gen)) for n in lengths]


def test_pipeline_list_matches_stock_pipeline_prompt_by_prompt():
    model = make_model("glm4", seed=12)
    tok = word_tokenizer()
    prompts = _prompts(13, (3, 9, 1, 6, 12, 15))
    kw = dict(max_new_tokens=5, do_sample=False)
    stock = pipeline("text-generation", model=model, tokenizer=tok)
    expected = [stock(p, **kw) for p in prompts]
    paged = hf_paged.pipeline("text-generation", model=model, tokenizer=tok, engine_options=dict(max_num_seqs=4, block_size=4))
    assert paged(prompts, **kw) == expected
    assert paged(prompts, batch_size=3, **kw) == expected              # batch_size is accepted
    assert paged(prompts, return_full_text=False, **kw) == [stock(p, return_full_text=False, **kw) for p in prompts]
    stats = paged.engine_stats()
    assert stats["requests_finished"] == 3 * len(prompts) and stats["prefix_hit_tokens"] > 0
    assert paged(prompts[0], **kw) == expected[0]                     # a single prompt takes the stock path


def test_an_interrupted_list_call_leaves_nothing_running(monkeypatch):
    """Ctrl-C (or an error) mid-run: the call's requests are cancelled and forgotten, so the next call runs
    only its own prompts (it finished the interrupted batch first, for nobody)."""
    model = make_model("llama", seed=12)
    tok = word_tokenizer()
    prompts = _prompts(13, (3, 9, 1, 6))
    kw = dict(max_new_tokens=30, do_sample=False)
    paged = hf_paged.pipeline("text-generation", model=model, tokenizer=tok, engine_options=dict(max_num_seqs=2))
    engine = paged.llm.engine
    real_step, steps = engine.step, []

    def interrupted_step():
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        paged(prompts, **kw)
    assert not engine.requests and not engine.has_work and engine.pool.num_used == 0
    monkeypatch.setattr(engine, "step", real_step)
    stock = pipeline("text-generation", model=model, tokenizer=tok)
    assert paged(prompts[:2], **kw) == [stock(p, **kw) for p in prompts[:2]]
    assert not engine.requests


def test_pipeline_with_a_patched_model_and_sampling():
    model = make_model("qwen2", seed=14)
    tok = word_tokenizer()
    prompts = _prompts(15, (5, 2, 8))
    hf_paged.patch(model)
    try:
        paged = hf_paged.pipeline("text-generation", model=model, tokenizer=tok)
        kw = dict(max_new_tokens=5, do_sample=True, top_k=1, num_return_sequences=2)
        out = paged(prompts, **kw)
        stock = pipeline("text-generation", model=model, tokenizer=tok)
        assert out == [stock(p, **kw) for p in prompts]
        assert len(out[0]) == 2
    finally:
        hf_paged.unpatch(model)


def test_stock_pipeline_routes_lists_to_the_engine_under_the_global_opt_in():
    from transformers import TextGenerationPipeline

    model = make_model("llama", seed=16)
    tok = word_tokenizer()
    prompts = _prompts(17, (4, 11, 1, 7))
    kw = dict(max_new_tokens=5, do_sample=False)
    stock = pipeline("text-generation", model=model, tokenizer=tok)
    expected = [stock(p, **kw) for p in prompts]
    original = TextGenerationPipeline.__call__
    hf_paged.patch(model)
    try:
        with hf_paged.enabled():
            pipe = pipeline("text-generation", model=model, tokenizer=tok)
            assert pipe(prompts, batch_size=2, **kw) == expected
            assert pipe._hf_paged_llm[1].stats()["requests_finished"] == len(prompts)   # the engine ran them
            assert pipe(prompts[1], **kw) == expected[1]                              # single prompt: stock
            hf_paged.patch(model, kv_cache_dtype="int8", block_size=8)               # the engine follows the patch
            quantised = [pipe(p, cache_implementation="paged", **kw) for p in prompts]     # stock, int8 PagedCache
            assert pipe(prompts, **kw) == quantised
            config = pipe._hf_paged_llm[1].engine.config
            assert (config.kv_cache_dtype, config.block_size) == ("int8", 8)
        assert TextGenerationPipeline.__call__ is original
        plain = pipeline("text-generation", model=model, tokenizer=tok)
        assert plain(prompts, **kw) == expected and "_hf_paged_llm" not in plain.__dict__
    finally:
        hf_paged.unpatch(model)


def test_list_calls_the_engine_cannot_serve_take_the_stock_path():
    """Settings the engine does not do (no_repeat_ngram_size, suppress_tokens, guidance_scale, ...) send the
    list to the stock path (its records); engine knobs per call are refused by name."""
    model = make_model("llama", seed=3)
    tok = word_tokenizer()
    prompts = _prompts(4, (4, 1, 7))
    stock = pipeline("text-generation", model=model, tokenizer=tok)
    paged = hf_paged.pipeline("text-generation", model=model, tokenizer=tok)
    for extra in (dict(no_repeat_ngram_size=2), dict(suppress_tokens=[5]), dict(guidance_scale=1.5)):
        kw = dict(max_new_tokens=4, do_sample=False, **extra)
        assert paged(prompts, **kw) == [stock(p, **kw) for p in prompts], extra
    assert paged.engine_stats()["requests_finished"] == 0             # the engine never ran
    with pytest.raises(ValueError, match=r"engine knob\(s\) \['block_size'\] are set when the pipeline is built"):
        paged(prompts, max_new_tokens=2, block_size=8)


def test_stop_sequence_on_a_list(smollm2):
    """transformers hands generate a ``tokenizer`` with stop strings: the engine decodes with the pipeline's own."""
    model, tok = smollm2.load_smollm2()
    prompts = ["Count from 1 to 9:", "Count: 1, 2,"]
    kw = dict(max_new_tokens=24, do_sample=False, stop_sequence=", 6")
    stock = pipeline("text-generation", model=model, tokenizer=tok)
    expected = [stock(p, **kw) for p in prompts]
    assert hf_paged.pipeline("text-generation", model=model, tokenizer=tok)(prompts, **kw) == expected
