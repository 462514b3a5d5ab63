"""The continuous-batching engine: every request's tokens equal ``model.generate`` on that prompt alone."""
from __future__ import annotations

import pytest
import torch

import hf_paged
from tiny_models import EOS, VOCAB, make_model
from hf_paged.engine import LLM, Engine, generate_many


def reference(model, prompt, seed=None, **settings):
    """generate on one prompt alone: LongTensor [n, prompt + new]."""
    ids = torch.tensor([prompt])
    if seed is not None:
        torch.manual_seed(seed)
    return model.generate(ids, attention_mask=torch.ones_like(ids), **settings)


def mixed_requests(model, count: int, seed: int):
    """(prompt, settings) pairs: prompt lengths 1..40, outputs 1..16, early EOS, n=3, seeded sampling."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 2, 40, 7] + torch.randint(1, 41, (count - 4,), generator=gen).tolist()
    requests = []
    for i, n in enumerate(lengths):
        prompt = torch.randint(3, VOCAB, (n,), generator=gen).tolist()
        settings = dict(max_new_tokens=int(torch.randint(1, 13, (), generator=gen)), do_sample=False)
        if i % 5 == 1:      # stops early: EOS is the 3rd token greedy decoding produces
            settings["max_new_tokens"] = 12
            free_run = reference(model, prompt, max_new_tokens=3, do_sample=False)[0, n:].tolist()
            settings["eos_token_id"] = [EOS, free_run[-1]]
        if i % 7 == 2:      # generate refuses greedy n > 1: top_k=1 sampling is greedy and allowed
            settings.update(num_return_sequences=3, do_sample=True, top_k=1, seed=i)
        if i % 6 == 3:
            settings.update(do_sample=True, seed=100 + i, temperature=0.8, top_k=20, top_p=0.9)
        if i % 9 == 4:
            settings["min_new_tokens"] = 2
        requests.append((prompt, settings))
    return requests


def check_pool(engine: Engine) -> None:
    engine.check_invariants()
    assert engine.pool.num_used == 0, f"{engine.pool.num_used} blocks still held after every request ended"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "glm", "glm4"])
def test_engine_matches_generate_per_request_with_preemption(family):
    model = make_model(family, seed=1)
    requests = mixed_requests(model, 42, seed=2)
    llm = LLM(model, block_size=4, num_blocks=24, max_num_seqs=12, max_num_batched_tokens=48)
    outs = llm.generate([p for p, _ in requests], [s for _, s in requests])
    stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["recomputed_tokens"] > 0, stats
    assert stats["requests_finished"] == len(requests)
    check_pool(llm.engine)
    early = 0
    for i, ((prompt, settings), out) in enumerate(zip(requests, outs)):
        settings = dict(settings)
        seed = settings.pop("seed", None)
        if settings.get("num_return_sequences", 1) > 1 and settings.get("top_k") != 1:
            continue                              # checked for reproducibility below
        expected = reference(model, prompt, seed=seed, **settings)
        assert out.prompt_index == i and out.sequences.tolist() == expected.tolist(), f"request {i}: {settings}"
        early += out.outputs[0].finish_reason == "stop"
    assert early >= 5


def test_seeded_sampling_is_reproducible_per_request():
    model = make_model("qwen2", seed=3)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=gen).tolist() for n in torch.randint(1, 30, (12,), generator=gen)]
    settings = dict(max_new_tokens=12, do_sample=True, top_k=0, temperature=1.3, num_return_sequences=3)
    seeds = [dict(seed=s) for s in range(len(prompts))]
    roomy = generate_many(model, prompts, settings=seeds, **settings)
    tight = LLM(model, block_size=4, num_blocks=16, max_num_seqs=5, max_num_batched_tokens=16)
    cramped = tight.generate(prompts, seeds, **settings)
    alone = [generate_many(model, [p], settings=[s], **settings)[0] for p, s in zip(prompts[:3], seeds)]
    assert tight.stats()["preemptions"] > 0
    assert [o.sequences.tolist() for o in roomy] == [o.sequences.tolist() for o in cramped]
    assert [o.sequences.tolist() for o in roomy[:3]] == [o.sequences.tolist() for o in alone]
    assert any(len({tuple(r) for r in o.sequences.tolist()}) > 1 for o in roomy)   # the n samples differ
    check_pool(tight.engine)


def test_one_settings_dict_applies_to_every_prompt():
    """vLLM's idiom: one SamplingParams for the whole list. A dict is the same as its keys as keywords."""
    model = make_model("llama", seed=7)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 12, 3)]   # 3 prompts, 3 keys
    llm = LLM(model)
    one = llm.generate(prompts, dict(max_new_tokens=6, do_sample=False, min_new_tokens=6))
    keywords = llm.generate(prompts, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert [o.sequences.tolist() for o in one] == [o.sequences.tolist() for o in keywords]
    assert all(len(o.outputs[0].token_ids) == 6 for o in one)
    with pytest.raises(ValueError, match="max_new_tokens.*both"):
        llm.generate(prompts, dict(max_new_tokens=6), max_new_tokens=4)


def test_prefix_cache_second_call_computes_only_new_tokens():
    model = make_model("llama", seed=5)
    gen = torch.Generator().manual_seed(6)
    system = torch.randint(3, VOCAB, (37,), generator=gen).tolist()
    def questions():
        return [system + torch.randint(3, VOCAB, (int(n),), generator=gen).tolist() for n in (3, 9, 1, 14)]
    first, second = questions(), questions()
    llm = LLM(model, block_size=8)
    settings = dict(max_new_tokens=5, do_sample=False)
    llm.generate(first, **settings)
    before = llm.stats()
    outs = llm.generate(second, **settings)
    after = llm.stats()
    cached = len(system) // 8 * 8
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == cached * len(second)
    new_prompt_tokens = sum(len(p) - cached for p in second)
    decode_tokens = len(second) * (settings["max_new_tokens"] - 1)
    assert after["computed_tokens"] - before["computed_tokens"] == new_prompt_tokens + decode_tokens
    assert all(o.num_cached_tokens == cached for o in outs)
    interval = after.since(before)                  # the second call's own counters
    assert interval["prefix_hit_tokens"] == cached * len(second) and interval["requests_finished"] == len(second)
    assert interval["prefix_query_tokens"] == after["prefix_query_tokens"] - before["prefix_query_tokens"]
    assert interval["prefix_hit_rate"] == interval["prefix_hit_tokens"] / interval["prefix_query_tokens"]
    assert interval["generated_tokens"] == len(second) * settings["max_new_tokens"]
    assert 0 < interval["wall_s"] < after["wall_s"] and interval["blocks_used"] == after["blocks_used"]
    plain = generate_many(model, second, enable_prefix_caching=False, **settings)
    assert [o.sequences.tolist() for o in outs] == [o.sequences.tolist() for o in plain]
    assert 0 < after["prefix_hit_rate"] < 1 and after["blocks_cached"] > 0
    check_pool(llm.engine)


def test_bad_input_fails_clearly_and_alone():
    model = make_model("qwen3", seed=7)
    # a context asked past the pool's 32 tokens (a derived one is lowered to them: test_context_is_the_pools)
    llm = LLM(model, block_size=4, num_blocks=8, max_model_len=model.config.max_position_embeddings)
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[5, 6], []], max_new_tokens=3)
    with pytest.raises(ValueError, match="unknown generation argument.*tempreature"):
        llm.generate([[5, 6]], max_new_tokens=3, tempreature=0.5)
    with pytest.raises(ValueError, match="vLLM's names here: max_tokens -> max_new_tokens, n -> num_return_sequences"):
        llm.generate([[5, 6]], {"max_tokens": 3, "n": 2})
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(model, max_num_seq=4)
    with pytest.raises(ValueError, match="num_beams"):
        llm.generate([[5, 6]], max_new_tokens=3, num_beams=2)
    context = model.config.max_position_embeddings
    prompts = [[7] * 5, [8] * (context + 1), [9] * 20, [10] * 3]
    outs = llm.generate(prompts, max_new_tokens=14)
    assert "max_model_len" in outs[1].error and str(context) in outs[1].error
    assert "whole KV pool holds 8" in outs[2].error          # 34 tokens = 9 blocks of 4 > 8
    for i in (0, 3):
        assert outs[i].error is None
        assert outs[i].sequences.tolist() == reference(model, prompts[i], max_new_tokens=14, do_sample=False).tolist()
    with pytest.raises(RuntimeError, match="request 1 failed"):
        outs[1].sequences
    assert llm.stats()["requests_failed"] == 2
    check_pool(llm.engine)


