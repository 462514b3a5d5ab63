"""The server's endpoints in process (Starlette's TestClient, the app's lifespan running the engine thread):
vLLM's /tokenize, /detokenize and /version; vLLM-style bodies accepted end to end; and bodies built to
break a parser, each answered with a 4xx and an OpenAI error body, never a 5xx.
"""
from __future__ import annotations

import json
from importlib import metadata

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from hf_paged.integrations.server import create_app  # noqa: E402
from live_server import running  # noqa: E402
from tiny_models import VOCAB, chat_word_tokenizer, make_model  # noqa: E402

MODEL = "tiny"
KNOBS = dict(num_blocks=32, max_num_seqs=6, max_num_batched_tokens=64, block_size=16)
MESSAGES = [{"role": "user", "content": "w10 w11"}]


@pytest.fixture(scope="module")
def client():
    app = create_app(make_model("llama"), chat_word_tokenizer(), served_model_name=MODEL, **KNOBS)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def test_tokenize_and_detokenize(client):
    r = client.post("/tokenize", json={"model": MODEL, "prompt": "w3 w4 w5"})
    assert r.status_code == 200
    max_len = client.get("/v1/models").json()["data"][0]["max_model_len"]
    assert r.json() == {"count": 3, "max_model_len": max_len, "tokens": [3, 4, 5], "token_strs": None}
    r = client.post("/tokenize", json={"prompt": "w3 w4", "return_token_strs": True, "add_special_tokens": False})
    assert r.json()["token_strs"] == ["w3", "w4"]
    chat = client.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == [10, 11, 9] and chat["count"] == 3          # the template opens the turn: w9
    bare = client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["tokens"] == [10, 11]
    assert client.post("/detokenize", json={"tokens": [3, 4, 5]}).json() == {"prompt": "w3 w4 w5"}
    assert client.post("/detokenize", json={"model": MODEL, "tokens": []}).json() == {"prompt": ""}


