"""The server's request layer without an engine: vLLM's fields parsed, checked and mapped to the engine's
settings (``generation_settings`` / ``engine_settings``) and to how the answer is rendered
(``call_options``). A fake state stands in for the served model (vocabulary, tokenizer, max_logprobs).
"""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

from hf_paged.engine.structured import StructuredOutput  # noqa: E402
from hf_paged.integrations.server.body import parse  # noqa: E402
from hf_paged.integrations.server.defaults import SamplingDefaults  # noqa: E402
from hf_paged.integrations.server.errors import ApiError  # noqa: E402
from hf_paged.integrations.server.intake import (  # noqa: E402
    call_options, chat_text, checked, completion_prompts, engine_settings, generation_settings,
    requested_max_tokens)
from hf_paged.integrations.server.options import CallOptions  # noqa: E402
from hf_paged.integrations.server.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from hf_paged.integrations.server.token_settings import bad_words_ids  # noqa: E402
from hf_paged.integrations.server.vllm_fields import IGNORED, IMPLEMENTED, NEUTRAL_ONLY  # noqa: E402
from tiny_models import VOCAB, word_tokenizer  # noqa: E402

MAX_LOGPROBS = 5
CHAT = {"messages": [{"role": "user", "content": "w3 w4"}]}
PROMPT = {"prompt": "w3 w4 w5"}

# Field names of vLLM's CompletionRequest / ChatCompletionRequest (vllm/entrypoints/openai/completion/
# protocol.py and chat_completion/protocol.py, 2026) and the older guided_* fields of openai/protocol.py.
VLLM_COMMON = """model frequency_penalty logit_bias n presence_penalty seed stop stream stream_options temperature
    top_p user use_beam_search top_k min_p repetition_penalty watermarking length_penalty stop_token_ids
    include_stop_str_in_output ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens
    truncate_prompt_tokens truncation_side allowed_token_ids prompt_logprobs logprob_token_ids bad_words
    add_special_tokens response_format structured_outputs priority request_id session_id
    return_tokens_as_token_ids return_token_ids routed_experts_prompt_start return_token_offsets
    return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs repetition_detection
    thinking_token_budget stream_interval guided_json guided_regex guided_choice guided_grammar
    guided_decoding_backend guided_whitespace_pattern logits_processors echo max_tokens logprobs""".split()
VLLM_COMPLETION = VLLM_COMMON + "prompt suffix best_of prompt_embeds".split()
VLLM_CHAT = VLLM_COMMON + """messages top_logprobs max_completion_tokens tools tool_choice reasoning_effort
    include_reasoning parallel_tool_calls add_generation_prompt continue_final_message documents chat_template
    chat_template_kwargs media_io_kwargs mm_processor_kwargs return_prompt_text structural_tag""".split()


def fake_state(compile_grammar=None):
    engine = SimpleNamespace(config=SimpleNamespace(max_logprobs=MAX_LOGPROBS, max_num_seqs=8),
                             never_fits=lambda prompt_len, params: None, model_len=None)
    if compile_grammar is not None:
        engine.compile_grammar = compile_grammar
    return SimpleNamespace(vocab_size=VOCAB, tokenizer=word_tokenizer(), max_model_len=128, name="tiny",
                           engine=engine, worker=SimpleNamespace(capacity=24), defaults=SamplingDefaults(),
                           reasoning=None)


def request(body: dict, chat: bool = False):
    """The request as ``read_request`` leaves it (parsed, checked) for ``fake_state``."""
    schema = ChatCompletionRequest if chat else CompletionRequest
    return checked(parse(json.dumps({**(CHAT if chat else PROMPT), **body}).encode(), schema), fake_state())


def settings(body: dict, chat: bool = False, max_tokens: int = 8) -> dict:
    return generation_settings(request(body, chat), max_tokens, fake_state())


def refusal(body: dict, chat: bool = False) -> ApiError:
    with pytest.raises(ApiError) as err:
        settings(body, chat)
    assert err.value.status == 400 and "Traceback" not in err.value.message
    return err.value


