"""The APIs the server answers through chat completions, as vLLM serves them: Anthropic's Messages
(``/v1/messages``, ``/v1/messages/count_tokens``), OpenAI's Responses (``/v1/responses``, stateless) and
SageMaker's ``/invocations``. Each answer is checked against the chat completion the request converts to
(greedy, the same tiny model), then the official ``anthropic`` and ``openai`` clients read them from a live server.
Structured output through both (a real tokenizer) is in test_structured_output.py.
"""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from hf_paged.integrations.server import create_app  # noqa: E402
from hf_paged.integrations.server.anthropic_api import stop_reason, system_first  # noqa: E402
from live_server import running, sse  # noqa: E402
from tiny_models import CHAT_TEMPLATE, chat_word_tokenizer, make_model  # noqa: E402

MODEL = "tiny"
KNOBS = dict(num_blocks=32, max_num_seqs=6, max_num_batched_tokens=64, block_size=16)
GREEDY = {"temperature": 0}
# a template that takes a system message only first (as Qwen's: raise_exception elsewhere)
SYSTEM_FIRST = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
                "{{ raise_exception('system first') }}{% endif %}{{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}w9{% endif %}")


@pytest.fixture(scope="module")
def client():
    app = create_app(make_model("llama"), chat_word_tokenizer(), served_model_name=MODEL, **KNOBS)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def chat(client, messages, **fields) -> dict:
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, **GREEDY, **fields})
    assert r.status_code == 200, r.json()
    return r.json()


# --- Anthropic's Messages ---

def test_messages_answer_the_converted_chat(client):
    body = {"model": MODEL, "max_tokens": 6, "system": "w5 w6", **GREEDY,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "w10"}, {"type": "text", "text": "w11"}]},
                         {"role": "assistant", "content": "w12"}, {"role": "user", "content": "w13"}]}
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.json()
    got = r.json()
    expected = chat(client, [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": "w10\nw11"},
                             {"role": "assistant", "content": "w12"}, {"role": "user", "content": "w13"}], max_tokens=6)
    assert got["content"] == [{"type": "text", "text": expected["choices"][0]["message"]["content"]}]
    assert got["type"] == "message" and got["role"] == "assistant" and got["id"].startswith("msg_")
    assert (got["stop_reason"], got["stop_sequence"]) == ("max_tokens", None)
    assert got["usage"] == {"input_tokens": expected["usage"]["prompt_tokens"], "output_tokens": 6}


def test_messages_stop_sequence(client):
    base = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "w10 w11"}], **GREEDY}
    text = client.post("/v1/messages", json=base).json()["content"][0]["text"]
    stop = text.split()[2]                           # the third word: the answer ends before it
    got = client.post("/v1/messages", json={**base, "stop_sequences": [" " + stop]}).json()
    assert got["content"][0]["text"] == " " + " ".join(text.split()[:2])
    assert (got["stop_reason"], got["stop_sequence"]) == ("stop_sequence", " " + stop)


def test_stop_reasons():
    assert stop_reason("length", None) == ("max_tokens", None)
    assert stop_reason("stop", None) == ("end_turn", None)          # EOS
    assert stop_reason("stop", 7) == ("end_turn", None)             # a stop token id is not a stop sequence
    assert stop_reason("stop", "w3") == ("stop_sequence", "w3")
    assert stop_reason("abort", None) == (None, None)


def test_messages_stream_events(client):
    body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "w10 w11"}], **GREEDY}
    whole = client.post("/v1/messages", json=body).json()
    r = client.post("/v1/messages", json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    names = [e for e, _ in events]
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["usage"] == {"input_tokens": whole["usage"]["input_tokens"], "output_tokens": 0}
    assert "".join(d["delta"]["text"] for _, d in events[2:-3]) == whole["content"][0]["text"]
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None} and delta["usage"] == whole["usage"]


def test_system_blocks_billing_header_and_count_tokens(client):
    """Claude Code's per-request billing block is left out; count_tokens counts what /v1/messages runs."""
    messages = [{"role": "user", "content": "w10 w11"}]
    plain = client.post("/v1/messages/count_tokens", json={"model": MODEL, "system": "w5", "messages": messages})
    blocks = client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": messages, "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc"},
        {"type": "text", "text": "w5", "cache_control": {"type": "ephemeral"}}]})
    tokens = client.post("/tokenize", json={"messages": [{"role": "system", "content": "w5"}, *messages]}).json()
    assert plain.json() == blocks.json() == {"input_tokens": tokens["count"],
                                             "context_management": {"original_input_tokens": tokens["count"]}}


