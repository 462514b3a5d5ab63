"""Tool calling in chat completions (``--enable-auto-tool-choice --tool-call-parser hermes|llama3_json``).

The parsers are checked against vLLM 0.32's own on the same answers (``fixtures/vllm_tool_parsers.json``, made
by vLLM's parsers: ``fixtures/make_vllm_tool_parsers.py``). The server's answers run a tiny random model over a
byte-level tokenizer: under ``tool_choice`` "required" or a named function the grammar makes even a random
model write calls, which come back as OpenAI's ``tool_calls`` (whole, streamed, and read by the ``openai``
client), with vLLM's finish reasons and its refusals.
"""
from __future__ import annotations

import json
import pathlib

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from starlette.testclient import TestClient  # noqa: E402

from hf_paged.integrations.server import create_app  # noqa: E402
from hf_paged.integrations.server.tool_choice import ToolUse  # noqa: E402
from hf_paged.integrations.server.tool_parsers import StreamParser, parse  # noqa: E402
from live_server import sse  # noqa: E402
from tiny_models import make_model  # noqa: E402

FIXTURES = json.loads((pathlib.Path(__file__).parents[1] / "fixtures" / "vllm_tool_parsers.json").read_text())
EOS_TEXT = "<|im_end|>"
# A Qwen-like template: the tools, an assistant's calls (arguments as objects) and tool results in the prompt
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}"
    "{% elif m['role'] == 'tool' %}<r id={{ m['tool_call_id'] }}>{{ m['content'] }}</r>"
    "{% else %}{{ m['content'] }}{% endif %}" + EOS_TEXT +
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
                                                                               "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
# A random model inside JSON would write optional whitespace forever (any amount is valid JSON): biased away
# here, where the grammar leaves a choice (where it forces a space or newline, that is the only token allowed)
NO_SPACES = {str(i): -100 for i in (197, 198, 201, 220)}       # tab, newline, carriage return, space
# ... and where another call may open, away from it: "<tool_call>" (one token) and "<" (its first piece)
NO_MORE_CALLS = {**NO_SPACES, "257": -100, "27": -100}


def byte_chat_tokenizer():
    """One token per byte, ``<|im_end|>`` the EOS (special) and ``<tool_call>`` one added token (as Qwen's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TEXT, pad_token=EOS_TEXT)
    tok.add_tokens(["<tool_call>"])
    tok.chat_template = TEMPLATE
    return tok


def tool_app(parser="hermes", enabled=True, seed=0):
    tok = byte_chat_tokenizer()
    model = make_model("llama", seed=seed, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = tok.eos_token_id
    return create_app(model, tok, served_model_name="tiny", num_blocks=64, max_num_seqs=4, block_size=16,
                      max_model_len=512, enable_auto_tool_choice=enabled, tool_call_parser=parser if enabled else None)


@pytest.fixture(scope="module")
def hermes():
    with TestClient(tool_app("hermes"), raise_server_exceptions=False) as client:
        yield client


def ask(client, **fields):
    body = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 200, "logit_bias": NO_SPACES,
            **fields}
    return client.post("/v1/chat/completions", json=body)


def events(client, **fields) -> list[dict]:
    r = ask(client, stream=True, **fields)
    assert r.status_code == 200, r.text
    lines = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def streamed_calls(chunks) -> tuple[str, list[list[str]], str]:
    """(content, [name, arguments] per call, finish reason) accumulated from a stream, as clients do."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            content += choice["delta"].get("content") or ""
            for call in choice["delta"].get("tool_calls") or []:
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] += call["function"].get("name") or ""
                entry[1] += call["function"].get("arguments") or ""
            reason = choice["finish_reason"] or reason
    return content, [calls[i] for i in sorted(calls)], reason


# --- the parsers, against vLLM's on the same answers ---

@pytest.mark.parametrize("kind", ["hermes", "llama3_json"])
def test_whole_answers_parse_as_vllms_parsers_parse_them(kind):
    for text, expected in FIXTURES[kind]:
        got = parse(kind, text)
        assert bool(got.calls) == expected["tools_called"], text
        assert got.content == expected["content"], text
        assert [[c["function"]["name"], c["function"]["arguments"]] for c in got.calls] == expected["calls"], text
        assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in got.calls)