@pytest.mark.parametrize("schema, vllm", [(CompletionRequest, VLLM_COMPLETION), (ChatCompletionRequest, VLLM_CHAT)])
def test_every_vllm_field_is_accepted_and_placed(schema, vllm):
    """vLLM's fields are all known; each field is implemented, ignored, or neutral-only (never two)."""
    fields = {f.alias or name for name, f in schema.model_fields.items()}
    assert set(vllm) - fields == set()
    for name in fields:
        homes = [name in IMPLEMENTED, name in NEUTRAL_ONLY, name in IGNORED]
        assert sum(homes) == 1 or (name == "echo" and schema is ChatCompletionRequest), name


def test_vllm_defaults_resolve_as_before():
    """vLLM's bench body and a body spelling out every default give the settings of the bare request."""
    bare = settings({"max_tokens": 8, "temperature": 0})
    bench = {"max_tokens": 8, "temperature": 0, "repetition_penalty": 1.0, "logprobs": None, "stream": True,
             "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    spelled = {**bench, "use_beam_search": False, "top_k": -1, "min_p": 0.0, "length_penalty": 1.0,
               "stop_token_ids": [], "include_stop_str_in_output": False, "min_tokens": 0, "presence_penalty": 0,
               "frequency_penalty": 0.0, "skip_special_tokens": True, "spaces_between_special_tokens": True,
               "bad_words": [], "logit_bias": {}, "priority": 0, "echo": False, "n": None, "best_of": 1,
               "truncate_prompt_tokens": None, "allowed_token_ids": None, "response_format": {"type": "text"},
               "structured_outputs": None, "guided_json": None, "thinking_token_budget": -1, "cache_salt": None,
               "kv_transfer_params": {}, "vllm_xargs": None, "prompt_embeds": None, "user": "u", "request_id": "r",
               "guided_decoding_backend": "xgrammar", "stream_interval": 4, "repetition_detection":
               {"max_pattern_size": 0}, "return_token_ids": False, "logprob_token_ids": None}
    assert settings(bench) == bare
    assert settings(spelled) == bare
    chat = {"max_tokens": 8, "temperature": 0, "logprobs": False, "top_logprobs": 0, "tools": None,
            "tool_choice": "none", "parallel_tool_calls": True, "add_generation_prompt": True, "echo": False,
            "include_reasoning": True, "chat_template_kwargs": {}, "documents": None}
    assert settings(chat, chat=True) == settings({"max_tokens": 8, "temperature": 0}, chat=True)


@pytest.mark.parametrize("body, expected", [
    ({"min_tokens": 2}, {"min_tokens": 2}),          # vLLM's: stop strings wait for it too
    ({"repetition_penalty": 1.3}, {"repetition_penalty": 1.3}),
    ({"min_p": 0.1, "temperature": 1.0}, {"min_p": 0.1}),
    ({"presence_penalty": 0.5, "frequency_penalty": -0.5}, {"presence_penalty": 0.5, "frequency_penalty": -0.5}),
    ({"logit_bias": {"5": 200, "6": -3}}, {"logit_bias": {5: 100.0, 6: -3.0}}),
    ({"bad_words": ["w5", " w6 w7"]}, {"bad_words_ids": [[5], [6, 7]]}),
    ({"allowed_token_ids": [3, 4], "stop_token_ids": [9]}, {"allowed_token_ids": [3, 4], "stop_token_ids": [9]}),
    ({"logprobs": 2}, {"logprobs": 2}),
    ({"logprobs": 0}, {"logprobs": 0}),
    ({"echo": True, "logprobs": 1, "max_tokens": 1}, {"logprobs": 1, "prompt_logprobs": 1}),
    ({"echo": True, "logprobs": 1, "prompt_logprobs": 3}, {"logprobs": 1, "prompt_logprobs": 3}),
    ({"echo": True, "logprobs": 4, "prompt_logprobs": 2}, {"logprobs": 4, "prompt_logprobs": 4}),
    ({"prompt_logprobs": 0}, {"prompt_logprobs": 0}),
])
def test_completion_fields_map_to_engine_settings(body, expected):
    got = settings(body)
    assert {k: got.get(k) for k in expected} == expected
    assert "prompt_logprobs" in got or "prompt_logprobs" not in expected


