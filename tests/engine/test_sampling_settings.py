"""vLLM's sampling settings on the engine. Where transformers has the setting (repetition_penalty, min_p,
min_new_tokens, bad_words_ids, sequence_bias) the engine's tokens equal ``generate``'s with it on that
prompt alone; OpenAI's presence / frequency penalties, logit_bias, allowed_token_ids and stop_token_ids
are checked against a plain greedy loop written here from their definitions."""
from __future__ import annotations

import pytest
import torch

from tiny_models import EOS, VOCAB, make_model, word_tokenizer
from hf_paged.engine import LLM


def reference(model, prompt, seed=None, **settings):
    ids = torch.tensor([prompt])
    if seed is not None:
        torch.manual_seed(seed)
    return model.generate(ids, attention_mask=torch.ones_like(ids), **settings)[0, len(prompt):].tolist()


def plain_greedy(model, prompt, steps, bias=None, presence=0.0, frequency=0.0, allowed=None, stop=()):
    """Greedy decoding by full forwards, with OpenAI's definitions applied by hand."""
    ids, out = list(prompt), []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float().clone()
        for token, value in (bias or {}).items():
            logits[token] += value
        for token in set(out):
            logits[token] -= out.count(token) * frequency + presence
        if allowed is not None:
            masked = torch.full_like(logits, -float("inf"))
            masked[list(allowed)] = logits[list(allowed)]
            logits = masked
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
        if token in stop:
            break
    return out


def prompts(count, seed, longest=24):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(1, longest, (), generator=gen)),), generator=gen).tolist()
            for _ in range(count)]


TRANSFORMERS_SETTINGS = [
    dict(repetition_penalty=1.3, do_sample=False),
    dict(repetition_penalty=0.8, do_sample=True, temperature=0.9),
    dict(min_p=0.05, do_sample=True, temperature=1.2),
    dict(min_p=0.2, top_k=0, do_sample=True),
    dict(min_new_tokens=5, eos_token_id=[EOS, 7], do_sample=False),
    dict(sequence_bias={(9,): 4.0, (11,): -10.0}, do_sample=False),
    dict(repetition_penalty=1.1, min_p=0.1, do_sample=True, top_p=0.9),
]


@pytest.mark.parametrize("family", ["llama", "qwen2", "glm"])
def test_transformers_settings_equal_generate(family):
    model = make_model(family, seed=11)
    seed = int(torch.randint(0, 10**6, ()))
    ps = prompts(len(TRANSFORMERS_SETTINGS) + 1, seed)
    free = reference(model, ps[-1], max_new_tokens=4, do_sample=False)
    settings = [dict(s, max_new_tokens=10) for s in TRANSFORMERS_SETTINGS] + [
        dict(bad_words_ids=[[free[1]], free[2:4]], max_new_tokens=10, do_sample=False)]
    for i, s in enumerate(settings):
        if s.get("do_sample"):
            s["seed"] = seed + i
    outs = LLM(model, block_size=4, max_num_batched_tokens=16).generate(ps, settings)
    for prompt, s, out in zip(ps, settings, outs):
        s = dict(s)
        expected = reference(model, prompt, seed=s.pop("seed", None), **s)
        assert out.outputs[0].token_ids == expected, f"seed {seed}: {s}"
    assert free[1] not in outs[-1].outputs[0].token_ids


def test_openai_penalties_bias_and_masks_equal_a_plain_reference():
    model = make_model("qwen3", seed=12)
    seed = int(torch.randint(0, 10**6, ()))
    ps = prompts(6, seed)
    first = plain_greedy(model, ps[3], 3)
    gen = torch.Generator().manual_seed(seed)
    every = dict(zip(range(VOCAB), (3 * torch.randn(VOCAB, generator=gen)).tolist()))   # the whole vocabulary
    cases = [
        dict(presence_penalty=1.5),
        dict(frequency_penalty=0.7, presence_penalty=-0.3),
        dict(logit_bias={5: 3.0, 6: -100.0, 40: 1.5}, frequency_penalty=2.0),
        dict(stop_token_ids=[first[2]]),
        dict(allowed_token_ids=[3, 4, 5, 8, 13, 21, 34]),
        dict(logit_bias=every),
    ]
    outs = LLM(model).generate(ps, [dict(c, max_new_tokens=12, do_sample=False, ignore_eos=True) for c in cases])
    for prompt, c, out in zip(ps, cases, outs):
        expected = plain_greedy(model, prompt, 12, bias=c.get("logit_bias"), presence=c.get("presence_penalty", 0.0),
                                frequency=c.get("frequency_penalty", 0.0), allowed=c.get("allowed_token_ids"),
                                stop=c.get("stop_token_ids", ()))
        assert out.outputs[0].token_ids == expected, f"seed {seed}: {c}"
    assert outs[3].outputs[0].finish_reason == "stop" and outs[3].outputs[0].token_ids[-1] == first[2]
    assert set(outs[4].outputs[0].token_ids) <= {3, 4, 5, 8, 13, 21, 34}