def test_hermes_streams_as_vllms_parser_streams():
    for text, step, expected in FIXTURES["hermes_stream"]:
        parser, content, calls = StreamParser("hermes"), "", {}
        for start in range(0, len(text), step):
            out = parser.feed(text[start:start + step]) or {}
            content += out.get("content", "")
            for call in out.get("tool_calls", []):
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] += call["function"].get("name", "")
                entry[1] += call["function"].get("arguments", "")
                assert ("id" in call) == ("name" in call["function"])     # the id comes with the name, once
        assert (content, [calls[i] for i in sorted(calls)]) == (expected["content"], expected["calls"]), (text, step)


def test_llama3_json_holds_a_call_to_the_end_and_streams_text():
    parser = StreamParser("llama3_json")
    call = '{"name": "f", "parameters": {"a": 1}}'
    assert [parser.feed(call[i:i + 5]) for i in range(0, len(call), 5)] == [None] * 8
    out = parser.finish()
    assert [(c["index"], c["function"]) for c in out["tool_calls"]] == [(0, {"name": "f", "arguments": '{"a": 1}'})]
    text = StreamParser("llama3_json")
    assert text.feed("Hello") == {"content": "Hello"} and text.feed(" {x}") == {"content": " {x}"} and not text.finish()


def test_answer_rules_are_vllms():
    """Content and finish reason per choice, as vLLM's chat serving builds them."""
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    auto, required, named = (ToolUse("hermes", mode, (WEATHER,), name) for mode, name in
                             (("auto", None), ("required", None), ("named", "f")))
    fields, reason = auto.answer("Sure. " + call, "stop")
    assert (fields["content"], reason, len(fields["tool_calls"])) == ("Sure. ", "tool_calls", 1)
    assert auto.answer("  \n" + call, "stop")[0]["content"] is None           # blank beside calls: none
    assert auto.answer("no call", "length") == ({"content": "no call"}, "length")
    assert required.answer(call, "stop")[1] == "tool_calls" and required.answer(call, "length")[1] == "length"
    assert required.answer("  ", "stop")[0] == {"content": ""}                    # no call: no tool_calls key
    for bad in ('<tool_call>{"name": null, "arguments": {}}</tool_call>', '<tool_call>{"name": 5, "arguments": {}}'):
        assert auto.answer(bad, "stop") == ({"content": bad}, "stop")              # vLLM: the text, no call
    assert parse("llama3_json", '{"name": 5, "parameters": {}}').calls == []
    fields, reason = named.answer(call, "stop")
    assert (fields["content"], reason, len(fields["tool_calls"])) == ("", "stop", 1)    # named: "stop", content ""
    single = ToolUse("hermes", "required", (WEATHER,), None, single=True)
    assert len(single.answer(call + call, "stop")[0]["tool_calls"]) == 1


# --- the server ---

