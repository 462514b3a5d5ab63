"""Log-probabilities through ``hf-paged serve``: completions' ``logprobs`` with and without ``echo``
(lm-evaluation-harness' loglikelihood request, verbatim), ``max_tokens: 0``, streams, chat's
``logprobs`` / ``top_logprobs`` and vLLM's ``prompt_logprobs`` — each value equal to ``log_softmax`` of
a plain forward of the tiny model within 1e-4."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402

from hf_paged.integrations.server import create_app  # noqa: E402
from live_server import running  # noqa: E402
from tiny_models import chat_word_tokenizer, make_model  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def served():
    model, tok = make_model("llama", seed=21), chat_word_tokenizer()
    app = create_app(model, tok, served_model_name="tiny", num_blocks=32, max_num_seqs=4, block_size=8,
                     max_num_batched_tokens=24)
    # the references run on a copy: the engine thread keeps the served model in paged mode
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client, make_model("llama", seed=21), tok


def forward_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def post(client, path, body):
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_lm_eval_loglikelihood_request(served):
    client, model, tok = served
    gen = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 30, 2)]
    body = {"model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    answer = post(client, "/v1/completions", body)
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    assert len(choices) == 3
    for ids, choice in zip(prompts, choices):
        lp = choice["logprobs"]
        ref = forward_logprobs(model, ids)
        new = int(ref[-1].argmax())                    # greedy: the one generated token
        assert len(lp["tokens"]) == len(ids) + 1 and lp["tokens"][:len(ids)] == [f"w{t}" for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for p in range(1, len(ids)):
            assert abs(lp["token_logprobs"][p] - ref[p - 1, ids[p]].item()) < TOL
            top = lp["top_logprobs"][p]
            best = int(ref[p - 1].argmax())
            assert f"w{ids[p]}" in top and abs(top[f"w{best}"] - ref[p - 1, best].item()) < TOL
            assert len(top) in (1, 2)
        assert abs(lp["token_logprobs"][-1] - ref[-1, new].item()) < TOL
        assert choice["text"].startswith(tok.decode(ids)) and choice["text"].endswith(f"w{new}")
        offsets = lp["text_offset"]
        assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(choice["text"])
        assert offsets[-1] == len(tok.decode(ids)), "the completion's token starts where the prompt's text ends"
    assert answer["usage"]["prompt_tokens"] == sum(map(len, prompts))


def test_echo_with_max_tokens_zero_answers_the_prompt_only(served):
    client, model, _ = served
    ids = [5, 17, 40, 41, 99, 3]
    answer = post(client, "/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 0})
    choice = answer["choices"][0]
    ref = forward_logprobs(model, ids)
    assert choice["text"] == " ".join(f"w{t}" for t in ids)
    assert len(choice["logprobs"]["tokens"]) == len(ids) and answer["usage"]["completion_tokens"] == 0
    assert [round(x, 3) for x in choice["logprobs"]["token_logprobs"][1:]] == [
        round(ref[p - 1, ids[p]].item(), 3) for p in range(1, len(ids))]
    plain = post(client, "/v1/completions", {"prompt": "w5 w6", "echo": True, "max_tokens": 0})
    assert plain["choices"][0]["text"] == "w5 w6" and plain["choices"][0]["logprobs"] is None


def test_generated_logprobs_whole_equal_streamed(served):
    client, model, _ = served
    body = {"prompt": "w10 w11 w12", "max_tokens": 7, "logprobs": 3, "temperature": 0.8, "seed": 5}
    whole = post(client, "/v1/completions", body)["choices"][0]
    chunks = []
    with client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            for key in streamed:
                streamed[key] += (choice["logprobs"] or {}).get(key, [])
    assert streamed == whole["logprobs"]
    ids = [10, 11, 12] + [int(t[1:]) for t in whole["logprobs"]["tokens"]]
    ref = forward_logprobs(model, ids)
    for step, token in enumerate(ids[3:]):
        assert abs(whole["logprobs"]["token_logprobs"][step] - ref[2 + step, token].item()) < TOL
        assert len(whole["logprobs"]["top_logprobs"][step]) in (3, 4)


def test_chat_logprobs_and_prompt_logprobs(served):
    client, model, tok = served
    body = {"messages": [{"role": "user", "content": "w20 w21"}], "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "prompt_logprobs": 1}
    answer = post(client, "/v1/chat/completions", body)
    content = answer["choices"][0]["logprobs"]["content"]
    prompt = tok(tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    new = [int(item["token"][1:]) for item in content]
    ref = forward_logprobs(model, prompt + new)
    for step, item in enumerate(content):
        assert abs(item["logprob"] - ref[len(prompt) - 1 + step, new[step]].item()) < TOL
        assert item["bytes"] == list(item["token"].encode()) and len(item["top_logprobs"]) == 2
        assert item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][1]["logprob"]
    prompt_lp = answer["prompt_logprobs"]
    assert prompt_lp[0] is None and len(prompt_lp) == len(prompt)
    for p in range(1, len(prompt)):
        assert abs(prompt_lp[p][str(prompt[p])]["logprob"] - ref[p - 1, prompt[p]].item()) < TOL
    none = post(client, "/v1/chat/completions", {"messages": body["messages"], "max_tokens": 2})
    assert none["choices"][0]["logprobs"] is None and "prompt_logprobs" not in none