def test_lm_eval_remote_tokenizer_reads_the_server():
    """lm-eval's ``tokenizer_backend=remote`` (its RemoteTokenizer: /tokenizer_info, /tokenize, /detokenize)."""
    utils = pytest.importorskip("lm_eval.utils")
    tok = chat_word_tokenizer()
    app = create_app(make_model("llama"), tok, served_model_name=MODEL, **KNOBS)
    with running(app) as url:
        remote = utils.RemoteTokenizer(url + "/v1/completions", max_retries=1)
        assert remote.eos_token == "</s>" and remote.bos_token == "<s>" and remote.eos_token_id == 1
        assert remote.encode("w7 w8") == [7, 8] and remote.decode([7, 8]) == "w7 w8"
        messages = [{"role": "user", "content": "w10 w11"}]
        assert remote.apply_chat_template(messages) == tok.apply_chat_template(messages, tokenize=False,
                                                                              add_generation_prompt=True)


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "other", "prompt": "w3"}, 404, "model"),
    ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "tools.0"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message"),
    ("/detokenize", {"tokens": [3, VOCAB]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["w3"]}, 400, "tokens.0"),
])
def test_tokenize_refusals(client, path, body, status, param):
    r = client.post(path, json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.json()


def test_version(client):
    assert client.get("/version").json() == {"version": metadata.version("hf-paged")}


def test_utility_endpoints_need_the_api_key():
    app = create_app(make_model("llama"), chat_word_tokenizer(), served_model_name=MODEL, api_key="k", **KNOBS)
    with TestClient(app) as c:
        for method, path in (("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version")):
            assert c.request(method, path, json={"prompt": "w3", "tokens": [3]}).status_code == 401, path
        good = {"Authorization": "Bearer k"}
        assert c.post("/tokenize", json={"prompt": "w3"}, headers=good).json()["tokens"] == [3]


def test_vllm_bodies_are_served(client):
    """vLLM's bench body and a body full of vLLM's neutral fields give the bare request's text."""
    bare = {"model": MODEL, "prompt": "w3 w4 w5", "max_tokens": 6, "temperature": 0}
    want = client.post("/v1/completions", json=bare).json()["choices"][0]["text"]
    bench = {**bare, "repetition_penalty": 1.0, "logprobs": None, "ignore_eos": False, "stream": True,
             "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=bench) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["text"] for e in events for c in e["choices"]) == want
    assert events[-1]["usage"]["completion_tokens"] >= 1
    neutral = {**bare, "use_beam_search": False, "top_k": -1, "min_p": 0.0, "length_penalty": 1.0,
               "stop_token_ids": [], "min_tokens": 0, "presence_penalty": 0.0, "frequency_penalty": 0,
               "bad_words": [], "logit_bias": {}, "priority": 0, "response_format": {"type": "text"},
               "skip_special_tokens": True, "spaces_between_special_tokens": True, "request_id": "x",
               "guided_decoding_backend": "xgrammar", "add_special_tokens": True, "echo": False, "best_of": 1}
    assert client.post("/v1/completions", json=neutral).json()["choices"][0]["text"] == want
    cut = client.post("/v1/completions", json={**bare, "truncate_prompt_tokens": 2}).json()
    assert cut["usage"]["prompt_tokens"] == 2
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "logprobs": False,
            "top_logprobs": 0, "tool_choice": "none", "parallel_tool_calls": True, "include_reasoning": True,
            "add_generation_prompt": True, "chat_template_kwargs": {"unused": 1}, "reasoning_effort": "low"}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3


def _deep(n: int, key: str = "") -> bytes:
    opener = (f'{{"{key}":' if key else "[").encode()
    closer = b"}" if key else b"]"
    return opener * n + b"1" + closer * n


NUMBER = b"9" * 10_000
FAULTS = [
    b"", b"{not json", b"null", b"[]", b'"x"', b"5", _deep(5000), _deep(5000, "a"),
    b'{"prompt": ' + _deep(5000) + b"}", b'{"messages": ' + _deep(5000) + b"}",
    b'{"prompt": "w3", "guided_json": ' + _deep(5000, "a") + b"}",
    b'{"prompt": "w3", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": '
    + _deep(3000, "a") + b"}}}",
    b'{"prompt": "w3 \xff\xfe"}', '{"prompt": "w3"}'.encode("utf-16"), '{"prompt": "w3"}'.encode("utf-8-sig"),
    '{"messages": [{"role": "user", "content": "w3"}]}'.encode("utf-16"),
    b'{"prompt": "w3 \\ud800"}', b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
    b'{"prompt": "w3", "max_tokens": ' + NUMBER + b"}", b'{"prompt": "w3", "temperature": ' + NUMBER + b"}",
    b'{"prompt": [3, ' + NUMBER + b"]}", b'{"prompt": "w3", "temperature": 1e400}',
    b'{"prompt": "w3", "temperature": NaN}', b'{"prompt": "w3", "top_p": Infinity}',
    b'{"prompt": "w3", "presence_penalty": -Infinity}', b'{"prompt": "w3", "logit_bias": {"5": NaN}}',
    b'{"messages": [{"role": "user", "content": "w3"}], "temperature": NaN}',
    b'{"prompt": [3, 4.0]}', b'{"prompt": [3, true]}', b'{"prompt": [3, -1]}', b'{"prompt": [[3], [-4]]}',
    b'{"prompt": [3, 1180591620717411303424]}', b'{"prompt": [[3], [1180591620717411303424]]}',
    b'{"prompt": [3, null]}', b'{"prompt": [[]]}', b'{"prompt": []}', b'{"prompt": {}}', b'{"prompt": ""}',
    b'{"prompt": "w3", "max_tokens": "five"}', b'{"prompt": "w3", "n": 2.5}', b'{"prompt": "w3", "seed": "x"}',
    b'{"prompt": "w3", "logprobs": [1]}', b'{"prompt": "w3", "stream": "maybe"}', b'{"prompt": "w3", "seed": 1e30}',
    b'{"messages": "w3"}', b'{"messages": []}', b'{"messages": [{"role": 5, "content": "w3"}]}',
    b'{"messages": [{"role": "user", "content": 5}]}', b'{"messages": [{"role": "user", "content": [{}]}]}',
    b'{"messages": [{"role": "user", "content": "w3"}], "max_completion_tokens": "nine"}',
    b'{"prompt": ' + json.dumps([[3]] * 300_000).encode() + b"}",
    b'{"prompt": ' + json.dumps([3] * 400_000).encode() + b"}",
    b'{"prompt": ' + json.dumps(["w3"] * 200_000).encode() + b"}",
    b'{"prompt": "w3", "stop": ' + json.dumps(["w4"] * 100_000).encode() + b"}",
    b'{"prompt": "w3", "bad_words": ' + json.dumps(["w4"] * 100_000).encode() + b"}",
    b'{"prompt": "w3", "logit_bias": ' + json.dumps({str(i): 1 for i in range(100_000)}).encode() + b"}",
    b'{"prompt": "w3", "allowed_token_ids": ' + json.dumps(list(range(200_000))).encode() + b"}",
    b'{"messages": ' + json.dumps([{"role": "user", "content": "w3"}] * 20_000).encode() + b', "max_tokens": 2}',
    b"x" * (5 * 2**20),
]


AS_CHAT = (b'"prompt": "w3"', b'"messages": [{"role": "user", "content": "w3"}]')


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_no_body_makes_a_5xx(client, path):
    """Every body of FAULTS to both endpoints (to chat with its text prompt as a user message, so the
    field at fault is what is refused, not ``prompt``)."""
    for raw in FAULTS:
        if path == "/v1/chat/completions":
            raw = raw.replace(*AS_CHAT)
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code in (400, 404, 413), (raw[:80], r.status_code, r.text[:300])
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and "Traceback" not in error["message"], raw[:80]
    assert client.get("/health").status_code == 200