def test_vllm_prompt_dicts_and_what_is_not_a_prompt():
    model = make_model("llama", seed=4)
    from tiny_models import word_tokenizer
    llm = LLM(model, word_tokenizer(), block_size=4)
    greedy = dict(max_new_tokens=3, do_sample=False)
    plain = [o.outputs[0].token_ids for o in llm.generate(["w5 w6", [7, 8, 9]], **greedy)]
    dicts = llm.generate([{"prompt": "w5 w6"}, {"prompt_token_ids": [7, 8, 9]}], **greedy)
    assert [o.outputs[0].token_ids for o in dicts] == plain
    assert [o.prompt for o in dicts] == ["w5 w6", None]                # vLLM's RequestOutput.prompt
    assert llm.generate({"prompt_token_ids": [7, 8, 9]}, **greedy)[0].outputs[0].token_ids == plain[1]
    batch = word_tokenizer()(["w5 w6"], return_tensors="pt")
    for bad, says in ((batch, "a tokenizer's output: pass its input_ids"),
                      ({"prompt": "w5", "x": 1}, r"\['prompt', 'x'\]"),
                      ([[5.7, 6.2]], r"token ids must be integers, got 5.7"), ([[True, 5]], "got True"),
                      (torch.tensor([[5.0, 6.0]]), "got 5.0")):
        with pytest.raises(ValueError, match=says):
            llm.generate(bad, **greedy)
    tensors = llm.generate([torch.tensor([7, 8, 9]), [torch.tensor(7), 8, 9]], **greedy)
    assert tensors[1].outputs[0].token_ids == plain[1]
    assert llm.engine.requests == {}
    check_pool(llm.engine)