@pytest.mark.parametrize("body, expected", [
    ({"logprobs": True}, {"logprobs": 0}),
    ({"logprobs": True, "top_logprobs": 3}, {"logprobs": 3}),
    ({"logprobs": False, "top_logprobs": 0}, {}),
    ({"min_tokens": 1, "repetition_penalty": 0.9}, {"min_tokens": 1, "repetition_penalty": 0.9}),
])
def test_chat_fields_map_to_engine_settings(body, expected):
    got = settings(body, chat=True)
    keys = {"logprobs", "prompt_logprobs", "min_tokens", "repetition_penalty"}
    assert {k: v for k, v in got.items() if k in keys} == expected


def test_greedy_drops_only_the_sampling_filters():
    got = settings({"temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.2, "presence_penalty": 1.0})
    assert got["do_sample"] is False and got["presence_penalty"] == 1.0
    assert not {"top_p", "top_k", "min_p"} & set(got)


def test_bad_words_follow_vllms_rule():
    """Each word plain, and with a leading space when that gives another first token and as many tokens."""
    table = {"foo": [10, 11], " foo": [12, 11], "bar": [13], " bar": [20, 13], "baz": [14], " baz": [14]}
    tok = lambda text, add_special_tokens: {"input_ids": table[text]}  # noqa: E731
    state = SimpleNamespace(vocab_size=VOCAB, tokenizer=tok)
    assert bad_words_ids(state, [" foo", "bar", "baz"]) == [[10, 11], [12, 11], [13], [14]]


@pytest.mark.parametrize("body, chat, param, words", [
    ({"logprobs": 6}, False, "logprobs", ["at most 5", "--max-logprobs"]),
    ({"logprobs": -1}, False, "logprobs", ["whole vocabulary", "at most 5"]),
    ({"prompt_logprobs": 9}, False, "prompt_logprobs", ["at most 5"]),
    ({"logprobs": True, "top_logprobs": 6}, True, "top_logprobs", ["at most 5"]),
    ({"top_logprobs": 2}, True, "top_logprobs", ["logprobs=true"]),
    ({"logit_bias": {"99999": 1}}, False, "logit_bias", ["outside the vocabulary", str(VOCAB)]),
    ({"logit_bias": {"w5": 1}}, False, "logit_bias", ["not a token id"]),
    ({"allowed_token_ids": [3, 99999]}, False, "allowed_token_ids", ["99999"]),
    ({"allowed_token_ids": []}, False, "allowed_token_ids", ["empty"]),
    ({"stop_token_ids": [-1]}, True, "stop_token_ids", ["-1"]),
    ({"bad_words": ["  "]}, False, "bad_words", ["no token"]),
    ({"bad_words": ["w3"] * 129}, False, "bad_words", ["at most 128"]),
    ({"repetition_penalty": 0}, False, "repetition_penalty", []),
    ({"min_p": 1.5}, False, "min_p", []),
    ({"presence_penalty": 2.5}, True, "presence_penalty", []),
    ({"min_tokens": 9}, False, "min_tokens", ["max_tokens=8"]),
    ({"max_tokens": 0}, False, "max_tokens", ["echo"]),
    ({"max_tokens": 5.5}, False, "max_tokens", []),
    ({"seed": 2**63}, False, "seed", []),
    ({"temperature": -0.5}, False, "temperature", []),
    ({"stream_options": {"include_usage": True}}, False, "stream_options", ["stream=true"]),
    ({"stop": ["w3", ""]}, False, "stop", ["empty string"]),
    ({"chat_template_kwargs": {"tokenize": True}}, True, "chat_template_kwargs", ["tokenize"]),
    ({"continue_final_message": True, "chat_template_kwargs": {"add_generation_prompt": True}}, True,
     "continue_final_message", ["add_generation_prompt"]),
    ({"use_beam_search": True}, False, "use_beam_search", ["beam search"]),
    ({"best_of": 3}, False, "best_of", []),
    ({"suffix": "x"}, False, "suffix", []),
    ({"tool_choice": "auto"}, True, "tool_choice", ["`tools` must be set"]),
    ({"cache_salt": "s"}, False, "cache_salt", []),
    ({"prompt_embeds": "AAAA"}, False, "prompt_embeds", []),
    ({"spaces_between_special_tokens": False}, False, "spaces_between_special_tokens", []),
    ({"priority": 1}, True, "priority", []),
    ({"chat_template": "{{ messages }}"}, True, "chat_template", ["trust"]),
    ({"continue_final_message": True}, True, "continue_final_message", ["add_generation_prompt"]),
    ({"logprob_token_ids": [3]}, False, "logprob_token_ids", []),
    ({"structural_tag": "{}"}, True, "structural_tag", []),
    ({"guided_whitespace_pattern": " "}, False, "guided_whitespace_pattern", []),
    ({"repetition_detection": {"max_pattern_size": 4, "min_count": 2}}, False, "repetition_detection", []),
    ({"vllm_xargs": {"a": 1}}, False, "vllm_xargs", []),
    ({"stream": True, "prompt_logprobs": 1}, False, "prompt_logprobs", ["stream"]),
    ({"truncate_prompt_tokens": 0}, False, "truncate_prompt_tokens", []),
    ({"stop": ["w3"] * 65}, False, "stop", ["at most 64"]),
    ({"guided_choice": []}, False, "guided_choice", ["empty"]),
    ({"model": "other"}, False, "model", ["does not exist"]),
])
def test_bad_values_are_refused_naming_the_field(body, chat, param, words):
    err = refusal(body, chat) if param != "model" else None
    if param == "model":
        with pytest.raises(ApiError) as caught:
            request(body, chat)
        err = caught.value
        assert err.status == 404
    assert err.param == param, err.message
    for word in words:
        assert word in err.message, err.message


def test_call_options():
    req = request({"echo": True, "max_tokens": 0, "logprobs": 1, "stop": ["w9"], "n": 1,
                   "include_stop_str_in_output": True, "skip_special_tokens": False,
                   "return_tokens_as_token_ids": True, "prompt_logprobs": 2})
    assert call_options(req) == CallOptions(n=1, stops=("w9",), include_stop_str_in_output=True,
                                            skip_special_tokens=False, logprobs=1, echo=True, max_tokens_zero=True,
                                            prompt_logprobs=2, chat=False, return_tokens_as_token_ids=True)
    assert requested_max_tokens(req) == 0          # checked against the context as 0; the engine runs 1
    chat = request({"logprobs": True, "top_logprobs": 2, "n": 2, "temperature": 1.0}, chat=True)
    assert call_options(chat) == CallOptions(n=2, logprobs=2, chat=True, role="assistant")
    assert call_options(request({"logprobs": True}, chat=True)).logprobs == 0
    assert call_options(request({})) == CallOptions()


def test_prompts_truncated_and_counted():
    state = fake_state()
    assert completion_prompts(state, request({"truncate_prompt_tokens": 2})) == [[4, 5]]
    assert completion_prompts(state, request({"truncate_prompt_tokens": 2, "truncation_side": "right"})) == [[3, 4]]
    assert completion_prompts(state, request({"prompt": [[3, 4], [5]]})) == [[3, 4], [5]]
    with pytest.raises(ApiError, match="at most 24 per request") as err:
        completion_prompts(state, request({"prompt": ["w3"] * 13, "n": 2, "temperature": 1.0}))
    assert "--max-queue" in err.value.message


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("body, spec", [
    ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutput(json=SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput(json=SCHEMA)),
    ({"structured_outputs": {"regex": "w[0-9]+"}}, StructuredOutput(regex="w[0-9]+")),
    ({"structured_outputs": {"choice": ["w3", "w4"], "disable_fallback": True}}, StructuredOutput(choice=("w3", "w4"))),
    ({"structured_outputs": {"grammar": "start: \"w3\""}}, StructuredOutput(grammar="start: \"w3\"")),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput(json_object=True)),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     StructuredOutput(json=SCHEMA, disable_any_whitespace=True)),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput(json=json.dumps(SCHEMA))),
    ({"guided_regex": "w3|w4", "guided_decoding_backend": "outlines"}, StructuredOutput(regex="w3|w4")),
    ({"guided_choice": ["w5"]}, StructuredOutput(choice=("w5",))),
    ({"guided_grammar": "root ::= \"w3\""}, StructuredOutput(grammar="root ::= \"w3\"")),
    ({"guided_json": SCHEMA,
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     StructuredOutput(json=SCHEMA)),                                     # the same constraint twice is one
])
@pytest.mark.parametrize("chat", [False, True])
def test_structured_output_is_compiled_into_the_settings(body, spec, chat):
    seen = []
    state = fake_state(compile_grammar=lambda s: (seen.append(s), ("compiled", s))[1])
    got = asyncio.run(engine_settings(state, request(body, chat), 8))
    assert got["structured_output"] == ("compiled", spec) and seen == [spec]


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "w3"}, "guided_regex",
     ["response_format and guided_regex"]),
    ({"structured_outputs": {"json": SCHEMA, "regex": "w3"}}, "structured_outputs.regex",
     ["structured_outputs.json and structured_outputs.regex"]),
    ({"structured_outputs": {"regex": "w3", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", []),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     []),
    ({"response_format": {"type": "structural_tag", "structures": [], "triggers": []}}, "response_format",
     ["structural_tag"]),
    ({"response_format": {"type": "xml"}}, "response_format.type", []),
])
def test_structured_output_refusals_name_the_fields(body, param, words):
    state = fake_state(compile_grammar=lambda s: s)
    with pytest.raises(ApiError) as err:
        asyncio.run(engine_settings(state, request(body), 8))
    assert err.value.status == 400 and err.value.param == param, err.value.message
    assert all(w in err.value.message for w in words), err.value.message


def test_grammar_that_does_not_compile_is_a_400():
    def compile_grammar(spec):
        raise ValueError("unbalanced parenthesis at 3")

    with pytest.raises(ApiError) as err:
        asyncio.run(engine_settings(fake_state(compile_grammar), request({"guided_regex": "w3("}), 8))
    assert err.value.code == "invalid_grammar" and err.value.param == "guided_regex"
    assert "regex" in err.value.message and "unbalanced parenthesis" in err.value.message
    with pytest.raises(ApiError, match="structured output needs") as err:
        asyncio.run(engine_settings(fake_state(), request({"guided_regex": "w3"}), 8))
    assert err.value.status == 400
    assert "structured_output" not in asyncio.run(engine_settings(fake_state(), request({}), 8))


def test_chat_template_options_reach_the_template():
    """add_generation_prompt, continue_final_message, documents, chat_template_kwargs and
    reasoning_effort are the template's to read, as vLLM passes them."""
    state = fake_state()
    state.tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if extra %}{{ extra }} {% endif %}"
        "{% if documents %}{{ documents[0]['text'] }} {% endif %}{% if reasoning_effort %}{{ reasoning_effort }} "
        "{% endif %}{% if add_generation_prompt %}w9{% endif %}")
    turns = {"messages": [{"role": "user", "content": "w3"}, {"role": "assistant", "content": "w4"}]}
    schema = ChatCompletionRequest

    def text(body):
        return chat_text(state, checked(parse(json.dumps({**turns, **body}).encode(), schema), state))

    assert text({}) == "w3 w4 w9"
    assert text({"add_generation_prompt": False, "continue_final_message": True}) == "w3 w4"
    assert text({"chat_template_kwargs": {"extra": "w5"}, "documents": [{"text": "w6"}]}) == "w3 w4 w5 w6 w9"
    assert text({"reasoning_effort": "low"}) == "w3 w4 low w9"
    # the request's template flags win over chat_template_kwargs', as vLLM merges them
    assert text({"chat_template_kwargs": {"add_generation_prompt": False}}) == "w3 w4 w9"