def check_call(call, names=("get_weather", "get_time")):
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] in names
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_named_function_is_one_valid_call(hermes):
    r = ask(hermes, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert r.status_code == 200, r.json()
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""
    assert len(choice["message"]["tool_calls"]) == 1
    check_call(choice["message"]["tool_calls"][0], names=("get_time",))


def test_required_is_calls_and_streams_the_same(hermes):
    # a random model would open call after call up to max_tokens (the last one cut, and then, as vLLM's parser
    # reads it, no call at all): <tool_call> biased away where EOS may come instead
    fields = dict(tools=[WEATHER, TIME], tool_choice="required", max_tokens=300, logit_bias=NO_MORE_CALLS)
    r = ask(hermes, **fields)
    assert r.status_code == 200, r.json()
    choice = r.json()["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert calls and choice["message"]["content"] == ""
    for call in calls:
        check_call(call)
    assert choice["finish_reason"] == "tool_calls"
    content, streamed, reason = streamed_calls(events(hermes, **fields))
    assert content == "" and reason == choice["finish_reason"]
    # streamed arguments are the model's text, the whole answer's re-serialised: the same JSON
    assert [(n, json.loads(a)) for n, a in streamed] == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                                         for c in calls]


def test_parallel_tool_calls_false_makes_one_call(hermes):
    r = ask(hermes, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1
    check_call(calls[0])


def test_auto_with_strict_tools_keeps_text_free(hermes):
    """auto: the model may answer in text (a random model does); no call, the engine's finish reason."""
    r = ask(hermes, tools=[WEATHER], max_tokens=12)
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and "tool_calls" not in choice["message"] and choice["finish_reason"] == "length"
    assert isinstance(choice["message"]["content"], str)


def test_history_with_calls_and_results_reaches_the_template(hermes):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = hermes.post("/tokenize", json={"model": "tiny", "messages": messages, "tools": [WEATHER]})
    assert r.status_code == 200, r.json()
    text = byte_chat_tokenizer().decode(r.json()["tokens"])
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text   # an object
    assert "<r id=c1>sunny</r>" in text and text.startswith("<tools>get_weather;</tools>")
    assert ask(hermes, messages=messages, tools=[WEATHER], max_tokens=3).status_code == 200
    bad = MESSAGES + [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]
    r = ask(hermes, messages=bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.1.tool_calls.0"
    r = hermes.post("/tokenize", json={"model": "tiny", "messages": bad})          # refused there alike
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.1.tool_calls.0"


@pytest.mark.parametrize("fields, param, words", [
    (dict(tool_choice="auto"), "tool_choice", "`tools` must be set"),
    (dict(tools=[], tool_choice="auto"), "tools", "must not be an empty array"),
    (dict(tools=[WEATHER], tool_choice="any"), "tool_choice", "Invalid value for `tool_choice`"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
     "does not match any"),
    (dict(tools=[WEATHER], tool_choice={"type": "function"}), "tool_choice.function", "Invalid value for `function`"),
    (dict(tools=[WEATHER], tool_choice={"type": "custom", "function": {"name": "get_weather"}}), "tool_choice.type",
     "Only named function tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]), "tools.0", "JSON schema object"),
    (dict(tools=[WEATHER], messages=MESSAGES + [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]),
     "messages.1.tool_calls.0", "id"),
    (dict(tools=[WEATHER], messages=MESSAGES + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {}}}]}]),
     "messages.1.tool_calls.0", "JSON text"),
    (dict(tools=[WEATHER], messages=MESSAGES + [{"role": "tool", "tool_call_id": "c", "content": None}]),
     "messages.1.content", "needs its content"),
])
def test_refusals_are_vllms(hermes, fields, param, words):
    r = ask(hermes, **fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and words in r.json()["error"]["message"]


def test_without_the_flags_tool_choices_are_refused_as_vllm_refuses_them():
    with TestClient(tool_app(enabled=False), raise_server_exceptions=False) as client:
        for choice, words in (("auto", '"auto" tool choice requires --enable-auto-tool-choice'),
                              ("required", 'tool_choice="required" requires --tool-call-parser'),
                              ({"type": "function", "function": {"name": "get_weather"}}, 'function "get_weather"')):
            r = ask(client, tools=[WEATHER], tool_choice=choice)
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.json()
        r = ask(client, tools=[WEATHER])                                    # tools alone: auto
        assert r.status_code == 400 and "auto" in r.json()["error"]["message"]
        assert ask(client, tools=[WEATHER], tool_choice="none", max_tokens=3).status_code == 200


def test_config_refuses_a_parser_it_does_not_have_and_the_flag_without_one():
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, llama3_json"):
        tool_app(parser="mistral")
    from hf_paged.integrations.server.config import AppConfig
    with pytest.raises(ValueError, match="needs tool_call_parser"):
        AppConfig(enable_auto_tool_choice=True).validate()


def test_llama3_json_named_call():
    with TestClient(tool_app("llama3_json", seed=1), raise_server_exceptions=False) as client:
        r = ask(client, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert r.status_code == 200, r.json()
        (call,) = r.json()["choices"][0]["message"]["tool_calls"]
        check_call(call, names=("get_weather",))
        content, streamed, _ = streamed_calls(events(client, tools=[WEATHER], tool_choice={
            "type": "function", "function": {"name": "get_weather"}}))
        assert streamed == [[call["function"]["name"], call["function"]["arguments"]]]


def test_the_openai_client_reads_the_calls():
    openai = pytest.importorskip("openai")
    from live_server import running

    with running(tool_app("hermes")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], temperature=0,
                                             logit_bias=NO_SPACES,
                                             tool_choice={"type": "function", "function": {"name": "get_weather"}})
        call = out.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
        with client.chat.completions.stream(model="tiny", messages=MESSAGES, tools=[WEATHER], temperature=0,
                                            logit_bias=NO_MORE_CALLS, tool_choice="required") as stream:
            final = stream.get_final_completion()
        calls = final.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "get_weather"
        assert final.choices[0].finish_reason == "tool_calls"


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}'
GRAMMAR_CASES = {     # (parser, mode): [(answer, whether the grammar takes it whole)]
    ("hermes", "named"): [(CALL, True), ("x" + CALL, False), (CALL.replace("Paris", "Oslo"), False)],
    ("hermes", "required"): [(CALL + CALL, True), (CALL.replace("\n", ""), True), ("hi", False)],
    ("hermes", "auto"): [("hello " + CALL + " bye", True), ("hello", True), ('a <tool_call>\n{"name": "zzz"', False)],
    ("llama3_json", "named"): [(LLAMA_CALL, True), ("x", False)],
    ("llama3_json", "required"): [("Sure " + LLAMA_CALL, True), ("no call", False)],
    ("llama3_json", "auto"): [("no call", True), ("t " + LLAMA_CALL + " end", True), ('{"name": "other"', False)],
}