def test_a_call_that_fails_while_adding_leaves_nothing_behind():
    """All or none: the requests a call added before its bad one are taken back (no record, no count)."""
    model = make_model("llama", seed=3)
    llm = LLM(model, block_size=4, num_blocks=16, max_model_len=40)
    for _ in range(3):
        with pytest.raises(ValueError, match="unknown generation argument"):
            llm.generate([[5, 6], [7] * 50, [9]], [dict(max_new_tokens=2), dict(max_new_tokens=2), dict(bogus=1)])
    assert llm.engine.requests == {} and not llm.engine.has_work
    stats = llm.stats()
    assert (stats["requests_finished"], stats["requests_cancelled"], stats["requests_failed"]) == (0, 0, 0)
    out = llm.generate([[5, 6]], max_new_tokens=3, do_sample=False)[0]
    assert out.sequences.tolist() == reference(model, [5, 6], max_new_tokens=3, do_sample=False).tolist()
    assert llm.engine.requests == {} and llm.stats()["requests_finished"] == 1
    check_pool(llm.engine)


def test_prompt_filling_the_context_gets_one_token():
    """As vLLM's engine: a sequence stops at the context's end (finish_reason "length"), whatever max_new_tokens
    asks; a prompt of max_model_len tokens still samples one token (from its last logits; the token never
    enters the model), which lm-eval's full-length loglikelihood windows need; a longer prompt fails alone."""
    model = make_model("llama", seed=11)
    llm = LLM(model, block_size=4, max_model_len=16)
    prompt = torch.randint(3, model.config.vocab_size, (17,), generator=torch.Generator().manual_seed(5)).tolist()
    full, short, too_long = llm.generate([prompt[:16], prompt[:10], prompt],
                                         [dict(max_new_tokens=2), dict(max_new_tokens=20), dict(max_new_tokens=1)],
                                         do_sample=False, ignore_eos=True)
    assert full.error is None and full.outputs[0].finish_reason == "length"
    assert full.sequences.tolist() == reference(model, prompt[:16], max_new_tokens=1, do_sample=False).tolist()
    assert short.outputs[0].finish_reason == "length" and len(short.outputs[0].token_ids) == 6
    assert short.sequences.tolist() == reference(model, prompt[:10], max_new_tokens=6, min_new_tokens=6,
                                                 do_sample=False).tolist()
    assert "17 tokens exceeds the model's context of 16 tokens (max_model_len)" in too_long.error
    check_pool(llm.engine)