def test_developer_messages_are_system_messages_for_templates_without_the_role():
    """OpenAI's current clients send ``developer`` where they sent ``system``: for a template that does not
    name the role, vLLM's renderer makes it a system message and merges the system messages into one, first."""
    state = fake_state()
    state.tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }} {% endfor %}"

    def text(*turns):
        body = {"messages": [{"role": r, "content": c} for r, c in turns]}
        return chat_text(state, checked(parse(json.dumps(body).encode(), ChatCompletionRequest), state))

    assert text(("developer", "w1"), ("user", "w2")).strip() == "system:w1 user:w2"
    assert text(("system", "w1"), ("user", "w2"), ("developer", "w3")).strip() == "system:w1\n\nw3 user:w2"
    assert text(("user", "w2"), ("system", "w1")).strip() == "user:w2 system:w1"       # no developer: as given
    state.tokenizer.chat_template += "{% if messages[0]['role'] == 'developer' %}dev{% endif %}"
    assert text(("developer", "w1"), ("user", "w2")).strip() == "developer:w1 user:w2 dev"


def test_bodies_are_read_as_vllm_reads_them(caplog):
    """vLLM's lax parsing ("5" and 5.0 are 5, true is 1) and its unknown fields, ignored and logged by name
    (nested ones too); NaN and a float token id stay refused."""
    import logging
    body = {"max_tokens": "5", "n": 2.0, "logprobs": True, "seed": -1, "temperature": 2.5, "prompt_cache_key": "k",
            "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}}
    with caplog.at_level(logging.WARNING, logger="hf_paged.server"):
        req = parse(json.dumps({**PROMPT, **body}).encode(), CompletionRequest)
    assert (req.max_tokens, req.n, req.logprobs, req.seed, req.temperature) == (5, 2, 1, -1, 2.5)
    assert req.ignored_fields() == ["prompt_cache_key", "stream_options.include_obfuscation"]
    assert not hasattr(req, "prompt_cache_key")
    assert "prompt_cache_key" in caplog.text and "stream_options.include_obfuscation" in caplog.text
    chat = parse(json.dumps({"messages": [{"role": "user", "content": "w3", "x": 1}], "y": 2}).encode(),
                 ChatCompletionRequest)
    assert chat.ignored_fields() == ["y", "messages.0.x"]
    for bad in (b'{"prompt": "w3", "temperature": NaN}', b'{"prompt": [3, 4.0]}'):
        with pytest.raises(ApiError):
            parse(bad, CompletionRequest)


def test_unset_sampling_fields_take_vllms_defaults():
    """No temperature samples at 1.0 with no top_k (vLLM's defaults, not generate's greedy and top_k=50); the
    model's generation config overrides the fields it sets (--generation-config auto), not with 'vllm'."""
    from transformers import GenerationConfig
    got = settings({})
    assert got["do_sample"] is True and got["temperature"] == 1.0 and got["top_k"] == 0 and got["top_p"] == 1.0
    assert settings({"temperature": 1e-6})["do_sample"] is False            # below vLLM's epsilon: greedy
    tuned = GenerationConfig(do_sample=False, temperature=0.6, top_k=20, repetition_penalty=1.1, max_new_tokens=7,
                             no_repeat_ngram_size=3)
    defaults = SamplingDefaults.from_model(tuned)
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.repetition_penalty, defaults.max_tokens) \
        == (0.6, 20, 1.0, 1.1, 7)
    assert SamplingDefaults.from_model(tuned, "vllm") == SamplingDefaults()
    state = fake_state()
    state.defaults = defaults
    got = generation_settings(request({"top_k": 5}), 8, state)
    assert (got["temperature"], got["top_k"], got["repetition_penalty"]) == (0.6, 5, 1.1)
    assert "no_repeat_ngram_size" not in got


