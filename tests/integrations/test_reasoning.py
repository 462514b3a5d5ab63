"""Reasoning parsers (``--reasoning-parser deepseek_r1|qwen3``): the thinking split off the answer.

The parsers are checked against vLLM 0.32's own, run through its serving layer's parser on the same answers and
prompts, whole and streamed (``fixtures/vllm_reasoning_parsers.json``, made by
``fixtures/make_vllm_reasoning_parsers.py``). The server's answers come from a scripted model (``scripted_model``:
a real tiny Llama whose greedy answer is a given script), so each API's fields are checked on exact text.
"""
from __future__ import annotations

import json
import pathlib

import pytest

pytest.importorskip("fastapi")

from starlette.testclient import TestClient  # noqa: E402

from hf_paged.integrations.server import create_app  # noqa: E402
from hf_paged.integrations.server.reasoning import Reasoning  # noqa: E402
from live_server import sse  # noqa: E402
from scripted_model import byte_tokenizer, scripted_model  # noqa: E402

FIXTURES = json.loads((pathlib.Path(__file__).parents[1] / "fixtures" / "vllm_reasoning_parsers.json").read_text())


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_the_fixture_tokenizer_is_this_one(tok):
    assert {t: tok.convert_tokens_to_ids(t) for t in FIXTURES["ids"]} == FIXTURES["ids"]
    for name, text in (("plain", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"),):
        assert tok.encode(text, add_special_tokens=False) == FIXTURES["prompts"][name]


@pytest.mark.parametrize("case", FIXTURES["whole"], ids=lambda c: f"{c[0]}{c[1]}:{c[2][:24]!r}")
def test_whole_answers_split_as_vllms(tok, case):
    name, kwargs, text, reasoning, content, count = case
    reasoner = Reasoning.of(name, tok).for_request(kwargs)
    assert reasoner.split(text) == (reasoning, content)
    assert reasoner.count(tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]) == count


def test_streams_split_as_vllms(tok):
    """Every streamed case: each delta's (reasoning, content), (None, None) where vLLM sends no chunk."""
    wrong = []
    for name, kwargs, text, prompt, group, include, got in FIXTURES["streamed"]:
        reasoner = Reasoning.of(name, tok).for_request(kwargs)
        stream = reasoner.stream(FIXTURES["prompts"][prompt], include)
        last = len(got) - 1
        for k, (piece, ids, expected) in enumerate(got):
            mine = stream.feed(piece, ids, last=k == last)
            theirs = (None, None) if expected is None else (expected.get("reasoning"), expected.get("content"))
            if mine != theirs:
                wrong.append((name, kwargs, text, prompt, group, include, k, piece, mine, theirs))
    # one known difference: a turn's opening special token streamed alone inside qwen3's thinking makes vLLM's qwen3
    # stream hold the rest of the thinking back and send the end marker and the answer as thinking; here it is dropped
    # (as vLLM's whole answer drops it) and the stream goes on as the whole answer reads
    quirk = {(t, p) for n, _, t, p, g, _, *_ in wrong if n == "qwen3" and "<|im_start|>" in t and g == 1}
    assert quirk == {("<think>a <|im_start|>b</think>c", p) for p in ("plain", "open", "history")}
    wrong = [w for w in wrong if (w[2], w[3]) not in quirk]
    assert not wrong, f"{len(wrong)} differ, e.g. " + "\n".join(map(repr, wrong[:8]))


def test_deepseek_r1_needs_its_marker_tokens(smollm2_tokenizer):
    with pytest.raises(RuntimeError, match="could not locate think start/end tokens"):
        Reasoning.of("deepseek_r1", smollm2_tokenizer)
    assert Reasoning.of("qwen3", smollm2_tokenizer).end is None        # qwen3 reads the text alone, as vLLM's


# --- the server, on a scripted model ---

# ChatML; an assistant's thinking before its text; enable_thinking false closes an empty think block, as Qwen3's
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['reasoning_content'] %}<think>"
            "{{ m['reasoning_content'] }}</think>{% endif %}{{ m['content'] or '' }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
            "enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