def test_stop_reason_names_the_stop_string_or_token_as_vllms():
    """``CompletionOutput.stop_reason``: the stop string or the stop_token_ids entry the sequence ended on;
    None for EOS and for a length."""
    model = make_model("llama", seed=3)
    prompt = [5, 6, 7]
    free = LLM(model).generate([prompt], max_new_tokens=6, do_sample=False, ignore_eos=True)[0].outputs[0]
    assert free.stop_reason is None and free.finish_reason == "length"
    stop = free.token_ids[2]
    first = free.token_ids.index(stop)
    out = LLM(model).generate([prompt], max_new_tokens=6, do_sample=False, ignore_eos=True,
                              stop_token_ids=[stop])[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.token_ids) == ("stop", stop, free.token_ids[:first + 1])
    eos = LLM(model).generate([prompt], max_new_tokens=6, do_sample=False, eos_token_id=stop)[0].outputs[0]
    assert (eos.finish_reason, eos.stop_reason) == ("stop", None)
    llm = LLM(model)
    first, second = llm.generate([prompt, prompt], max_new_tokens=1)
    assert first.request_id.isdigit() and int(second.request_id) == int(first.request_id) + 1    # vLLM's field


def test_context_is_the_pools_where_it_holds_less_than_the_models():
    """A derived max_model_len (the model's) past what the KV pool holds is lowered to the pool (vLLM refuses to
    start there): a request without a length limit then ends at the pool's end, "length", instead of failing
    for want of blocks (hf_paged.SamplingParams(max_tokens=None), the server's chat without max_tokens)."""
    model = make_model("llama", seed=3)
    llm = LLM(model, block_size=4, num_blocks=8)
    assert llm.engine.max_model_len == 32 < model.config.max_position_embeddings
    out = llm.generate([[5, 6, 7]], max_new_tokens=10_000, do_sample=False, ignore_eos=True)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 29
    # a prompt past it is refused naming the pool and its knobs, not "raise max_model_len" (which the pool refuses)
    error = llm.generate([[5] * 40], max_new_tokens=5, do_sample=False, ignore_eos=True)[0].error
    assert error.startswith("prompt of 40 tokens exceeds the 32 tokens the KV pool holds")
    assert f"lowered from the model's {model.config.max_position_embeddings}" in error
    assert "num_blocks, kv_cache_memory_bytes" in error and "raise max_model_len" not in error


def test_cancel_mid_way_frees_blocks_and_the_rest_complete():
    model = make_model("glm", seed=8)
    prompts = [[11] * 9, [12] * 30, [13] * 4]
    llm = LLM(model, block_size=4)
    seen = []
    for event in llm.stream(prompts, max_new_tokens=10, do_sample=False):
        seen.append(event)
        if event.request_id == llm.last_ids[1] and len([e for e in seen if e.request_id == event.request_id]) == 3:
            held = llm.engine.pool.num_used
            llm.cancel(event.request_id)
            assert llm.engine.pool.num_used < held
            llm.engine.check_invariants()
    outs = [llm.engine.output(r) for r in llm.last_ids]
    assert outs[1].outputs[0].finish_reason == "cancelled" and len(outs[1].outputs[0].token_ids) == 3
    for i in (0, 2):
        assert outs[i].sequences.tolist() == reference(model, prompts[i], max_new_tokens=10, do_sample=False).tolist()
    assert llm.stats()["requests_cancelled"] == 1
    check_pool(llm.engine)


def test_stream_callbacks_and_text_prompts():
    from tiny_models import word_tokenizer
    model = make_model("llama", seed=9)
    tok = word_tokenizer()
    texts = ["w5 w9 w33", "w100", "w7 w8 w9 w10 w11"]
    got: dict[int, list[int]] = {}
    outs = generate_many(model, texts, tok, on_token=lambda e: got.setdefault(e.request_id, []).append(e.token),
                         max_new_tokens=6, do_sample=False)
    for out, text in zip(outs, texts):
        ids = tok(text, return_tensors="pt")
        expected = model.generate(**ids, max_new_tokens=6, do_sample=False)
        assert out.sequences.tolist() == expected.tolist()
        # the text continues the prompt's, as the text-generation pipeline's (return_full_text=False) and vLLM's:
        # the whole sequence's decode less the prompt's (the word tokenizer's space between them included)
        whole, prompt = (tok.decode(x, skip_special_tokens=True) for x in (expected[0], ids["input_ids"][0]))
        assert whole.startswith(prompt) and out.outputs[0].text == whole[len(prompt):]
        assert out.outputs[0].text.startswith(" ")
    assert [got[i] for i in range(3)] == [o.outputs[0].token_ids for o in outs]


