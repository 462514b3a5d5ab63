"""Structured output on the real SmolLM2-135M, through the engine (``structured_output=``) and through
``hf-paged serve`` (``response_format``, ``structured_outputs``, the older ``guided_*`` names): every
output parses and validates, streamed or whole, in batches mixed with unconstrained requests — whose
tokens the masks of their neighbours do not change — and a grammar that cannot compile answers 400."""
from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from hf_paged.engine import LLM  # noqa: E402
from hf_paged.engine.structured import StructuredOutput  # noqa: E402
from hf_paged.integrations.server import create_app  # noqa: E402
from live_server import running  # noqa: E402

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
ITEMS = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "what": {"enum": ["apple", "pear", "bread"]}, "count": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["what", "count"], "additionalProperties": False}, "minItems": 1, "maxItems": 3},
    "paid": {"type": "boolean"}}, "required": ["items", "paid"], "additionalProperties": False}
PHONE = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral"]
GRAMMAR = 'root ::= "Answer: " ("yes" | "no") "."'


def chat(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


@pytest.fixture(scope="module")
def real(smollm2):
    return smollm2.load_smollm2()


def test_engine_mixed_batch_is_valid_and_leaves_neighbours_alone(real):
    model, tokenizer = real
    llm = LLM(model, tokenizer, max_num_seqs=8)
    free = [chat(tokenizer, "Name three colours."), chat(tokenizer, "What is 2 + 2?")]
    alone = llm.generate(free, max_new_tokens=64, do_sample=False)
    specs = [StructuredOutput(json=PERSON), StructuredOutput(json=ITEMS), StructuredOutput(regex=PHONE),
             StructuredOutput(choice=tuple(CHOICES)), StructuredOutput(grammar=GRAMMAR),
             StructuredOutput(json_object=True)]
    asks = ["Give a person as JSON.", "A shopping list as JSON.", "A phone number.", "Is 'great film' positive?",
            "Is the sky blue?", "A JSON object describing a dog with two keys."]
    prompts = [chat(tokenizer, a) for a in asks] + free
    settings = [dict(structured_output=s, max_new_tokens=128) for s in specs] + [{}, {}]   # JSON with its newlines
    outs = llm.generate(prompts, settings, max_new_tokens=64, do_sample=False)
    texts = [o.outputs[0].text for o in outs]
    jsonschema.validate(json.loads(texts[0]), PERSON)
    jsonschema.validate(json.loads(texts[1]), ITEMS)
    assert re.fullmatch(PHONE, texts[2]) and texts[3] in CHOICES and re.fullmatch(r"Answer: (yes|no)\.", texts[4])
    if outs[5].outputs[0].finish_reason == "stop":       # an open-ended object may run to the cap
        assert isinstance(json.loads(texts[5]), dict)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[:5])
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos)
    assert all(o.outputs[0].token_ids[-1] in eos for o in outs[:5])      # as vLLM's: ends on the EOS, counted
    bare = llm.generate([prompts[3]], structured_output=specs[3], max_new_tokens=16, do_sample=False,
                        ignore_eos=True)[0].outputs[0]                    # no EOS to end on: ends with the grammar
    assert bare.text == texts[3] and bare.token_ids == outs[3].outputs[0].token_ids[:-1]
    for mixed, solo in zip(outs[6:], alone):
        assert mixed.outputs[0].token_ids == solo.outputs[0].token_ids
    sampled = llm.generate([prompts[0]], structured_output=StructuredOutput(json=PERSON), num_return_sequences=3,
                           do_sample=True, seed=3, temperature=1.0, max_new_tokens=128)[0]
    for seq in sampled.outputs:
        jsonschema.validate(json.loads(seq.text), PERSON)


def test_a_grammar_ends_on_any_of_its_eos_ids_whatever_the_request_stops_on(real):
    """The mask after a grammar's end allows every EOS id the compiler knows (the model's generation config's);
    a request stopping on only one of them still ends there, not at max_new_tokens on repeated EOS."""
    model, tokenizer = real
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [eos, 0] if isinstance(eos, int) else list(eos) + [0]
    try:
        llm = LLM(model, tokenizer)
        alone = [chat(tokenizer, "Is the sky blue?")]
        for stops_on in (None, 0, model.generation_config.eos_token_id[0]):
            extra = {} if stops_on is None else {"eos_token_id": stops_on}
            out = llm.generate(alone, structured_output=StructuredOutput(choice=("yes", "no")), max_new_tokens=12,
                               do_sample=False, **extra)[0].outputs[0]
            assert out.finish_reason == "stop" and out.text in ("yes", "no"), (stops_on, out)
            assert len(out.token_ids) <= 3 and out.token_ids[-1] in model.generation_config.eos_token_id
    finally:
        model.generation_config.eos_token_id = eos


def test_a_choice_among_thousands(real):
    """A choice is one lexer terminal: llguidance's parser refuses tokens once a rule has over 2,000
    alternatives (the answer was then cut short and not one of the choices)."""
    model, tokenizer = real
    choices = tuple(f"option {i}" for i in range(5000))
    out = LLM(model, tokenizer).generate([chat(tokenizer, "Pick an option.")], max_new_tokens=8, do_sample=False,
                                         structured_output=StructuredOutput(choice=choices))[0].outputs[0]
    assert out.text in choices and out.finish_reason == "stop"


