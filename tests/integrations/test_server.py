"""``hf-paged serve``: the OpenAI-compatible server, driven by the official ``openai`` client on 127.0.0.1.

Most tests share one in-process server (tiny random llama + word tokenizer, uvicorn in a thread); the
last one starts the real ``python -m hf_paged serve smollm2`` and stops it with SIGTERM. No assertion is
on how fast anything was: the timeouts below only turn a hang into a failure that says so. Sampling
uses fixed seeds (the ``seed`` field).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import hf_paged  # noqa: E402
from hf_paged.cli import build_parser, format_bytes, parse_bytes  # noqa: E402
from hf_paged.engine import EngineConfig  # noqa: E402
from hf_paged.integrations.server import create_app  # noqa: E402
from hf_paged.integrations.server.config import AppConfig, ServeConfig  # noqa: E402
from hf_paged.integrations.server.detokenize import TextStream  # noqa: E402
from live_server import running  # noqa: E402
from tiny_models import chat_word_tokenizer, make_model  # noqa: E402

HOST = "127.0.0.1"
MODEL = "tiny"
KNOBS = dict(num_blocks=32, max_num_seqs=6, max_num_batched_tokens=64, block_size=16)
HANG_S = 60          # generous: only a hang takes this long


def wait_for(condition, what, timeout: float = HANG_S):
    """Poll ``condition()`` until it is truthy (returned); after ``timeout`` s fail saying what hung
    (``what``: a text, or a callable giving one then)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"hung: {what() if callable(what) else what} (not within {timeout:.0f} s)")
        time.sleep(0.02)
    return value


@pytest.fixture(scope="module")
def server():
    app = create_app(make_model("llama"), chat_word_tokenizer(), served_model_name=MODEL, **KNOBS)
    with running(app) as url:
        yield url, app


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def wait_idle(app):
    def idle():
        stats = app.state.worker.stats()
        return stats if stats.requests_running == stats.requests_waiting == stats.blocks_used == 0 else None

    return wait_for(idle, lambda: f"the engine going idle (stats now: {app.state.worker.stats()})")


def wait_cancelled(app, count: int, what: str) -> None:
    wait_for(lambda: app.state.worker.stats().requests_cancelled >= count, f"{what} being cancelled")


PROMPTS = [" ".join(f"w{3 + (7 * i + 5 * k) % 250}" for k in range(2 + i % 5)) for i in range(12)]
MAX_TOKENS = [6 + (5 * i) % 23 for i in range(12)]


def test_models_and_health(server, client):
    url, _ = server
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(url + "/health").status_code == 200


def test_concurrent_greedy_equals_sequential_and_offline(server, client):
    def one(i):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=MAX_TOKENS[i], temperature=0)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens, r.usage.prompt_tokens

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        concurrent_out = list(pool.map(one, range(len(PROMPTS))))
    sequential = [one(i) for i in range(len(PROMPTS))]
    assert concurrent_out == sequential
    llm = hf_paged.LLM(make_model("llama"), chat_word_tokenizer(), **KNOBS)    # same seed: same weights, own model
    offline = llm.generate(PROMPTS, [dict(max_new_tokens=m, do_sample=False) for m in MAX_TOKENS])
    tok = chat_word_tokenizer()
    for (text, reason, n_out, n_in), out, prompt in zip(sequential, offline, PROMPTS):
        assert text == out.outputs[0].text
        assert n_out == len(out.outputs[0].token_ids)
        assert n_in == len(tok(prompt)["input_ids"])
        assert reason == {"stop": "stop", "length": "length"}[out.outputs[0].finish_reason]
    wait_idle(server[1])