def test_stop_strings_never_matching_and_matching():
    from tiny_models import word_tokenizer
    model = make_model("qwen2", seed=10)
    tok = word_tokenizer()
    free = generate_many(model, ["w5 w6"], tok, max_new_tokens=8, do_sample=False)[0]
    words = free.outputs[0].text.split()
    never = generate_many(model, ["w5 w6"], tok, max_new_tokens=8, do_sample=False, stop_strings=["zz-never"])[0]
    assert never.outputs[0].finish_reason == "length" and never.outputs[0].token_ids == free.outputs[0].token_ids
    stop = words[-1]
    first = next(k for k in range(len(words)) if stop in " ".join(words[:k + 1]))
    hit = generate_many(model, ["w5 w6"], tok, max_new_tokens=8, do_sample=False, stop_strings=["zz-never", stop])[0]
    assert (hit.outputs[0].finish_reason, hit.outputs[0].stop_reason) == ("stop_string", stop)
    assert hit.outputs[0].token_ids == free.outputs[0].token_ids[:first + 1]
    with pytest.raises(ValueError, match="need a tokenizer"):
        generate_many(model, [[5, 6]], max_new_tokens=3, stop_strings=["x"])


def test_generate_path_unchanged_by_the_engine():
    model = make_model("llama", seed=11)
    hf_paged.patch(model)
    try:
        ids = torch.tensor([[5, 6, 7]])
        LLM(model).generate([[5, 6, 7]], max_new_tokens=4)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                             cache_implementation="paged")
    finally:
        hf_paged.unpatch(model)
    assert out.tolist() == reference(model, [5, 6, 7], max_new_tokens=4, do_sample=False).tolist()


def test_cancel_from_a_token_callback_stops_the_request_at_once():
    """A request cancelled by its own on_token callback mid-step gets no further token, keeps its
    'cancelled' reason, and is counted once; the other request is unaffected."""
    model = make_model("qwen2", seed=1)
    llm = LLM(model, block_size=4, num_blocks=32)
    engine = llm.engine
    seen = []

    def on_token(event):
        seen.append(event)
        if len(seen) == 1:
            engine.cancel(event.request_id)

    rid = engine.add_request([5, 6, 7, 8, 9], max_new_tokens=6, do_sample=True, top_k=1, seed=0,
                             num_return_sequences=3, on_token=on_token)
    other = engine.add_request([9, 9, 9], max_new_tokens=2, do_sample=False)
    with engine.session():
        while engine.has_work:
            engine.step()
    out = engine.output(rid)
    assert len(seen) == 1, f"tokens delivered after the cancel: {seen}"
    assert [o.finish_reason for o in out.outputs] == ["cancelled"] * 3
    assert out.outputs[0].token_ids == [seen[0].token] and [o.token_ids for o in out.outputs[1:]] == [[], []]
    assert engine.output(other).outputs[0].finish_reason == "length"
    stats = engine.stats()
    assert stats["requests_finished"] == 2 and stats["requests_cancelled"] == 1
    check_pool(engine)


def test_a_call_that_raises_or_a_stream_left_early_leaves_nothing_running():
    """A callback that raises mid-step (or KeyboardInterrupt) and a stream abandoned with ``break`` cancel their
    call's requests: the blocks go back, the next call runs only its own requests and equals a clean run."""
    model = make_model("llama", seed=1)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 21, 2)]
    settings = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, use_tqdm=False)
    llm = LLM(model, block_size=4, num_blocks=40, enable_prefix_caching=False)
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts, **settings)]
    calls = []

    def flaky(event):
        calls.append(event)
        if len(calls) == 3:                      # mid-step: the first step samples all three
            raise KeyError("the callback failed")

    with pytest.raises(KeyError, match="the callback failed"):
        llm.generate(prompts, on_token=flaky, **settings)
    stats = llm.stats()
    assert stats["requests_running"] == stats["requests_waiting"] == 0 and llm.engine.pool.num_used == 0
    delivered = len(calls)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, **settings)] == clean
    assert len(calls) == delivered, "the failed call's callback fired in the next call"
    for _ in llm.stream(prompts, max_new_tokens=10, min_new_tokens=10, do_sample=False, use_tqdm=False):
        break
    assert llm.engine.pool.num_used == 0 and llm.stats()["requests_running"] == 0
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, **settings)] == clean
    left_open = llm.stream(prompts, max_new_tokens=10, min_new_tokens=10, do_sample=False, use_tqdm=False)
    next(left_open)                              # open, then another call on the same thread runs its requests too
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, **settings)] == clean
    assert llm.engine.requests == {}, "the open stream's finished requests stayed in the records"
    list(left_open)                              # its end: nothing of it left to cancel, and no KeyError
    assert llm.engine.requests == {} and llm.engine.pool.num_used == 0