THINK = ["<think>", "Plan it.", "</think>", "Done!"]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
MESSAGES = [{"role": "user", "content": "hi"}]


def server(script, parser="deepseek_r1", **config):
    tok = byte_tokenizer(script, TEMPLATE)
    model = scripted_model(tok, tok.convert_tokens_to_ids(tok.tokenize("\n"))[0], script)
    config = {"num_blocks": 64, "max_model_len": 256, **config}
    app = create_app(model, tok, served_model_name="tiny", max_num_seqs=4, block_size=16, reasoning_parser=parser,
                     **config)
    return TestClient(app, raise_server_exceptions=False)


def chat(client, **fields):
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "temperature": 0,
                                                  "max_tokens": 40, **fields})
    assert r.status_code == 200, r.text
    if not fields.get("stream"):
        return r.json()
    return [json.loads(block[6:]) for block in r.text.split("\n\n") if block.startswith("data: {")]


def joined(chunks, key):
    parts = [c["choices"][0]["delta"].get(key) for c in chunks if c["choices"]]
    return "".join(p for p in parts if p) if any(p is not None for p in parts) else None


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_chat_answers_reasoning_and_content_whole_and_streamed(parser):
    with server(THINK, parser) as client:
        body = chat(client, logprobs=True)
        message = body["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == ("Plan it.", "Done!")
        assert len(body["choices"][0]["logprobs"]["content"]) == 5   # the markers' and the EOS too, as vLLM's
        assert body["usage"]["completion_tokens"] == 5
        assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 1}
        chunks = chat(client, stream=True, stream_options={"include_usage": True})
        assert (joined(chunks, "reasoning"), joined(chunks, "content")) == ("Plan it.", "Done!")
        assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 1}
        # without include_reasoning: no thinking, no log-probabilities; content chunks carry "reasoning": null
        body = chat(client, logprobs=True, include_reasoning=False)
        assert body["choices"][0]["message"]["reasoning"] is None and body["choices"][0]["logprobs"] is None
        chunks = chat(client, stream=True, include_reasoning=False, logprobs=True)
        deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
        assert {"content": "Done!", "reasoning": None} in deltas
        assert not any(d.get("reasoning") for d in deltas) and all(c["choices"][0]["logprobs"] is None
                                                                   for c in chunks[1:])