def test_inline_system_messages_kept_or_merged():
    assert not system_first(CHAT_TEMPLATE) and system_first(SYSTEM_FIRST)
    tok = chat_word_tokenizer()
    tok.chat_template = SYSTEM_FIRST
    body = {"model": MODEL, "system": "w5 ", "messages": [{"role": "user", "content": "w10"},
                                                          {"role": "system", "content": "w6"},
                                                          {"role": "user", "content": "w11"}]}
    app = create_app(make_model("llama"), tok, served_model_name=MODEL, **KNOBS)
    with TestClient(app) as c:
        merged = c.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
        expected = c.post("/tokenize", json={"messages": [{"role": "system", "content": "w5 w6"},
                                                          {"role": "user", "content": "w10"},
                                                          {"role": "user", "content": "w11"}]}).json()["count"]
        assert merged == expected
    app = create_app(make_model("llama"), chat_word_tokenizer(), served_model_name=MODEL, **KNOBS)
    with TestClient(app) as c:              # a template that takes them anywhere: in place
        kept = c.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
        assert kept == c.post("/tokenize", json={"messages": [{"role": "system", "content": "w5 "}, *[
            {"role": m["role"], "content": m["content"]} for m in body["messages"]]]}).json()["count"]


@pytest.mark.parametrize("body, status, words", [
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url"}}]}]},
     400, "text-only"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "server_tool_use", "id": "t"}]}]},
     400, "server and MCP tools"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "w3"}], "tools": [{"name": "f", "input_schema": {}}]},
     400, "requires --enable-auto-tool-choice"),          # tool calling needs the flags (test_tool_calls.py)
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "w3"}],
      "thinking": {"type": "enabled", "budget_tokens": 2048}}, 400, "less than max_tokens"),   # (vLLM's check first)
    ({"messages": [{"role": "user", "content": "w3"}]}, 400, "max_tokens"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "w3"}]}, 400, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, 400, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "w3"}], "model": "other"}, 404, "other"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "w3"}], "output_config": {"format": "json"}}, 400,
     "output_config.format"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "w3"}], "tool_choice": {"type": "maybe"}}, 400,
     "tool_choice.type"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "w3"}], "stop_sequences": [""]}, 400, "stop"),
])
def test_messages_refusals_in_anthropic_errors(client, body, status, words):
    r = client.post("/v1/messages", json={"model": MODEL, **body})
    assert r.status_code == status
    error = r.json()
    assert error["type"] == "error" and words in error["error"]["message"], error
    assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_thinking_disabled_reaches_the_template():
    """thinking disabled is vLLM's reasoning_effort "none": a template that reads enable_thinking sees it off."""
    tok = chat_word_tokenizer()
    tok.chat_template = "{% if enable_thinking is defined and not enable_thinking %}w4 {% endif %}" + CHAT_TEMPLATE
    app = create_app(make_model("llama"), tok, served_model_name=MODEL, **KNOBS)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w10"}]}
    with TestClient(app) as c:
        plain = c.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
        off = c.post("/v1/messages/count_tokens", json={**body, "thinking": {"type": "disabled"}}).json()
        assert off["input_tokens"] == plain + 1


def test_empty_texts_and_billing_headers_leave_no_turn():
    """As vLLM's conversion: empty text blocks are dropped (a user turn left without text too, an inline system
    message without text gives none), and Claude Code's billing header goes from inline system strings too."""
    tok = chat_word_tokenizer()
    tok.chat_template = ROLE_TEMPLATE                      # each role is a token: turns are counted
    app = create_app(make_model("llama"), tok, served_model_name=MODEL, **KNOBS)
    user = {"role": "user", "content": "w10"}
    with TestClient(app) as c:
        def count(messages):
            return c.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": messages}).json()["input_tokens"]
        base = count([user])
        assert count([{"role": "user", "content": [{"type": "text", "text": ""}]}, user]) == base
        assert count([user, {"role": "system", "content": ""}]) == base
        assert count([user, {"role": "system", "content": "x-anthropic-billing-header: cch=1"}]) == base
        assert count([user, {"role": "system", "content": [{"type": "text", "text": ""}]}]) == base
        assert count([{"role": "user", "content": [{"type": "text", "text": "w10"}, {"type": "text", "text": ""}]}]) == base