def test_prompt_forms():
    """A text, a list of ids, a 1-d tensor (one prompt) or a 2-d one (a prompt per row); a flat list of ints
    is refused (one prompt of ids, or several one-token prompts?)."""
    llm = LLM(make_model("llama", seed=2), block_size=4, num_blocks=32)
    one = llm.generate([[5, 6, 7]], max_new_tokens=2, do_sample=False)[0].outputs[0].token_ids
    assert llm.generate(torch.tensor([5, 6, 7]), max_new_tokens=2, do_sample=False)[0].outputs[0].token_ids == one
    rows = llm.generate(torch.tensor([[5, 6, 7], [5, 6, 7]]), max_new_tokens=2, do_sample=False)
    assert [r.outputs[0].token_ids for r in rows] == [one, one]
    with pytest.raises(ValueError, match=r"flat list of 3 ints: pass \[\[\.\.\.\]\] for one prompt"):
        llm.generate([5, 6, 7], max_new_tokens=2)


def test_more_return_sequences_than_max_num_seqs_fails_alone():
    model = make_model("llama", seed=2)
    llm = LLM(model, block_size=4, num_blocks=32, max_num_seqs=2)
    outs = llm.generate([[5, 6, 7], [8, 9]], [dict(num_return_sequences=3, do_sample=True, seed=1),
                                             dict(do_sample=False)], max_new_tokens=4)
    assert outs[0].error is not None and "num_return_sequences=3" in outs[0].error and "max_num_seqs=2" in outs[0].error
    assert outs[1].error is None and outs[1].sequences.tolist() == \
        reference(model, [8, 9], max_new_tokens=4, do_sample=False).tolist()


def test_forget_drops_only_finished_requests():
    model = make_model("llama", seed=4)
    engine = LLM(model, block_size=4, num_blocks=32).engine
    rid = engine.add_request([5, 6, 7], max_new_tokens=3, do_sample=False)
    with pytest.raises(ValueError, match="still running"):
        engine.forget(rid)
    with engine.session():
        while engine.has_work:
            engine.step()
    out = engine.forget(rid)
    assert out.outputs[0].finish_reason == "length" and rid not in engine.requests


@pytest.mark.parametrize("rope", [
    dict(rope_type="longrope", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
         short_factor=[1.0] * 32, long_factor=[2.0 + 0.1 * i for i in range(32)]),
    dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)], ids=["longrope", "dynamic"])
def test_length_dependent_rope_runs_exactly_within_its_limit(rope):
    """transformers computes dynamic-NTK and longrope frequencies from each forward's longest position: packed
    with a long request, a short one would take the long one's. Requests within the limit (16 tokens for
    longrope's original context; 15 for dynamic NTK over max_position_embeddings=16) equal generate alone
    on a fresh model; longer ones fail alone, naming the RoPE and the limit."""
    from hf_paged.introspect import length_dependent_rope
    overrides = dict(max_position_embeddings=64 if rope["rope_type"] == "longrope" else 16, rope_parameters=rope)
    limit = 16 if rope["rope_type"] == "longrope" else 15
    assert length_dependent_rope(make_model("llama", seed=1, **overrides)) == (rope["rope_type"], limit)
    assert length_dependent_rope(make_model("llama", seed=1)) is None
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 20, 3, 7)]
    settings = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, use_tqdm=False)
    context = 64 if rope["rope_type"] == "longrope" else 32      # dynamic NTK's 16 x its factor (vLLM's rule)
    outs = LLM(make_model("llama", seed=1, **overrides), block_size=4, max_num_batched_tokens=16, num_blocks=96,
               max_model_len=context).generate(prompts, **settings)
    error = outs[1].error
    assert error is not None and f"RoPE ('{rope['rope_type']}')" in error and str(limit) in error
    for prompt, out in zip(prompts, outs):
        if len(prompt) + 8 > limit:
            assert out.error is not None
            continue
        ids = torch.tensor([prompt])
        want = make_model("llama", seed=1, **overrides).generate(ids, attention_mask=torch.ones_like(ids),
                                                                max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert out.outputs[0].token_ids == want[0, len(prompt):].tolist()


def test_new_weights_between_calls_are_followed():
    """load_state_dict between calls: the prefix cache's K/V and the prepacked linears came from the old
    weights; the next call equals a fresh engine on the new ones. A dtype change is refused."""
    from hf_paged.introspect import weights_key
    model, other = make_model("llama", seed=3), make_model("llama", seed=4)
    prompts = [list(range(5, 22)), list(range(5, 21)) + [30]]           # a shared 16-token prefix: cache hits
    settings = dict(max_new_tokens=6, do_sample=False, use_tqdm=False)
    llm = LLM(model, block_size=4, num_blocks=64)
    before = weights_key(model)
    llm.generate(prompts, **settings)
    assert weights_key(model) == before                                  # the engine itself writes no weight
    model.load_state_dict(other.state_dict())
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, **settings)]
    fresh = [o.outputs[0].token_ids for o in LLM(other, block_size=4, num_blocks=64).generate(prompts, **settings)]
    assert got == fresh
    model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype changed from torch.float32 to torch.bfloat16.*build a new"):
        llm.generate(prompts, **settings)