@pytest.mark.parametrize("which", ["added tags", "smollm2"])
def test_grammars_take_calls_and_refuse_others(which, request):
    """Each mode's grammar (strict tools: auto constrains too) against whole answers, through the engine's
    compiler: with a tokenizer whose ``<tool_call>`` is one added token that is not special (Qwen's: text, which
    the grammar takes as that token or spelled in pieces) and with one that spells it in bytes (SmolLM2's)."""
    from hf_paged.engine.structured import GrammarCompiler

    loose = {"type": "function", "function": {"name": "f"}}
    assert ToolUse("hermes", "auto", (loose,)).grammar() is None                  # auto, no strict tool: free
    assert ToolUse("hermes", "auto", (loose,), single=True).grammar() is not None  # at most one call: constrained
    tok = byte_chat_tokenizer() if which == "added tags" else request.getfixturevalue("smollm2_tokenizer")
    compiler = GrammarCompiler(tok, len(tok), frozenset([tok.eos_token_id]))
    assert ("<tool_call>" in tok.get_added_vocab()) == (which == "added tags")

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]
    for (parser, mode), answers in GRAMMAR_CASES.items():
        use = ToolUse(parser, mode, (WEATHER, TIME), "get_weather" if mode == "named" else None)
        grammar = compiler.compile(use.grammar())
        for answer, takes in answers:
            parts = answer.split("<tool_call>")      # the tag as the tokenizer writes it, and in two pieces
            for tag in (ids("<tool_call>"), ids("<") + ids("tool_call>")):
                matcher = grammar.matcher()
                try:
                    for token in ids(parts[0]) + [t for part in parts[1:] for t in tag + ids(part)]:
                        matcher.accept(token)
                    taken = matcher.is_accepting
                except RuntimeError:
                    taken = False
                assert taken == takes, (parser, mode, answer, tag)


# --- Anthropic's Messages API: tool_use blocks, as vLLM converts them ---

# Anthropic's requests take no logit_bias: the schema asks llguidance for compact JSON instead (its x-guidance option)
ANTHROPIC_WEATHER = {"name": "get_weather", "strict": True, "input_schema": {
    **WEATHER["function"]["parameters"], "x-guidance": {"whitespace_flexible": False}}}