def test_chat_messages_as_vllm_renders_them():
    """Text parts (text, input_text, output_text) joined by newlines; echo answers the last message first when it
    has the answer's role (the assistant's, or the last message's own with add_generation_prompt=false), and a
    chat echo asks the prompt's log-probabilities (top_logprobs of them, 0 unset) unless streamed."""
    from hf_paged.integrations.server.intake import answer_role, chat_echo
    parts = request({"messages": [{"role": "user", "content": [{"type": "text", "text": "w3"},
                                                                {"type": "input_text", "text": "w4"}]}]}, chat=True)
    assert parts.messages[0].text() == "w3\nw4"
    turn = [{"role": "user", "content": "w3"}, {"role": "assistant", "content": "w5 w6"}]
    assert chat_echo(request({"messages": turn, "echo": True}, chat=True)) == "w5 w6"
    assert chat_echo(request({"echo": True}, chat=True)) == ""                  # the last message is the user's
    user_turn = request({"echo": True, "add_generation_prompt": False}, chat=True)
    assert chat_echo(user_turn) == "w3 w4" and answer_role(user_turn) == "user"
    assert chat_echo(request({"messages": turn}, chat=True)) == ""
    assert call_options(request({"messages": turn, "echo": True}, chat=True)).prompt_logprobs == 0
    assert call_options(request({"messages": turn, "echo": True, "logprobs": True, "top_logprobs": 2},
                                chat=True)).prompt_logprobs == 2
    assert call_options(request({"messages": turn, "echo": True, "stream": True}, chat=True)).prompt_logprobs is None