def test_stream_equals_whole_and_usage(client):
    for prompt, m in zip(PROMPTS[:4], MAX_TOKENS[:4]):
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=m, temperature=0)
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=m, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_and_stop(client):
    with pytest.raises(openai.BadRequestError, match=r"n=2 .* temperature is 0: .* set temperature > 0"):
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, n=2)
    unset = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, n=4, seed=3)   # vLLM: T = 1
    assert len({c.text for c in unset.choices}) > 1
    n = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=1.0, n=3, seed=1)
    assert [c.index for c in n.choices] == [0, 1, 2] and n.usage.completion_tokens >= 3
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    words = r.choices[0].text.split()
    stop = words[3]
    cut = r.choices[0].text[:r.choices[0].text.index(stop)]
    s = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
    assert s.choices[0].text == cut and s.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=stop, stream=True))
    assert streamed == cut
    a = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=0.8, top_p=0.9,
                                  seed=7, extra_body={"top_k": 20})
    b = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=0.8, top_p=0.9,
                                  seed=7, extra_body={"top_k": 20})
    assert a.choices[0].text == b.choices[0].text          # seeded sampling reproduces


def test_chat(client):
    messages = [{"role": "system", "content": "w10 w11"}, {"role": "user", "content": "w12 w13 w14"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == 6          # "w10 w11 w12 w13 w14 w9" through the template
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0,
                                              stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == whole.choices[0].message.content
    llm = hf_paged.LLM(make_model("llama"), chat_word_tokenizer(), **KNOBS)
    out = llm.generate(["w10 w11 w12 w13 w14 w9"], max_new_tokens=9, do_sample=False)
    assert whole.choices[0].message.content == out[0].outputs[0].text


def test_byte_level_stream_never_breaks_a_character():
    """A byte-level tokenizer (one token per byte): every multi-byte character is split across tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    text = "héllo 😀 wörld, 中文 ok 🍕!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode())
    assert "\ufffd" in tok.decode(ids[:8])                 # the emoji's bytes really are split
    stream = TextStream(tok)
    deltas = [stream.add(t) for t in ids] + [stream.finish()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    stopped = TextStream(tok, stop=("😀",))
    assert "".join([stopped.add(t) for t in ids] + [stopped.finish()]) == "héllo " and stopped.stopped


def test_byte_level_server_stream_equals_whole():
    """Random bytes from the tiny model through a byte-level tokenizer: the streamed text equals the whole
    text even where the bytes do not form valid UTF-8."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    app = create_app(make_model("llama", seed=3), tok, served_model_name=MODEL, **KNOBS)
    with running(app) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        for prompt in ("é😀 ab", "中文 🍕", "xyz"):
            whole = c.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
            streamed = "".join(ch.choices[0].text for ch in c.completions.create(
                model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True))
            assert streamed == whole.choices[0].text


def test_disconnect_cancels_and_frees_blocks(server, monkeypatch):
    url, app = server
    engine = app.state.engine
    step = engine.step
    # Each step takes at least 20 ms, so a 300-token request outlives the clients below on any machine.
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.02), step())[1])
    before = app.state.worker.stats().requests_cancelled
    body = {"model": MODEL, "prompt": "w3 w4 w5", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(line.startswith("data: {") for line in got)
    wait_cancelled(app, before + 1, "the streamed request")
    with pytest.raises(httpx.ReadTimeout):                  # a non-streamed request whose client gives up
        httpx.post(url + "/v1/completions", json=body, timeout=1.0)
    wait_cancelled(app, before + 2, "the non-streamed request")
    stats = wait_idle(app)
    assert stats.blocks_used == 0
    app.state.engine.check_invariants()


def _burst(url: str, bodies: list[dict], gate: threading.Event) -> list[tuple[int, str | None, bytes]]:
    """POST every body at once, streamed, while the engine's steps wait on ``gate`` (so nothing finishes
    before all are submitted); once every status line is in, open the gate and read every answer.
    Returns (status, Retry-After, body) per request."""
    statuses: list = [None] * len(bodies)
    read_on = threading.Event()

    def one(i):
        with httpx.stream("POST", url + "/v1/completions", json=bodies[i], timeout=HANG_S) as r:
            statuses[i] = r.status_code
            if r.status_code == 200:
                read_on.wait(HANG_S)
            return r.status_code, r.headers.get("retry-after"), r.read()

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(one, i) for i in range(len(bodies))]
        wait_for(lambda: all(s is not None for s in statuses), "every request of the burst being answered")
        gate.set()
        read_on.set()
        return [f.result() for f in futures]