def test_anthropic_tool_use_whole_and_streamed(hermes):
    body = {"model": "tiny", "max_tokens": 200, "messages": MESSAGES, "temperature": 0,
            "tools": [ANTHROPIC_WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}
    r = hermes.post("/v1/messages", json=body)
    assert r.status_code == 200, r.json()
    got = r.json()
    (block,) = got["content"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["id"].startswith("chatcmpl-tool-")
    jsonschema.validate(block["input"], SCHEMAS["get_weather"])
    assert got["stop_reason"] == "tool_use" and got["stop_sequence"] is None
    chat = ask(hermes, tools=[{"type": "function", "function": {"name": "get_weather", "strict": True,
                                                                "parameters": ANTHROPIC_WEATHER["input_schema"]}}],
               tool_choice={"type": "function", "function": {"name": "get_weather"}}, logit_bias=None)
    assert json.loads(chat.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == block["input"]
    stream = sse(hermes.post("/v1/messages", json={**body, "stream": True}).text)
    names = [name for name, _ in stream]
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    start = stream[1][1]["content_block"]
    assert (start["type"], start["name"], start["input"]) == ("tool_use", "get_weather", {})
    partial = "".join(d["delta"]["partial_json"] for n, d in stream if n == "content_block_delta")
    assert all(d["delta"]["type"] == "input_json_delta" for n, d in stream if n == "content_block_delta")
    assert json.loads(partial) == block["input"] and stream[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_anthropic_history_with_tool_use_and_result_is_the_chat_one(hermes):
    """An assistant's tool_use and the user's tool_result render as chat's tool_calls and tool message."""
    anthropic_messages = MESSAGES + [
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "c1", "name": "get_weather",
                                           "input": {"city": "Paris", "days": 2}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                      "content": [{"type": "text", "text": "sunny"}]}]}]
    chat_messages = MESSAGES + [
        {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    counted = hermes.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": anthropic_messages,
                                                             "tools": [ANTHROPIC_WEATHER]})
    assert counted.status_code == 200, counted.json()
    tokens = hermes.post("/tokenize", json={"model": "tiny", "messages": chat_messages, "tools": [WEATHER]}).json()
    assert counted.json()["input_tokens"] == tokens["count"]
    assert "<r id=c1>sunny</r>" in byte_chat_tokenizer().decode(tokens["tokens"])


def test_anthropic_client_reads_tool_use():
    anthropic = pytest.importorskip("anthropic")
    from live_server import running

    with running(tool_app("hermes")) as url:
        client = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)
        kw = dict(model="tiny", max_tokens=200, messages=MESSAGES, tools=[ANTHROPIC_WEATHER],
                  tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"temperature": 0})
        message = client.messages.create(**kw)
        uses = [b for b in message.content if b.type == "tool_use"]
        assert uses and message.stop_reason == "tool_use"
        with client.messages.stream(**kw) as stream:
            final = stream.get_final_message()
        assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(b.name, b.input) for b in uses]


def test_an_echo_goes_before_the_content_and_is_not_read_for_calls(hermes):
    """vLLM's chat echo (the last message's text, where it has the answer's role) is put before the content after
    the answer is read for calls: a call written in the echoed message is no call of this answer."""
    echoed = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    messages = MESSAGES + [{"role": "assistant", "content": echoed}]
    r = ask(hermes, messages=messages, tools=[WEATHER], echo=True, add_generation_prompt=False,
            continue_final_message=True, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.status_code == 200, r.json()
    message = r.json()["choices"][0]["message"]
    assert message["content"] == messages[-1]["content"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


def test_a_stream_keeps_every_tokens_logprobs_and_ids_while_a_call_is_written(hermes):
    """Text held back (a call being written) sends no content, but its tokens' log-probabilities and ids still
    go out, in chunks with an empty delta (vLLM's): the stream carries as many as the whole answer."""
    fields = dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  logprobs=True, top_logprobs=2, return_token_ids=True)
    whole = ask(hermes, **fields).json()["choices"][0]
    chunks = events(hermes, **fields)
    entries = [e for c in chunks for ch in c["choices"] for e in ((ch.get("logprobs") or {}).get("content") or [])]
    ids = [t for c in chunks for ch in c["choices"] for t in (ch.get("token_ids") or [])]
    assert len(entries) == len(whole["logprobs"]["content"]) and ids == whole["token_ids"]
    assert [(n, json.loads(a)) for n, a in streamed_calls(chunks)[1]] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["message"]["tool_calls"]]