def test_the_generation_configs_max_new_tokens_is_the_default_only():
    """vLLM's current rule: the generation config's max_new_tokens is the max_tokens of a request that gives none
    (chat without max_tokens), not a cap on one that does; a completion's max_tokens null is its default, 16
    (vLLM 0.32's ``normalize_null_max_tokens``)."""
    from transformers import GenerationConfig

    from hf_paged.integrations.server.intake import requested_max_tokens, sampling_params
    state = fake_state()
    state.defaults, state.base = SamplingDefaults(max_tokens=7), GenerationConfig(eos_token_id=1)

    def new_tokens(body, chat=False):
        req = request({"temperature": 0, **body}, chat)
        return asyncio.run(sampling_params(state, req, [[3, 4]], requested_max_tokens(req))).max_new_tokens

    assert new_tokens({"max_tokens": 30}) == 30 and new_tokens({}) == 16 and new_tokens({"max_tokens": None}) == 16
    assert new_tokens({}, chat=True) == 7 and new_tokens({"max_tokens": 30}, chat=True) == 30


def test_what_clients_send_at_the_edges_reads_as_vllm_reads_it():
    """A prompt of exactly max_model_len tokens with echo and max_tokens 0 (lm-eval's full-length
    loglikelihood windows) is checked as 0 new tokens and runs one; "model": "" is the served model; any
    role reaches the template, tool results too; an image part is refused as such, by name."""
    from hf_paged.integrations.server.intake import sampling_params
    state = fake_state()
    state.base = None
    full = [3] * state.max_model_len
    req = request({"echo": True, "max_tokens": 0, "logprobs": 1})
    assert asyncio.run(sampling_params(state, req, [full], requested_max_tokens(req))).max_new_tokens == 1
    with pytest.raises(ApiError, match=r"the prompt \(128 tokens\) fills the model's context of 128"):
        req = request({"max_tokens": 1})
        asyncio.run(sampling_params(state, req, [full], requested_max_tokens(req)))
    # max_tokens past the room a prompt leaves runs to the context's end (vLLM's get_max_tokens trims it; the
    # engine stops each sequence there); past the whole context it is refused, as vLLM refuses it
    req = request({"max_tokens": 128})
    assert asyncio.run(sampling_params(state, req, [[3] * 100], requested_max_tokens(req))).max_new_tokens == 128
    with pytest.raises(ApiError, match=r"max_tokens=129 exceeds the model's context of 128") as err:
        req = request({"max_tokens": 129})
        asyncio.run(sampling_params(state, req, [[3, 4]], requested_max_tokens(req)))
    assert err.value.param == "max_tokens"
    req = request({"max_tokens": 1})
    state.engine.never_fits = lambda prompt_len, params: "why not"      # refused before a stream's status line
    with pytest.raises(ApiError, match="why not") as err:
        asyncio.run(sampling_params(state, req, [[3, 4]], requested_max_tokens(req)))
    assert err.value.status == 400
    assert request({"model": ""}).model == ""
    with pytest.raises(ApiError, match="does not exist") as err:
        request({"model": "other"})
    assert err.value.status == 404
    assert request({"messages": [{"role": "narrator", "content": "w3"}]}, chat=True).messages[0].role == "narrator"
    assert request({"messages": [{"role": "tool", "tool_call_id": "c", "content": "w3"}]}, chat=True).messages[0].role \
        == "tool"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    with pytest.raises(ApiError, match="part 1 has type 'image_url': this server runs text-only models") as err:
        request({"messages": [{"role": "user", "content": [{"type": "text", "text": "w3"}, image]}]}, chat=True)
    assert err.value.param == "messages.0.content"