def test_schemas_are_strict_as_vllms(real):
    """vLLM's JSON schemas allow no keys beyond those an object schema names (xgrammar's strict mode): without
    it the model added keys ("location") and, through $ref, ran to max_tokens adding points (not JSON)."""
    from hf_paged.engine.structured import closed_objects
    point = {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]}
    cat = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
           "required": ["name", "age"]}
    points = {"$defs": {"pt": point}, "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"},
                                                                       "b": {"$ref": "#/$defs/pt"}},
              "required": ["a", "b"]}
    assert closed_objects(cat)["additionalProperties"] is False
    assert closed_objects({**cat, "additionalProperties": True})["additionalProperties"] is True
    assert "additionalProperties" not in closed_objects({"type": "object"})       # names nothing: stays open
    both = {"allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                      {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    assert closed_objects(both) == both              # closing the branches would forbid each other's keys
    valued = {"type": "object", "properties": {"c": {"const": {"properties": 1}}}}
    assert closed_objects(valued)["properties"]["c"] == {"const": {"properties": 1}}      # values stay as given
    model, tokenizer = real
    llm = LLM(model, tokenizer)
    llm.engine.compile_grammar(StructuredOutput(json=both))                      # compiles (it answered 400)
    outs = llm.generate([chat(tokenizer, "Output JSON.")] * 2, [
        dict(structured_output=StructuredOutput(json=cat)), dict(structured_output=StructuredOutput(json=points))],
        max_new_tokens=120, do_sample=False)
    for out, schema in zip(outs, (cat, points)):
        value = json.loads(out.outputs[0].text)
        jsonschema.validate(value, closed_objects(schema))
        assert set(value) == set(schema["properties"]) and out.outputs[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def client(real):
    model, tokenizer = real
    app = create_app(model, tokenizer, served_model_name="smollm2", max_num_seqs=8, kv_cache_memory_bytes=2**27)
    with running(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_server_structured_fields_on_both_endpoints(client):
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "A person, as JSON."}],
                                       response_format=person, max_tokens=64, temperature=0)
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "A dog, in JSON."}],
                                       response_format={"type": "json_object"}, max_tokens=48, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model="smollm2", prompt="Sentiment of 'awful':", max_tokens=8, temperature=0,
                                  extra_body={"structured_outputs": {"choice": CHOICES}})
    assert r.choices[0].text in CHOICES
    r = client.completions.create(model="smollm2", prompt="Call me at", max_tokens=12, temperature=0,
                                  extra_body={"guided_regex": PHONE})
    assert re.fullmatch(PHONE, r.choices[0].text)
    stream = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "A list."}],
                                            extra_body={"guided_json": ITEMS}, max_tokens=80, temperature=0.7,
                                            seed=4, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), ITEMS)
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Sky blue?"}],
                                       max_tokens=12, temperature=0, extra_body={"structured_outputs": {"grammar": GRAMMAR}})
    assert re.fullmatch(r"Answer: (yes|no)\.", r.choices[0].message.content)


def test_structured_output_through_messages_and_responses(client):
    """Anthropic's ``output_config.format`` and the Responses API's ``text.format``: the chat answer's JSON."""
    ask = [{"role": "user", "content": "A person, as JSON."}]
    expected = client.chat.completions.create(model="smollm2", messages=ask, max_tokens=64, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}).choices[0].message.content
    jsonschema.validate(json.loads(expected), PERSON)
    r = client.responses.create(model="smollm2", input=ask, max_output_tokens=64, temperature=0,
                                text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    assert r.output_text == expected and r.status == "completed"
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    got = httpx.post(base + "/v1/messages", timeout=120, json={
        "model": "smollm2", "max_tokens": 64, "temperature": 0, "messages": ask,
        "output_config": {"format": {"type": "json_schema", "schema": PERSON}}}).json()
    assert got["content"][0]["text"] == expected and got["stop_reason"] == "end_turn"


def test_server_refuses_a_grammar_that_cannot_compile(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="smollm2", prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "[0-9"}})
    assert "regex" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="smollm2", prompt="x", max_tokens=4,
                                  extra_body={"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}})
    assert "json" in str(err.value)


def test_a_tokenizer_llguidance_cannot_read_is_the_engines_limit_not_the_grammars():
    """A word-level tokenizer without a decoder: the offline engine raises StructuredOutputUnavailable (a
    ValueError) naming the tokenizer, and the server answers 400 ``unsupported``, not ``invalid_grammar``."""
    from hf_paged.engine.structured import StructuredOutputUnavailable  # noqa: PLC0415
    from tiny_models import make_model, word_tokenizer  # noqa: PLC0415

    model, tokenizer = make_model("llama", seed=1), word_tokenizer()
    llm = LLM(model, tokenizer, num_blocks=32)
    with pytest.raises(StructuredOutputUnavailable, match="cannot use this tokenizer .*decoder"):
        llm.generate(["w5 w6"], structured_output=StructuredOutput(regex="w[0-9]"), max_new_tokens=3)
    with pytest.raises(StructuredOutputUnavailable, match="needs a tokenizer"):
        LLM(model, num_blocks=32).generate([[5, 6]], structured_output=StructuredOutput(regex="w[0-9]"),
                                           max_new_tokens=3)
    app = create_app(model, tokenizer, served_model_name="tiny", num_blocks=32)
    with running(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tiny", prompt="w5", max_tokens=4, extra_body={"guided_regex": "w[0-9]"})
        assert err.value.body["code"] == "unsupported" and "tokenizer" in err.value.body["message"]
        assert client.completions.create(model="tiny", prompt="w5", max_tokens=2).choices[0].text   # still serving