def test_max_queue_counts_what_waits_beyond_max_num_seqs():
    """max_num_seqs 8 + max_queue 16: a burst of 24 streams is served whole, a burst of 25 turns exactly
    one away (503, Retry-After); a request of n sequences takes n places."""
    app = create_app(make_model("llama"), chat_word_tokenizer(), served_model_name=MODEL, num_blocks=96, max_num_seqs=8,
                     max_num_batched_tokens=64, block_size=16, max_queue=16)
    engine, worker = app.state.engine, app.state.worker
    gate = threading.Event()
    step = engine.step
    engine.step = lambda: (gate.wait(HANG_S), step())[1]
    body = {"model": MODEL, "prompt": "w3 w4", "max_tokens": 3, "temperature": 0, "stream": True}
    with running(app) as url:
        for count, refused in ((24, 0), (25, 1)):
            gate.clear()
            answers = _burst(url, [body] * count, gate)
            assert sorted(a[0] for a in answers) == [200] * (count - refused) + [503] * refused
            assert all(b"data: [DONE]" in a[2] for a in answers if a[0] == 200)
            for status, retry, text in answers:
                if status == 503:
                    assert retry == "1" and json.loads(text)["error"]["code"] == "queue_full"
            wait_for(lambda: worker.in_flight == 0, "the burst leaving the worker's count")
        gate.clear()
        sampled = {**body, "n": 3, "temperature": 1.0, "seed": 1}
        answers = _burst(url, [sampled] * 8 + [body], gate)        # 8 x 3 sequences fill 24 places
        assert sorted(a[0] for a in answers) == [200] * 8 + [503]
        wait_idle(app)


def test_bad_requests_answer_400(server, client):
    url, _ = server
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    cases = [dict(extra_body={"top_k": -2}), dict(max_tokens=10**6), dict(temperature=-1.0), dict(logprobs=21),
             dict(top_p=0.0), dict(n=0), dict(frequency_penalty=2.5), dict(extra_body={"use_beam_search": True})]
    for case in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="w3 w4", **{"max_tokens": 4, **case})
        assert err.value.body["message"] and "Traceback" not in err.value.body["message"], case
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs=true"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w3"}], top_logprobs=2)
    ignored = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w3"}], max_tokens=2,
                                             temperature=0, extra_body={"bogus": 1})     # vLLM logs and ignores it
    assert ignored.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="token id 1000000 is outside the vocabulary"):
        client.completions.create(model=MODEL, prompt=[3, 10**6], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="w3", max_tokens=2)
    r = httpx.post(url + "/v1/completions", content=b"x" * (5 * 2**20))
    assert r.status_code == 413
    assert httpx.get(url + "/nope").json()["error"]["code"] == "not_found"