def test_n_beyond_max_num_seqs_runs_as_parts_seeded_as_one_request():
    from dataclasses import replace

    from hf_paged.engine.settings import resolve_generation
    from hf_paged.integrations.server.call import engine_parts
    from transformers import GenerationConfig
    params = resolve_generation(GenerationConfig(eos_token_id=1), max_new_tokens=4, num_return_sequences=10,
                                do_sample=True, seed=100)
    assert engine_parts(params, 10) == [(0, params)]
    parts = engine_parts(params, 4)
    assert [(j0, p.num_return_sequences, p.seed) for j0, p in parts] == [(0, 4, 100), (4, 4, 104), (8, 2, 108)]
    assert all(replace(p, num_return_sequences=10, seed=100) == params for _, p in parts)
    unseeded = engine_parts(replace(params, seed=None), 3)
    assert [p.seed for _, p in unseeded] == [None] * 4 and sum(p.num_return_sequences for _, p in unseeded) == 10


def test_a_client_gone_while_sending_its_body_is_a_quiet_499():
    """Starlette's ClientDisconnect escaped ``read_body`` and was logged as an internal error (with uvicorn's
    traceback); now it is an ApiError nobody reads, which the handlers do not log."""
    from starlette.requests import ClientDisconnect

    from hf_paged.integrations.server.body import read_body

    class Gone:
        headers: dict = {}

        async def stream(self):
            yield b'{"prompt": '
            raise ClientDisconnect()

    with pytest.raises(ApiError) as err:
        asyncio.run(read_body(Gone(), 1000))
    assert err.value.status == 499 and err.value.body()["error"]["code"] == "client_closed"