def test_thinking_disabled_and_earlier_thinking_blocks_accepted(client):
    r = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 3, "thinking": {"type": "disabled"}, **GREEDY,
                                          "messages": [{"role": "user", "content": "w10"},
                                                       {"role": "assistant", "content": [
                                                           {"type": "thinking", "thinking": "w4", "signature": "s"},
                                                           {"type": "text", "text": "w12"}]},
                                                       {"role": "user", "content": "w13"}]})
    assert r.status_code == 200, r.json()
    expected = chat(client, [{"role": "user", "content": "w10"}, {"role": "assistant", "content": "w12"},
                             {"role": "user", "content": "w13"}], max_tokens=3)
    assert r.json()["content"][0]["text"] == expected["choices"][0]["message"]["content"]


def test_api_key_also_as_x_api_key():
    app = create_app(make_model("llama"), chat_word_tokenizer(), served_model_name=MODEL, api_key="secret", **KNOBS)
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "w10"}]}
    with TestClient(app) as c:
        assert c.post("/v1/messages", json=body).status_code == 401
        assert c.post("/v1/messages", json=body, headers={"x-api-key": "wrong"}).status_code == 401
        assert c.post("/v1/messages", json=body, headers={"x-api-key": "secret"}).status_code == 200
        assert c.post("/v1/messages", json=body, headers={"Authorization": "Bearer secret"}).status_code == 200


# --- OpenAI's Responses ---

def test_responses_answer_the_converted_chat(client):
    got = client.post("/v1/responses", json={"model": MODEL, "instructions": "w5", "max_output_tokens": 6, **GREEDY,
                                             "input": [{"role": "user", "content": [{"type": "input_text", "text": "w10"}]},
                                                       {"type": "message", "role": "assistant",
                                                        "content": [{"type": "output_text", "text": "w12"}]},
                                                       {"type": "reasoning", "summary": []},
                                                       {"role": "user", "content": "w13"}]})
    assert got.status_code == 200, got.json()
    got = got.json()
    expected = chat(client, [{"role": "system", "content": "w5"}, {"role": "user", "content": "w10"},
                             {"role": "assistant", "content": "w12"}, {"role": "user", "content": "w13"}], max_tokens=6)
    text = expected["choices"][0]["message"]["content"]
    assert got["object"] == "response" and got["id"].startswith("resp_") and got["model"] == MODEL
    assert got["status"] == "incomplete" and got["incomplete_details"] == {"reason": "max_output_tokens"}
    [item] = got["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}]
    assert got["usage"]["input_tokens"] == expected["usage"]["prompt_tokens"] and got["usage"]["output_tokens"] == 6
    assert got["usage"]["total_tokens"] == expected["usage"]["total_tokens"]
    assert got["max_output_tokens"] == 6 and got["temperature"] == 0 and got["instructions"] == "w5"
    assert got["top_p"] == 1.0 and got["tool_choice"] == "none" and got["tools"] == [] and got["store"] is False


ROLE_TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] or '' }} {% endfor %}w9"


@pytest.mark.parametrize("items, chat_messages", [
    ([{"role": "user", "content": "w10"}, {"type": "reasoning", "summary": []}, {"role": "user", "content": "w11"}],
     [{"role": "user", "content": "w10"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "w11"}]),
    ([{"role": "user", "content": "w10"}, {"type": "reasoning", "summary": []},
      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "w12"}]},
      {"role": "user", "content": "w11"}],
     [{"role": "user", "content": "w10"}, {"role": "assistant", "content": "w12"}, {"role": "user", "content": "w11"}]),
    ([{"role": "user", "content": "w10"}, {"role": "assistant", "content": "w12"}, {"type": "reasoning", "summary": []},
      {"type": "reasoning", "summary": []}, {"role": "user", "content": "w11"}],
     [{"role": "user", "content": "w10"}, {"role": "assistant", "content": "w12"}, {"role": "assistant", "content": ""},
      {"role": "user", "content": "w11"}]),
])
def test_responses_reasoning_items_are_assistant_turns(items, chat_messages):
    """vLLM's rule: a reasoning item folds into the assistant message before it, else opens an assistant turn
    that the next assistant message fills (the template sees the turn even when it stays empty)."""
    tok = chat_word_tokenizer()
    tok.chat_template = ROLE_TEMPLATE                      # each role is a token ("<pad>"): turns are counted
    app = create_app(make_model("llama"), tok, served_model_name=MODEL, **KNOBS)
    with TestClient(app) as c:
        got = c.post("/v1/responses", json={"model": MODEL, "input": items, "max_output_tokens": 1}).json()
        expected = c.post("/tokenize", json={"messages": chat_messages}).json()
        assert got["usage"]["input_tokens"] == expected["count"], (got, expected)