def test_an_answer_that_never_closes_its_thinking_is_all_reasoning():
    with server(["<think>", "Hmm"]) as client:
        message = chat(client)["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == ("Hmm", None)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_structured_output_applies_after_the_thinking(parser):
    """The grammar waits for </think> (the script thinks, then answers "yes" as the choice allows); where the
    template closed the thinking (enable_thinking false) or include_reasoning is false, it applies from the start."""
    with server(["<think>", "Plan it.", "</think>", "yes"], parser) as client:
        message = chat(client, structured_outputs={"choice": ["yes", "no"]})["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == ("Plan it.", "yes")
        body = chat(client, structured_outputs={"choice": ["yes", "no"]}, include_reasoning=False)
        assert body["usage"]["completion_tokens"] <= 3          # "yes" or "n", "o", and the EOS: no thinking
        # (and no answer: a text without </think> is all thinking, which include_reasoning false leaves out)
        assert body["choices"][0]["message"]["content"] is None
    with server(["yes"], parser) as client:
        body = chat(client, structured_outputs={"choice": ["yes", "no"]},
                    chat_template_kwargs={"enable_thinking": False})
        message = body["choices"][0]["message"]          # (deepseek_r1 reads a text without </think> as thinking)
        assert (message["reasoning"], message["content"]) == ((None, "yes") if parser == "qwen3" else ("yes", None))


def test_tool_calls_are_read_from_the_content():
    script = ["<think>", "Need weather.", "</think>", "<tool_call>", CALL, "</tool_call>"]
    with server(script, "qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes") as client:
        choice = chat(client, tools=[WEATHER])["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning"] == "Need weather."
        assert choice["message"]["content"] is None
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
        chunks = chat(client, tools=[WEATHER], stream=True)
        assert joined(chunks, "reasoning") == "Need weather." and chunks[-1]["choices"][0]["finish_reason"] == \
            "tool_calls"
        calls = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls") or []]
        assert json.loads("".join(t["function"].get("arguments") or "" for t in calls)) == {"city": "Paris"}


def test_earlier_thinking_reaches_the_template():
    with server(THINK) as client:
        history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A", "reasoning_content": "R1"},
                   {"role": "user", "content": "hi"}]
        r = client.post("/tokenize", json={"model": "tiny", "messages": history})
        assert "<think>R1</think>A" in client.app.state.server.tokenizer.decode(r.json()["tokens"])
        history[1] = {"role": "assistant", "content": "A", "reasoning": "R2", "reasoning_content": "R1"}
        r = client.post("/tokenize", json={"model": "tiny", "messages": history})
        assert "<think>R2</think>A" in client.app.state.server.tokenizer.decode(r.json()["tokens"])


def test_anthropic_thinking_blocks():
    with server(THINK) as client:
        body = {"model": "tiny", "max_tokens": 40, "messages": MESSAGES, "temperature": 0}
        r = client.post("/v1/messages", json=body).json()
        assert [b["type"] for b in r["content"]] == ["thinking", "text"]
        assert (r["content"][0]["thinking"], r["content"][1]["text"]) == ("Plan it.", "Done!")
        assert len(r["content"][0]["signature"]) == 32
        events = [e for _, e in sse(client.post("/v1/messages", json={**body, "stream": True}).text)]
        kinds = [(e["type"], (e.get("content_block") or e.get("delta") or {}).get("type")) for e in events]
        assert kinds == [("message_start", None), ("content_block_start", "thinking"),
                         ("content_block_delta", "thinking_delta"), ("content_block_delta", "signature_delta"),
                         ("content_block_stop", None), ("content_block_start", "text"),
                         ("content_block_delta", "text_delta"), ("content_block_stop", None),
                         ("message_delta", None), ("message_stop", None)]
        # an earlier answer's thinking blocks become its reasoning (signatures unchecked, redacted ones dropped)
        history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "R1", "signature": "x"}, {"type": "redacted_thinking", "data": "y"},
            {"type": "text", "text": "A"}]}, {"role": "user", "content": "hi"}]
        r = client.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": history})
        plain = client.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": [
            history[0], {"role": "assistant", "content": "A"}, history[2]]})
        assert r.json()["input_tokens"] == plain.json()["input_tokens"] + 4      # <think>, R, 1, </think>


def test_responses_reasoning_items():
    with server(THINK) as client:
        body = {"model": "tiny", "input": "hi", "temperature": 0, "max_output_tokens": 40}
        r = client.post("/v1/responses", json=body).json()
        assert [o["type"] for o in r["output"]] == ["reasoning", "message"]
        assert r["output"][0]["content"] == [{"type": "reasoning_text", "text": "Plan it."}]
        assert r["output"][1]["content"][0]["text"] == "Done!"
        assert r["usage"]["output_tokens_details"] == {"reasoning_tokens": 1}
        events = [e for _, e in sse(client.post("/v1/responses", json={**body, "stream": True}).text)]
        kinds = [e["type"] for e in events]
        assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.reasoning_text.delta",
                         "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                         "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                         "response.output_text.done", "response.content_part.done", "response.output_item.done",
                         "response.completed"]
        done = events[-1]["response"]["output"]
        assert [o["type"] for o in done] == ["reasoning", "message"] and done[0]["status"] == "completed"
        r = client.post("/v1/responses", json={**body, "include_reasoning": False}).json()
        assert [o["type"] for o in r["output"]] == ["message"]