@pytest.mark.parametrize("change", ["fused_adamw", "data_write", "told"])
def test_weights_changed_without_a_version_bump_are_followed(change):
    """Writes that bump no version counter (a fused optimizer step, EMA or PEFT's merge through ``p.data``)
    are seen by the sampled values; a change too sparse for them is told with ``llm.weights_changed()``.
    The next call equals a fresh engine on the new weights (the prepacked copies and the prefix cache's
    K/V were the old ones')."""
    model = make_model("llama", seed=3)
    prompts = [list(range(5, 22)), list(range(5, 21)) + [30]]           # a shared 16-token prefix: cache hits
    settings = dict(max_new_tokens=6, do_sample=False, use_tqdm=False)
    llm = LLM(model, block_size=4, num_blocks=64)
    old = [o.outputs[0].token_ids for o in llm.generate(prompts, **settings)]
    if change == "fused_adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
        model(torch.tensor([prompts[0]])).logits.logsumexp(-1).sum().backward()
        versions = [p._version for p in model.parameters()]
        optimizer.step()
        assert versions == [p._version for p in model.parameters()]        # what makes this case hard
        model.zero_grad(set_to_none=True)
    elif change == "data_write":
        for p in model.parameters():
            p.data.mul_(-1.5)
    else:
        embedding = model.get_input_embeddings().weight
        embedding.data[prompts[0][:16]] *= -3                              # rows the sample may miss
        llm.weights_changed()
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, **settings)]
    fresh = [o.outputs[0].token_ids for o in LLM(model, block_size=4, num_blocks=64).generate(prompts, **settings)]
    assert got == fresh and got != old


@pytest.mark.parametrize("kv", ["kivi", "int8", "auto"])
def test_forks_under_preemption_equal_a_roomy_pool(kv):
    """A preemption that frees a block an earlier copy-on-write of the same schedule copies from, and hands it
    out again as another copy's destination: the copies are applied as they are made (KIVI's open rows were
    released before their copy and request 0's first sequence lost its prompt's K/V)."""
    model = make_model("llama", seed=3)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 1)]
    settings = [dict(do_sample=True, top_k=1, max_new_tokens=40, eos_token_id=None, seed=i, num_return_sequences=2)
                for i in range(2)]

    def run(num_blocks):
        llm = LLM(model, block_size=32, num_blocks=num_blocks, kv_cache_dtype=kv, enable_prefix_caching=False)
        return [[s.token_ids for s in o.outputs] for o in llm.generate(prompts, settings)], llm.stats()["preemptions"]

    roomy, none = run(64)
    tight, preemptions = run(3)
    assert none == 0 and preemptions > 0 and tight == roomy


def test_kivi_side_rows_grown_in_a_forward_take_copies_later():
    """KIVI's open / sink rows grown inside a forward (inference mode) are written in place by a copy-on-write
    between steps: they must be normal tensors (it raised "Inplace update to inference tensor")."""
    model = make_model("llama", seed=3)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 40, 1)]
    llm = LLM(model, block_size=32, num_blocks=8, max_num_seqs=2, kv_cache_dtype="kivi")
    outs = llm.generate(prompts, [dict(do_sample=True, top_k=1, max_new_tokens=40, eos_token_id=None, seed=i,
                                       num_return_sequences=2) for i in range(3)])
    assert all(o.error is None and len(o.outputs) == 2 for o in outs)


def test_prompt_ids_outside_the_vocabulary_are_refused_by_name():
    """vLLM refuses them at intake; the embedding raised a bare IndexError mid-step (a device assert on CUDA)."""
    llm = LLM(make_model("llama", seed=1), block_size=4, num_blocks=32)
    for bad in ([5, VOCAB, 7], [5, -1]):
        with pytest.raises(ValueError, match=rf"prompt token id {bad[1]} \(position 1\) is outside .* {VOCAB} ids"):
            llm.generate([[5, 6], bad], max_new_tokens=2, do_sample=False)
    assert not llm.engine.has_work and llm.engine.pool.num_used == 0