def test_responses_text_input_logprobs_and_completed_status(client):
    body = {"model": MODEL, "input": "w10 w11", "max_output_tokens": 4, **GREEDY,
            "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    got = client.post("/v1/responses", json=body).json()
    expected = chat(client, [{"role": "user", "content": "w10 w11"}], max_tokens=4, logprobs=True, top_logprobs=2)
    part = got["output"][0]["content"][0]
    assert part["text"] == expected["choices"][0]["message"]["content"]
    assert part["logprobs"] == expected["choices"][0]["logprobs"]["content"] and got["top_logprobs"] == 2
    words = part["text"].split()
    stopped = client.post("/v1/responses", json={**body, "stop": [" " + words[1]]}).json()
    assert stopped["status"] == "completed" and stopped["incomplete_details"] is None
    assert stopped["output"][0]["content"][0]["text"] == " " + words[0]
    # streamed, vLLM's shapes: delta entries without bytes (the delta event's type), the text's done event [],
    # the part whole
    events = sse(client.post("/v1/responses", json={**body, "stream": True}).text)
    deltas = [e for n, d in events if n == "response.output_text.delta" for e in d["logprobs"]]
    assert deltas == [{"token": e["token"], "logprob": e["logprob"], "top_logprobs": [
        {"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]} for e in part["logprobs"]]
    assert [d["logprobs"] for n, d in events if n == "response.output_text.done"] == [[]]
    assert [d["part"]["logprobs"] for n, d in events if n == "response.content_part.done"] == [part["logprobs"]]


def test_responses_continue_a_partial_answer(client):
    """A last assistant item that is in_progress / incomplete is continued (vLLM's rule)."""
    items = [{"role": "user", "content": "w10"}, {"type": "message", "role": "assistant", "status": "incomplete",
                                                  "content": [{"type": "output_text", "text": "w12"}]}]
    got = client.post("/v1/responses", json={"model": MODEL, "input": items, "max_output_tokens": 3, **GREEDY}).json()
    expected = chat(client, [{"role": "user", "content": "w10"}, {"role": "assistant", "content": "w12"}], max_tokens=3,
                    add_generation_prompt=False, continue_final_message=True)
    assert got["output"][0]["content"][0]["text"] == expected["choices"][0]["message"]["content"]


def test_responses_stream_events(client):
    body = {"model": MODEL, "input": "w10 w11", "max_output_tokens": 5, **GREEDY}
    whole = client.post("/v1/responses", json=body).json()
    events = sse(client.post("/v1/responses", json={**body, "stream": True}).text)
    names = [e for e, _ in events]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert all(d["type"] == name for name, d in events)
    text = whole["output"][0]["content"][0]["text"]
    assert "".join(d["delta"] for _, d in events[4:-4]) == text == events[-4][1]["text"]
    final = events[-1][1]["response"]
    assert final["status"] == "incomplete" and final["output"][0]["content"][0]["text"] == text
    assert final["usage"] == whole["usage"] and events[0][1]["response"]["status"] == "in_progress"


@pytest.mark.parametrize("body, status, param", [
    ({"input": "w3", "previous_response_id": "resp_x"}, 404, "previous_response_id"),
    ({"input": "w3", "background": True}, 400, "background"),
    ({"input": "w3", "background": True, "store": False}, 400, "background"),
    ({"input": []}, 400, "input"),
    ({"input": "w3", "tools": [{"type": "function", "name": "f"}]}, 400, "tool_choice"),   # auto: needs the flags
    ({"input": "w3", "tools": [{"type": "web_search"}], "tool_choice": "none"}, 400, "tools.0"),
    ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": "w3"}]}, 400, "input.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input.0.content.0"),
    ({"input": "w3", "text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "w3"}}, 400,
     "structured_outputs"),
    ({"input": "w3", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "w3", "model": "other"}, 404, "model"),
    ({"input": "w3", "max_output_tokens": 10**6}, 400, "max_output_tokens"),
    ({"input": " ".join(["w3"] * 600), "max_output_tokens": 5}, 400, "input"),
    ({"input": [{"role": "tool", "content": "w3"}]}, 400, "input.0"),
])
def test_responses_refusals(client, body, status, param):
    r = client.post("/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == status and r.json()["error"]["param"] == param, r.json()


def test_truncation_auto_leaves_room_for_a_token(client):
    """vLLM's truncate_prompt_tokens -1 (the Responses API's truncation "auto"): the context less one token where
    new tokens are asked, the whole context for an echo of max_tokens 0 (lm-eval's loglikelihood windows)."""
    context = client.get("/v1/models").json()["data"][0]["max_model_len"]
    long = " ".join(f"w{3 + i % 200}" for i in range(context + 40))
    got = client.post("/v1/responses", json={"model": MODEL, "input": long, "max_output_tokens": 5, **GREEDY,
                                             "truncation": "auto"})
    assert got.status_code == 200, got.json()
    got = got.json()
    assert got["usage"]["input_tokens"] == context - 1 and got["usage"]["output_tokens"] == 1
    assert got["status"] == "incomplete"
    r = client.post("/v1/responses", json={"model": MODEL, "input": long, "max_output_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_too_long"
    r = chat(client, [{"role": "user", "content": long}], max_tokens=5, truncate_prompt_tokens=-1)
    assert r["usage"]["prompt_tokens"] == context - 1 and r["choices"][0]["finish_reason"] == "length"
    echo = client.post("/v1/completions", json={"model": MODEL, "prompt": long, "max_tokens": 0, "echo": True,
                                                "truncate_prompt_tokens": -1}).json()
    assert echo["usage"]["prompt_tokens"] == context


def test_an_empty_answer_has_no_part_or_block(client):
    """An answer cut to no text (its first word is a stop string) has vLLM's shapes: no output_text part (whole)
    and no item events (streamed) in the Responses API; one empty text block whole and none streamed in Anthropic's."""
    first = client.post("/v1/responses", json={"model": MODEL, "input": "w10", "max_output_tokens": 2,
                                               **GREEDY}).json()["output"][0]["content"][0]["text"].split()[0]
    body = {"model": MODEL, "input": "w10", "max_output_tokens": 2, "stop": [f" {first}"], **GREEDY}
    whole = client.post("/v1/responses", json=body).json()
    assert whole["status"] == "completed" and whole["output"][0]["content"] == []
    events = sse(client.post("/v1/responses", json={**body, "stream": True}).text)
    assert [e for e, _ in events] == ["response.created", "response.in_progress", "response.completed"]
    assert events[-1][1]["response"]["output"] == []
    messages = {"model": MODEL, "max_tokens": 2, "stop_sequences": [f" {first}"], **GREEDY,
                "messages": [{"role": "user", "content": "w10"}]}
    got = client.post("/v1/messages", json=messages).json()
    assert got["content"] == [{"type": "text", "text": ""}] and got["stop_reason"] == "stop_sequence"
    names = [e for e, _ in sse(client.post("/v1/messages", json={**messages, "stream": True}).text)]
    assert names == ["message_start", "message_delta", "message_stop"]


def test_responses_report_what_runs_and_what_was_cached(client):
    context = client.get("/v1/models").json()["data"][0]["max_model_len"]
    prompt = " ".join(f"w{20 + i}" for i in range(40))              # more than two blocks of 16
    first = client.post("/v1/responses", json={"model": MODEL, "input": prompt, **GREEDY}).json()
    assert first["max_output_tokens"] == context - first["usage"]["input_tokens"]    # the room the prompt leaves
    again = client.post("/v1/responses", json={"model": MODEL, "input": prompt, "max_output_tokens": 2, **GREEDY}).json()
    assert again["max_output_tokens"] == 2
    assert again["usage"]["input_tokens_details"]["cached_tokens"] >= 32      # the full blocks, from the prefix cache


def test_responses_are_not_stored(client):
    for r in (client.get("/v1/responses/resp_abc"), client.post("/v1/responses/resp_abc/cancel")):
        assert r.status_code == 404 and r.json()["error"]["message"] == "Response with id 'resp_abc' not found."


# --- tools with tool_choice "none": the template sees them, the answer is text (vLLM's, all three APIs) ---

TOOL_TEMPLATE = ("{% for t in tools or [] %}{{ t['function']['name'] }} {% endfor %}"
                 "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w9{% endif %}")


def test_tools_with_tool_choice_none_reach_the_template():
    tok = chat_word_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    tool = {"type": "function", "function": {"name": "w7", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "w10 w11"}]
    app = create_app(make_model("llama"), tok, served_model_name=MODEL, **KNOBS)
    with TestClient(app) as c:
        with_tool = chat(c, messages, max_tokens=3, tools=[tool], tool_choice="none")
        assert with_tool["usage"]["prompt_tokens"] == 4                     # w7 w10 w11 w9
        assert with_tool["choices"][0]["message"]["content"] != ""
        counted = c.post("/tokenize", json={"messages": messages, "tools": [tool]}).json()
        assert counted["tokens"] == [7, 10, 11, 9]
        for choice in ("auto", "required", None):      # without --enable-auto-tool-choice (test_tool_calls.py)
            r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "tools": [tool],
                                                     **({"tool_choice": choice} if choice else {})})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.json()
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "tools": [{"name": "w7"}],
                                                 "tool_choice": "none"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0"
        anthropic = c.post("/v1/messages", json={"model": MODEL, "max_tokens": 3, "messages": messages, **GREEDY,
                                                 "tools": [{"name": "w7", "input_schema": {"type": "object"}}],
                                                 "tool_choice": {"type": "none"}}).json()
        assert anthropic["usage"]["input_tokens"] == 4
        assert anthropic["content"][0]["text"] == with_tool["choices"][0]["message"]["content"]
        responses = c.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 3, "input": messages, **GREEDY,
                                                   "tools": [{"type": "function", "name": "w7", "parameters": {}}],
                                                   "tool_choice": "none"}).json()
        assert responses["usage"]["input_tokens"] == 4 and responses["tools"][0]["name"] == "w7"
        assert responses["output"][0]["content"][0]["text"] == anthropic["content"][0]["text"]


# --- SageMaker's /invocations ---

def test_invocations_route_by_body(client):
    messages = [{"role": "user", "content": "w10"}]
    got = client.post("/invocations", json={"messages": messages, "max_tokens": 3, **GREEDY}).json()
    assert got["object"] == "chat.completion"
    assert got["choices"][0]["message"] == chat(client, messages, max_tokens=3)["choices"][0]["message"]
    got = client.post("/invocations", json={"prompt": "w10 w11", "max_tokens": 3, **GREEDY}).json()
    assert got["object"] == "text_completion" and got["usage"]["completion_tokens"] == 3
    r = client.post("/invocations", json={"input": "w3"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


# --- the official clients ---

def test_official_clients_read_both_apis():
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    app = create_app(make_model("llama"), chat_word_tokenizer(), served_model_name=MODEL, api_key="k", **KNOBS)
    messages = [{"role": "user", "content": "w10 w11"}]
    with running(app) as url:
        a = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)
        m = a.messages.create(model=MODEL, max_tokens=4, messages=messages, extra_body=GREEDY)
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 4
        with a.messages.stream(model=MODEL, max_tokens=4, messages=messages, extra_body=GREEDY) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert streamed == final.content[0].text == m.content[0].text
        assert a.messages.count_tokens(model=MODEL, messages=messages).input_tokens == m.usage.input_tokens
        with pytest.raises(anthropic.BadRequestError, match="requires --enable-auto-tool-choice"):
            a.messages.create(model=MODEL, max_tokens=4, messages=messages, tools=[{"name": "f", "input_schema": {}}])
        o = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        r = o.responses.create(model=MODEL, input="w10 w11", max_output_tokens=4, temperature=0)
        assert r.output_text == m.content[0].text and r.status == "incomplete"
        assert r.incomplete_details.reason == "max_output_tokens"
        with o.responses.stream(model=MODEL, input="w10 w11", max_output_tokens=4, temperature=0) as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            final = stream.get_final_response()
        assert "".join(deltas) == final.output_text == r.output_text
        with pytest.raises(openai.NotFoundError):
            o.responses.retrieve("resp_x")