def test_choices_cut_by_the_text_release_their_engine_request():
    """Where the answer's text stops a sequence before the engine does (its TextStream found a stop string),
    the engine request is cancelled once all its sequences are done here, not run to max_tokens for nobody."""
    from dataclasses import replace

    from transformers import GenerationConfig

    from hf_paged.engine.outputs import TokenEvent
    from hf_paged.engine.settings import resolve_generation
    from hf_paged.integrations.server.call import ApiCall

    async def run():
        cancelled = []
        worker = SimpleNamespace(engine=SimpleNamespace(config=SimpleNamespace(max_num_seqs=8)),
                                 cancel=cancelled.append)
        params = resolve_generation(GenerationConfig(eos_token_id=1), max_new_tokens=8, num_return_sequences=2,
                                    do_sample=True)
        call = ApiCall(worker, word_tokenizer(), [[3, 4]], params, CallOptions(n=2, stops=("w7",)))
        deltas = [call._token(0, 0, TokenEvent(0, 0, 7, None))]
        assert deltas[0].reason == "stop" and cancelled == []        # sequence 1 still runs
        deltas.append(call._token(0, 1, TokenEvent(0, 1, 5, None)))
        assert deltas[1].reason is None and cancelled == []
        deltas.append(call._token(0, 1, TokenEvent(0, 1, 7, None)))
        assert deltas[2].reason == "stop" and cancelled == [call.handles[0, 0]]
        own = ApiCall(worker, word_tokenizer(), [[3, 4]], replace(params, num_return_sequences=1),
                      CallOptions(stops=("w7",)))
        assert own._token(0, 0, TokenEvent(1, 0, 7, "stop_string")).reason == "stop"
        assert len(cancelled) == 1                                   # the engine ended that one itself

    asyncio.run(run())


def test_a_context_the_kv_pool_lowered_is_named_with_what_raises_it():
    from hf_paged.integrations.server.intake import context_checked
    with pytest.raises(ApiError, match=r"max_tokens=100 exceeds the model's context of 64 tokens \(max_model_len, "
                                       r"lowered from the model's 512 to what the KV pool holds: "
                                       r"--kv-cache-memory-bytes, or --gpu-memory-utilization on a GPU, raises it\)"):
        context_checked([[3, 4]], 100, 64, model_len=512)
    with pytest.raises(ApiError, match=r"the prompt \(70 tokens\) exceeds the model's context of 64 tokens "
                                       r"\(max_model_len, lowered from the model's 512"):
        context_checked([[3] * 70], 4, 64, model_len=512)
    with pytest.raises(ApiError, match=r"of 64 tokens \(max_model_len\): no room"):     # the model's own: as before
        context_checked([[3] * 70], 4, 64)