def test_thinking_token_budget_forces_the_end_of_thinking():
    """vLLM's thinking_token_budget: at most that many thinking tokens, then </think> is forced (the script would
    think three tokens); -1 is no limit; it needs a reasoning parser; Anthropic's thinking budget is the same."""
    script = ["<think>", "a", "b", "c", "</think>", "Done!"]
    with server(script, num_blocks=160, max_model_len=2560) as client:
        for budget, thought in ((1, "a"), (0, ""), (2, "ab"), (-1, "abc"), (5, "abc")):
            message = chat(client, thinking_token_budget=budget)["choices"][0]["message"]
            assert (message["reasoning"], message["content"]) == (thought, "Done!"), budget
        # the forced </think> is not the model's choice: vLLM lists the chosen token first in top_logprobs
        body = chat(client, thinking_token_budget=1, logprobs=True, top_logprobs=2)
        items = body["choices"][0]["logprobs"]["content"]
        assert [t["token"] for t in items[2]["top_logprobs"]] == ["</think>", "b"]
        assert [t["token"] for t in items[1]["top_logprobs"]][0] == "a"
        for bad in (-2, 1.5, True):
            r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES,
                                                          "thinking_token_budget": bad})
            assert r.status_code == 400 and "non-negative integer or -1" in r.json()["error"]["message"]
        body = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 2000,
                "thinking": {"type": "enabled", "budget_tokens": 1024}}
        assert client.post("/v1/messages", json=body).json()["content"][0]["thinking"] == "abc"
        r = client.post("/v1/messages", json={**body, "max_tokens": 1024})
        assert r.status_code == 400 and "less than max_tokens" in r.json()["error"]["message"]
    with server(script, parser=None) as client:
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "thinking_token_budget": 4})
        assert r.status_code == 400 and "--reasoning-parser" in r.json()["error"]["message"]


def test_thinking_spent_counts_from_the_last_opened_thinking():
    from hf_paged.engine.processors import thinking_spent
    S, E = 7, 8
    assert not thinking_spent([1, 2, 3], S, E, 0)                 # never thinking
    assert thinking_spent([1, S], S, E, 0) and not thinking_spent([1, S], S, E, 1)
    assert thinking_spent([S, 1, 2], S, E, 2) and not thinking_spent([S, 1, 2, E, 3], S, E, 0)
    assert thinking_spent([S, 1, E, S, 4, 5], S, E, 2) and not thinking_spent([S, 1, E, S, 4, 5], S, E, 3)


def test_a_forced_tool_choice_with_only_thinking_answers_as_vllms():
    """Under tool_choice "required" an answer that never leaves its thinking has content "" and finish_reason
    "tool_calls" (vLLM's rule for forced choices), not null and "stop"."""
    with server(["<think>", "Need weather."], enable_auto_tool_choice=True, tool_call_parser="hermes") as client:
        choice = chat(client, tools=[WEATHER], tool_choice="required")["choices"][0]
        assert (choice["message"]["content"], choice["message"]["reasoning"], choice["finish_reason"]) == \
            ("", "Need weather.", "tool_calls")


def test_completions_grammar_waits_for_the_thinking_too():
    """vLLM gates every request's grammar by the reasoning parser, completions' too (their text is not split)."""
    with server(["<think>", "Plan it.", "</think>", "yes"]) as client:
        prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 20,
                                                 "temperature": 0, "structured_outputs": {"choice": ["yes", "no"]}})
        assert r.json()["choices"][0]["text"] == "<think>Plan it.</think>yes"


def test_qwen3_streams_end_the_thinking_at_the_marker_token_only():
    """``</think>`` spelled in pieces is thinking's text in a stream (vLLM's stream reads token ids); the whole
    answer reads text, as vLLM's, and drops the second ``</think>``."""
    script = ["<think>", "a <", "b", "</thi", "nk>", "c", "</think>", "d"]
    with server(script, "qwen3") as client:
        message = chat(client)["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == ("a <b", "cd")
        chunks = chat(client, stream=True)
        assert (joined(chunks, "reasoning"), joined(chunks, "content")) == ("a <b</think>c", "d")


def test_token_ids_as_tokens_keep_their_texts_bytes():
    """vLLM's return_tokens_as_token_ids: a chat item's token is "token_id:N", its bytes its own text's."""
    with server(THINK) as client:
        items = chat(client, logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True)["choices"][0]
        first = items["logprobs"]["content"][1]
        tok = client.app.state.server.tokenizer
        assert first["token"] == f"token_id:{tok.convert_tokens_to_ids('Plan it.')}"
        assert bytes(first["bytes"]) == b"Plan it." and first["top_logprobs"][0]["token"] == first["token"]