def test_min_new_tokens_holds_back_stop_token_ids_too():
    model = make_model("llama", seed=13)
    prompt = prompts(1, 3)[0]
    first = plain_greedy(model, prompt, 1)[0]
    out = LLM(model).generate([prompt], stop_token_ids=[first], min_new_tokens=3, max_new_tokens=6,
                              do_sample=False)[0].outputs[0]
    assert out.token_ids[0] != first and len(out.token_ids) >= 3


@pytest.mark.parametrize("settings, message", [
    (dict(presence_penalty=2.5), "presence_penalty must be in"),
    (dict(repetition_penalty=0.0), "penalty"),
    (dict(min_p=1.5), "min_p"),
    (dict(allowed_token_ids=[]), "allowed_token_ids is empty"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(logit_bias={VOCAB + 5: 1.0}), "outside the vocabulary"),
    (dict(max_new_tokens=float("nan")), "max_new_tokens must be an int, got nan"),   # it never stopped
    (dict(max_new_tokens=4.0), "max_new_tokens must be an int"),
    (dict(bad_words_ids=[[]]), "bad_words_ids"),
    (dict(seed=2**64 - 1, num_return_sequences=2), r"seed must be an int in \[-2\*\*63"),   # overflowed at the fork
    (dict(seed="7"), "seed must be an int"),
    (dict(seed=1.5), "seed must be an int"),
    (dict(num_return_sequences=True), "num_return_sequences must be a positive int"),
    (dict(temperature="hot"), "temperature must be a number, got 'hot'"),
    (dict(stop_strings=["x", ""]), "stop_strings must be non-empty strings"),     # stopped after one token
])
def test_bad_values_are_refused_with_their_name(settings, message):
    model = make_model("llama", seed=14)
    llm = LLM(model, tokenizer=word_tokenizer())
    with pytest.raises(ValueError, match=message):
        llm.generate([[4, 5, 6]], **{"max_new_tokens": 2, "do_sample": True, **settings})
    assert not llm.engine.has_work and llm.engine.pool.num_used == 0


def test_a_call_that_fails_cancels_all_its_requests_whatever_one_cancel_raises(monkeypatch):
    model = make_model("llama", seed=14)
    llm = LLM(model)
    real_cancel, failures = llm.engine.cancel, [RuntimeError("cancel failed (simulated)")]

    def cancel_failing_once(rid):
        if failures:
            raise failures.pop()
        real_cancel(rid)

    monkeypatch.setattr(llm.engine, "cancel", cancel_failing_once)
    stream = llm.stream([[4, 5, 6], [7, 8], [9]], max_new_tokens=50, do_sample=False, ignore_eos=True)
    next(stream)
    with pytest.raises(RuntimeError, match="simulated"):
        stream.close()
    running = [rid for rid in llm.last_ids[1:] if rid in llm.engine.requests and not llm.engine.requests[rid].finished]
    assert running == []


def test_greedy_rows_take_torch_argmax_with_its_ties_and_nans():
    """The sampler's greedy pick is torch's argmax, bit for bit: the first of tied maxima, a NaN as the maximum
    (the first NaN), rows all -inf -> 0, in every float dtype and at a real vocabulary's width."""
    from types import SimpleNamespace

    from hf_paged.engine.sampler import sample
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = torch.randn(9, 49152, generator=gen).to(dtype)
        logits[1, 5] = logits[1, 900] = 100
        logits[2, 7], logits[2, 3] = float("nan"), 100
        logits[3, 9] = logits[3, 2] = float("nan")
        logits[4] = float("-inf")
        logits[5, 10] = logits[5, 20] = float("inf")
        logits[6] = logits[6].round().clamp(max=1)          # thousands of ties at the top (1)
        params = SimpleNamespace(do_sample=False, processes_logits=False)
        seqs = [SimpleNamespace(request=SimpleNamespace(params=params, min_new_tokens=0), num_output=0)] * 9
        tokens = sample(logits, seqs)
        assert tokens == logits.argmax(-1).tolist()
        assert tokens[1:6] == [5, 7, 2, 0, 10]