def test_metrics(server, client):
    url, _ = server
    client.completions.create(model=MODEL, prompt="w3 w4 w5", max_tokens=5, temperature=0)
    text = httpx.get(url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:time_per_output_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_success_total"):
        assert name in text, name
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["vllm:prompt_tokens_total"] >= 3 and values["vllm:generation_tokens_total"] >= 5


def test_api_key():
    app = create_app(make_model("llama"), chat_word_tokenizer(), served_model_name=MODEL, api_key="s3cret", **KNOBS)
    with running(app) as url:
        assert httpx.get(url + "/health").status_code == 200
        r = httpx.get(url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert good.models.list().data[0].id == MODEL
        assert good.completions.create(model=MODEL, prompt="w3", max_tokens=2).choices[0].text


SERVE_FLAGS = {"host", "port", "api_key", "served_model_name", "dtype", "quantization", "gpu_memory_utilization",
               "max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size", "enable_prefix_caching",
               "kv_cache_dtype", "kv_cache_memory_bytes", "max_logprobs", "max_queue", "shutdown_timeout", "max_body_bytes",
               "generation_config", "enable_auto_tool_choice", "tool_call_parser", "reasoning_parser",
               "trust_remote_code", "log_level"}


def test_cli_flags_take_names_and_defaults_from_the_configs():
    """Each ``serve`` flag is --<field> of EngineConfig or ServeConfig (vLLM's names) with its default."""
    parser = build_parser()
    args = vars(parser.parse_args(["serve", "m"]))
    assert set(args) == SERVE_FLAGS | {"command", "model"}
    defaults = {f.name: f.default for cls in (EngineConfig, ServeConfig) for f in dataclasses.fields(cls)}
    assert {name: args[name] for name in SERVE_FLAGS} == {name: defaults[name] for name in SERVE_FLAGS}
    given = vars(parser.parse_args(["serve", "m", "--no-enable-prefix-caching", "--kv-cache-memory-bytes", "256M",
                                    "--max-body-bytes", "1GiB", "--max-num-seqs", "3", "--dtype", "half",
                                    "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                    "--reasoning-parser", "qwen3"]))
    assert (given["enable_prefix_caching"], given["kv_cache_memory_bytes"], given["max_body_bytes"],
            given["max_num_seqs"], given["dtype"], given["enable_auto_tool_choice"], given["tool_call_parser"],
            given["reasoning_parser"]) == (False, 256 * 2**20, 2**30, 3, "half", True, "hermes", "qwen3")
    for bad in (["--max-num-seqs", "0"], ["--kv-cache-memory-bytes", "lots"], ["--dtype", "int3"],
                ["--reasoning-parser", "granite"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "m", *bad])


@pytest.mark.parametrize("argv, says", [
    (["--port", "70000"], "--port: must be a TCP port in 0..65535"),
    (["--port", "-1"], "--port: must be a TCP port in 0..65535"),
    (["--shutdown-timeout", "nan"], "shutdown_timeout must be a finite number"),
    (["--max-logprobs", "-1"], "max_logprobs must be an int >= 0"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in (0, 1]"),
])
def test_serve_refuses_bad_settings_in_one_line_before_loading(argv, says, capsys, monkeypatch):
    """A bad value exits 2 with one line naming it, before any model loads (the checkpoint is never read)."""
    from hf_paged import cli
    from hf_paged.integrations.server import loading
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) if argv[0] == "--port" else contextlib.nullcontext():
        assert cli.main(["serve", "smollm2", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_serve_names_a_broken_checkpoint_directory(tmp_path, capsys):
    from hf_paged import cli
    assert cli.main(["serve", str(tmp_path / "missing")]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err
    assert cli.main(["serve", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    assert cli.main(["serve", str(tmp_path)]) == 2
    assert "not a valid config.json" in capsys.readouterr().err
    folder = tmp_path / "no_tokenizer"
    make_model("llama").save_pretrained(folder)
    assert cli.main(["serve", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer in the checkpoint directory" in err and "Traceback" not in err


@pytest.mark.parametrize("text, value", [("1048576", 2**20), ("512k", 2**19), ("256M", 256 * 2**20),
                                         ("2GiB", 2 * 2**30), ("1.5gb", 3 * 2**29), ("1T", 2**40)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value
    assert parse_bytes(format_bytes(value)) == value


def test_parse_bytes_names_the_bad_value():
    assert format_bytes(AppConfig.max_body_bytes) == "4M"
    with pytest.raises(ValueError, match="not a byte size: '12x'"):
        parse_bytes("12x")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_real_server_chat_and_sigterm(tmp_path):
    """``python -m hf_paged serve smollm2``: a chat completion through the real chat template, then SIGTERM
    while a request streams: the process stops accepting, aborts it a second before --shutdown-timeout (it ends
    with finish_reason "abort" and [DONE]), exits 0."""
    pytest.importorskip("gguf")
    from hf_paged.integrations.smollm2 import gguf_path

    try:
        gguf_path()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        pytest.skip(str(exc))
    port = _free_port()
    log = open(tmp_path / "server.log", "w+")
    # 256 MiB hold ~5,800 tokens of SmolLM2's fp32 KV: the 4,000-token request below fits (one that
    # cannot fit fails at once, and nothing would be in flight at SIGTERM).
    proc = subprocess.Popen([sys.executable, "-m", "hf_paged", "serve", "smollm2", "--port", str(port),
                             "--shutdown-timeout", "3", "--kv-cache-memory-bytes", "256M", "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://{HOST}:{port}"

    def up() -> bool:
        assert proc.poll() is None, open(tmp_path / "server.log").read()
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url + "/health", timeout=1).status_code == 200
        return False

    try:
        wait_for(up, "the server coming up (its first use converts the GGUF)", timeout=600)
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=HANG_S)
        messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        whole = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0)
        assert "Paris" in whole.choices[0].message.content
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=12, temperature=0, stream=True) if ch.choices)
        assert streamed == whole.choices[0].message.content
        body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 4000, "stream": True,
                "ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=HANG_S) as r:
            lines = r.iter_lines()
            first = json.loads(next(lines).removeprefix("data: "))
            assert first["choices"][0]["finish_reason"] is None          # it runs
            proc.send_signal(signal.SIGTERM)
            rest, cut = [], False
            try:
                rest.extend(lines)                         # ends when the server cancels the request
            except httpx.RemoteProtocolError:              # uvicorn ended the response mid-body
                cut = True
        try:
            status = proc.wait(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"hung: the server did not exit within {HANG_S} s of SIGTERM (--shutdown-timeout 3)")
        assert status == 0, open(tmp_path / "server.log").read()
        events = [json.loads(line.removeprefix("data: ")) for line in rest if line.startswith("data: {")]
        assert not any("error" in e for e in events), events
        reasons = {choice["finish_reason"] for e in events for choice in e["choices"]}
        assert "abort" in reasons and reasons <= {None, "abort"}, reasons     # aborted by the shutdown, not cut
        assert not cut and "data: [DONE]" in rest         # it ends as a stream ends (uvicorn cut it before)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_auto_dtype_says_what_vllm_would_do(monkeypatch):
    """--dtype auto keeps a float32 checkpoint in float32; on a CPU with bf16 instructions the server says that
    vLLM's auto would run bfloat16 there, and how to ask for it. Nothing to say otherwise."""
    import torch

    from hf_paged.engine import cpu_bf16
    from hf_paged.integrations.server.main import auto_dtype_note
    fp32, bf16 = make_model("llama"), make_model("llama", dtype=torch.bfloat16)
    monkeypatch.setattr(cpu_bf16, "cpu_flags", lambda cpuinfo="/proc/cpuinfo": {"avx512f", "amx_bf16"})
    note = auto_dtype_note("auto", fp32)
    assert note is not None and "--dtype bfloat16" in note and "float32" in note
    assert auto_dtype_note("float32", fp32) is None and auto_dtype_note("auto", bf16) is None
    monkeypatch.setattr(cpu_bf16, "cpu_flags", lambda cpuinfo="/proc/cpuinfo": {"avx2", "fma"})
    assert auto_dtype_note("auto", fp32) is None


def test_a_pool_smaller_than_the_context_lowers_max_model_len_or_is_refused():
    """Requests without max_tokens run to the end of the context: a pool that cannot hold one would fail them
    all. The model's context is lowered to what the pool holds (logged); an asked --max-model-len is refused at
    start, naming the knobs (as vLLM refuses)."""
    model = make_model("llama")
    app = create_app(model, chat_word_tokenizer(), served_model_name=MODEL, num_blocks=8, block_size=16)
    assert app.state.engine.max_model_len == 128            # 8 x 16, the model's 512 would not fit
    with pytest.raises(ValueError, match=r"--max-model-len 512 .* holds 8 blocks x 16 tokens = 128 tokens.*"
                                         r"--kv-cache-memory-bytes.*at most 128"):
        create_app(model, chat_word_tokenizer(), num_blocks=8, block_size=16, max_model_len=512)
    with running(app) as url:
        metrics = httpx.get(url + "/metrics").text             # the pool's size before any request
        assert re.search(r"^hf_paged:kv_blocks_total\{[^}]*\} 8\.0$", metrics, re.M), metrics
        r = httpx.post(url + "/v1/chat/completions", timeout=HANG_S,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "w5 w6"}], "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_n_beyond_max_num_seqs_runs_as_several_engine_requests(server):
    """As vLLM runs n as child requests: n beyond max_num_seqs is served (it was a 400), sequence j still seeded
    seed + j, so choice j equals a request of n=1 seeded seed + j; whole and streamed alike."""
    url, app = server
    n = KNOBS["max_num_seqs"] + 3
    body = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 5, "n": n, "temperature": 1, "seed": 40,
            "ignore_eos": True}
    whole = httpx.post(url + "/v1/completions", json=body, timeout=HANG_S).json()
    texts = [c["text"] for c in sorted(whole["choices"], key=lambda c: c["index"])]
    assert len(texts) == n and whole["usage"]["completion_tokens"] == 5 * n and len(set(texts)) > 1
    alone = [httpx.post(url + "/v1/completions", json={**body, "n": 1, "seed": 40 + j}, timeout=HANG_S).json()
             for j in range(n)]
    assert texts == [a["choices"][0]["text"] for a in alone]
    streamed = [""] * n
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=HANG_S) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed[choice["index"]] += choice["text"]
    assert streamed == texts
    wait_idle(app)


def test_tokenizing_runs_off_the_event_loop(server, monkeypatch):
    """A slow tokenization (a multi-MB prompt, a long chat template) does not stall the other clients: /health
    answers meanwhile (it took as long as the tokenization before)."""
    from hf_paged.integrations.server import intake
    url, _ = server
    tokenize, started = intake.tokenize, threading.Event()

    def slow(state, text, special=True):
        started.set()
        time.sleep(1.5)
        return tokenize(state, text, special)

    monkeypatch.setattr(intake, "tokenize", slow)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, url + "/v1/completions", timeout=HANG_S,
                             json={"model": MODEL, "prompt": "w5 w6", "max_tokens": 2, "temperature": 0})
        assert started.wait(HANG_S)
        start = time.perf_counter()
        assert httpx.get(url + "/health", timeout=HANG_S).status_code == 200
        assert time.perf_counter() - start < 1.0
        assert answer.result().status_code == 200


def test_serve_stops_with_status_1_when_the_engine_fails(monkeypatch):
    """As vLLM's server, which exits when its engine dies (a supervisor restarts it): the requests running get a
    500, later ones a 500 saying the server stops, and ``serve`` returns 1 (the process kept answering 503)."""
    from hf_paged.integrations.server import main as server_main
    monkeypatch.setattr(server_main, "serving_app", lambda model, config, **knobs: create_app(
        make_model("llama"), chat_word_tokenizer(), served_model_name=MODEL, **knobs))
    seen = {}

    def run(self, sockets=None):            # stands for uvicorn's loop: one request, then the engine fails
        worker = self.config.app.state.worker
        worker.start()
        worker.engine.step = lambda: (_ for _ in ()).throw(RuntimeError("device lost"))
        done = threading.Event()
        params = worker.engine.config
        from hf_paged.engine.settings import resolve_generation
        from hf_paged.integrations.server.worker import EngineFailed, Handle
        handle = Handle([5, 6, 7], resolve_generation(None, max_new_tokens=3, do_sample=False),
                        lambda item: (seen.setdefault("item", item), done.set()) if isinstance(item, tuple) else None)
        worker.submit(handle)
        assert done.wait(HANG_S) and params is not None
        wait_for(lambda: self.should_exit, "the server being told to stop")
        with pytest.raises(EngineFailed, match="the engine failed"):
            worker.submit(Handle([5], handle.params, lambda item: None))
        assert worker.in_flight == 0
        worker.shutdown(5)

    monkeypatch.setattr(uvicorn.Server, "run", run)
    assert server_main.serve("tiny-model", log_level="warning", num_blocks=32) == 1
    assert seen["item"][0] == "fault"