def test_thousands_of_tools_compile_and_strict_ones_are_bounded(request):
    """Tools without a schema of their own share one rule (their names one terminal), so 3,000 compile (a flat
    rule of two forms per tool passed llguidance's 2,000 alternatives at 999 and made no call); each strict tool
    is a rule of its own, at most MAX_STRICT_TOOLS, beyond which the request is refused naming the knob."""
    from hf_paged.engine.structured import GrammarCompiler
    from hf_paged.integrations.server.errors import ApiError
    from hf_paged.integrations.server.tool_choice import MAX_STRICT_TOOLS

    tok = byte_chat_tokenizer()
    compiler = GrammarCompiler(tok, len(tok), frozenset([tok.eos_token_id]))

    def tools(n, strict):
        return tuple({"type": "function", "function": {"name": f"t{i}", "strict": strict, "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}} for i in range(n))
    for n, strict in ((3000, False), (MAX_STRICT_TOOLS, True)):
        use = ToolUse("hermes", "required", tools(n, strict))   # <tool_call>: an added token of this tokenizer
        matcher = compiler.compile(use.grammar()).matcher()
        for token in tok(f'<tool_call>{{"name": "t{n - 1}", "arguments": {{"x": 3}}}}</tool_call>')["input_ids"]:
            matcher.accept(token)
        assert matcher.is_accepting
    with pytest.raises(ApiError, match=f"at most {MAX_STRICT_TOOLS}"):
        ToolUse("hermes", "required", tools(MAX_STRICT_TOOLS + 1, True)).grammar()


def test_structured_output_beside_tools_as_vllm_combines_them(hermes):
    """A forced call ignores the request's structured output; auto with a strict tool answers calls or the
    format (an openai-agents Agent with tools and an output type sends both); auto with one call at most and no
    strict tool answers the format."""
    named = ask(hermes, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                response_format={"type": "json_object"})
    assert named.status_code == 200 and len(named.json()["choices"][0]["message"]["tool_calls"]) == 1
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    both = ask(hermes, tools=[WEATHER], response_format={"type": "json_schema", "json_schema": {
        "name": "out", "schema": schema}}, max_tokens=300, logit_bias=NO_MORE_CALLS)
    message = both.json()["choices"][0]["message"]
    if message.get("tool_calls"):
        check_call(message["tool_calls"][0])
    else:
        jsonschema.validate(json.loads(message["content"]), schema)
    loose = {"type": "function", "function": {"name": "f"}}
    alone = ask(hermes, tools=[loose], parallel_tool_calls=False,
                response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": schema}})
    assert "tool_calls" not in alone.json()["choices"][0]["message"]
    jsonschema.validate(json.loads(alone.json()["choices"][0]["message"]["content"]), schema)


def test_auto_with_a_strict_tool_or_a_format_takes_either():
    """The combined grammar takes a call or the format, nothing else."""
    from hf_paged.engine.structured import GrammarCompiler, StructuredOutput

    tok = byte_chat_tokenizer()
    compiler = GrammarCompiler(tok, len(tok), frozenset([tok.eos_token_id]))
    use = ToolUse("hermes", "auto", (WEATHER,))
    for asked, fine, wrong in ((StructuredOutput(json={"type": "object", "properties": {"ok": {"type": "boolean"}}}),
                                '{"ok": true}', '{"no": 1}'),
                               (StructuredOutput(choice=("yes", "no")), "no", "maybe"),
                               (StructuredOutput(regex=r"\d{3}/x"), "123/x", "12/x")):
        grammar = compiler.compile(use.either(asked))
        for text, takes in ((fine, True), (wrong, False), ('<tool_call>{"name": "get_weather", "arguments": '
                                                           '{"city": "Rome", "days": 2}}</tool_call>', True)):
            matcher = grammar.matcher()
            try:
                for token in tok(text)["input_ids"]:
                    matcher.accept(token)
                taken = matcher.is_accepting
            except RuntimeError:
                taken = False
            assert taken == takes, (asked, text)
    assert use.either(StructuredOutput(grammar='start: "x"')) is None          # a grammar: the format alone


# --- OpenAI's Responses API: function tools, function_call items ---

RESPONSES_WEATHER = {"type": "function", "name": "get_weather", "strict": True,
                     "parameters": WEATHER["function"]["parameters"]}


def test_responses_function_calls_whole_and_streamed(hermes):
    body = {"model": "tiny", "input": "Weather in Paris?", "temperature": 0, "max_output_tokens": 200,
            "logit_bias": NO_SPACES, "tools": [RESPONSES_WEATHER], "tool_choice": {"type": "function",
                                                                                  "name": "get_weather"}}
    r = hermes.post("/v1/responses", json=body)
    assert r.status_code == 200, r.json()
    got = r.json()
    (item,) = got["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather" and item["status"] == "completed"
    assert item["id"].startswith("fc_") and item["call_id"].startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(item["arguments"]), SCHEMAS["get_weather"])
    assert got["status"] == "completed" and got["tool_choice"] == body["tool_choice"]
    stream = sse(hermes.post("/v1/responses", json={**body, "stream": True}).text)
    names = [n for n, _ in stream]
    assert names[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert names[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(names[3:-3]) == {"response.function_call_arguments.delta"}
    assert [d["sequence_number"] for _, d in stream] == list(range(len(stream)))
    deltas = "".join(d["delta"] for n, d in stream if n == "response.function_call_arguments.delta")
    final = stream[-1][1]["response"]["output"]
    assert json.loads(deltas) == json.loads(item["arguments"]) and final[0]["arguments"] == deltas
    assert stream[-3][1]["arguments"] == deltas and stream[-3][1]["name"] == "get_weather"


def test_responses_history_items_are_chats_tool_messages(hermes):
    """function_call items join the assistant message before them; function_call_output items are tool messages."""
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    chat_messages = MESSAGES + [
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = hermes.post("/v1/responses", json={"model": "tiny", "input": items, "tools": [RESPONSES_WEATHER],
                                           "tool_choice": "none", "max_output_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.json()
    counted = hermes.post("/tokenize", json={"model": "tiny", "messages": chat_messages, "tools": [WEATHER]}).json()
    assert r.json()["usage"]["input_tokens"] == counted["count"]
    bad = hermes.post("/v1/responses", json={"model": "tiny", "input": [{"type": "function_call", "name": "f"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input.0"


def test_the_openai_client_reads_function_call_items():
    openai = pytest.importorskip("openai")
    from live_server import running

    with running(tool_app("hermes")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        out = client.responses.create(model="tiny", input="Weather?", tools=[RESPONSES_WEATHER], temperature=0,
                                      tool_choice="required", parallel_tool_calls=False,
                                      extra_body={"logit_bias": NO_SPACES})
        (call,) = [o for o in out.output if o.type == "function_call"]
        assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
        with client.responses.stream(model="tiny", input="Weather?", tools=[RESPONSES_WEATHER], temperature=0,
                                     tool_choice="required", parallel_tool_calls=False,
                                     extra_body={"logit_bias": NO_SPACES}) as stream:
            final = stream.get_final_response()
        assert [(o.name, json.loads(o.arguments)) for o in final.output if o.type == "function_call"] == [
            (call.name, json.loads(call.arguments))]          # streamed: the model's text; whole: re-serialised


def test_responses_namespaced_functions_and_non_text_results(hermes):
    """A ``namespace`` tool's functions are called by their flat name ``namespace__name`` (the template's and the
    parser's, vLLM's), answered with name and namespace apart; a function_call item's namespace is flattened the
    same way; a tool result with an image is refused (text-only model)."""
    inner = {k: v for k, v in RESPONSES_WEATHER.items()}
    body = {"model": "tiny", "input": "Weather?", "temperature": 0, "max_output_tokens": 200, "logit_bias": NO_SPACES,
            "tools": [{"type": "namespace", "name": "wx", "tools": [inner]}],
            "tool_choice": {"type": "function", "name": "wx__get_weather"}}
    r = hermes.post("/v1/responses", json=body)
    assert r.status_code == 200, r.json()
    (item,) = r.json()["output"]
    assert (item["name"], item["namespace"]) == ("get_weather", "wx")
    stream = sse(hermes.post("/v1/responses", json={**body, "stream": True}).text)
    added = [d["item"] for n, d in stream if n == "response.output_item.added"]
    assert [(a["name"], a["namespace"]) for a in added] == [("get_weather", "wx")]
    history = [{"role": "user", "content": "Weather?"},
               {"type": "function_call", "call_id": "c1", "namespace": "wx", "name": "get_weather", "arguments": "{}"}]
    flat = [{"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": "c1", "name": "wx__get_weather", "arguments": "{}"}]
    counts = [hermes.post("/v1/responses", json={"model": "tiny", "input": h, "max_output_tokens": 1, "temperature": 0,
                                                 "tools": body["tools"], "tool_choice": "none"}).json()
              for h in (history, flat)]
    assert counts[0]["usage"]["input_tokens"] == counts[1]["usage"]["input_tokens"]
    assert counts[0]["output"] == [] or counts[0]["output"][0]["content"] == counts[1]["output"][0]["content"]
    image = {"type": "function_call_output", "call_id": "c1", "output": [
        {"type": "input_text", "text": "x"}, {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}
    r = hermes.post("/v1/responses", json={"model": "tiny", "input": history + [image], "max_output_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.2.output.1"