def test_llm_keeps_no_record_of_past_calls():
    """generate returns its outputs and drops them from the engine; a stream's stay readable until the next call."""
    llm = LLM(make_model("llama", seed=1), block_size=4, num_blocks=32)
    for _ in range(3):
        outs = llm.generate([[5, 6, 7]] * 4, max_new_tokens=3, do_sample=False, logprobs=2)
        assert len(outs) == 4 and outs[0].outputs[0].logprobs is not None
    assert llm.engine.requests == {}
    list(llm.stream([[5, 6]], max_new_tokens=2, do_sample=False))
    assert llm.engine.output(llm.last_ids[0]).finished and len(llm.engine.requests) == 1
    llm.generate([[8]], max_new_tokens=1, do_sample=False)
    assert llm.engine.requests == {}


def test_weights_the_first_forward_re_lays_are_not_new_weights():
    """bitsandbytes repacks 4-bit weights for its CPU kernel on the first forward (new storage, same weights): a
    request added while others run was refused as 'weights changed', which killed the server's engine thread."""
    model = make_model("llama", seed=3)
    layer = model.model.layers[0].mlp.down_proj

    def re_lay(module, args):
        if not getattr(module, "_re_laid", False):
            module._re_laid = True
            module.weight.data = module.weight.data.clone()
    layer.register_forward_pre_hook(re_lay)
    engine = Engine(model, block_size=4, num_blocks=64, enforce_eager=True)
    first = engine.add_request([5, 6, 7], max_new_tokens=4, do_sample=False)
    engine.step()
    second = engine.add_request([8, 9], max_new_tokens=2, do_sample=False)        # raised before
    engine.run()
    assert engine.output(first).finished and engine.output(second).finished


def test_a_cpu_default_pool_too_small_says_where_its_size_came_from(monkeypatch):
    """On a machine with almost no memory free the default KV budget holds no block: the error says the budget
    was the unset knob's default and how that is sized (it read 'kv_cache_memory_bytes (CPU default)=10240')."""
    monkeypatch.setattr("hf_paged.engine.config.available_bytes", lambda: 100 * 1024)
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=10240 bytes \(unset: the CPU default, .*10% of the "
                                         r"available memory.*\) holds no block.*Raise kv_cache_memory_bytes"):
        LLM(make_model("llama"))


@pytest.mark.parametrize("knobs, says", [
    (dict(max_model_len=0), "max_model_len must be an int >= 1 or None, got 0"),
    (dict(max_model_len="100"), "max_model_len must be an int"),
    (dict(enable_prefix_caching="no"), "enable_prefix_caching must be True or False"),
    (dict(gpu_memory_utilization="0.5"), r"gpu_memory_utilization must be in \(0, 1\]"),
    (dict(kv_cache_memory_bytes="1M"), "kv_cache_memory_bytes must be an int"),
    (dict(block_size=True), "block_size must be an int >= 1, got True"),
    (dict(max_logprobs=True), "max_logprobs must be an int >= 0, got True"),
    (dict(max_model_len=513), "max_model_len=513 is over the 512 tokens this model's positions cover"),
    (dict(block_size=2000), r"block_size must be an int in 1\.\.1024, got 2000"),
    (dict(kv_cache_dtype="kivi", block_size=16), "set block_size=32"),
])
def test_engine_knobs_are_checked_by_name(knobs, says):
    with pytest.raises(ValueError, match=says):
        LLM(make_model("llama"), **knobs)


def test_a_context_past_the_trained_one_needs_the_opt_in(monkeypatch):
    """As vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN; RoPE scaling that extends the context counts (vLLM's rule)."""
    from hf_paged.introspect import trained_context
    monkeypatch.setenv("HF_PAGED_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert LLM(make_model("llama"), max_model_len=600).engine.max_model_len == 600
    config = make_model("llama").config
    assert trained_context(config) == 512
    config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                              "rope_theta": 10000.0}
    assert trained_context(config) == 1024
    config.rope_parameters = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0}
    assert trained_context(config) == 512
    config.rope_parameters = {"full_attention": {"rope_type": "linear", "factor": 2.0},
                              "sliding_attention": {"rope_type": "default"}}
    assert trained_context(config) == 1024
