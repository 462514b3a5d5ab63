"""``hf_paged.SamplingParams``: a vLLM script's ``llm.generate(prompts, SamplingParams(...))`` and ``llm.chat``
run as they are: vLLM's defaults whatever the model's generation config says, vLLM's text (no stop string,
no stop token's text unless include_stop_str_in_output) and finish reasons; a vLLM SamplingParams object is
read by its attributes."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import hf_paged
from hf_paged import SamplingParams
from tiny_models import make_model, word_tokenizer

PROMPT = "w5 w6 w7"


@pytest.fixture
def llm():
    return hf_paged.LLM(make_model("llama", seed=4), word_tokenizer())


def greedy(llm, **settings):
    return llm.generate([PROMPT], max_new_tokens=8, do_sample=False, ignore_eos=True, repetition_penalty=1.0,
                        **settings)[0].outputs[0]


def test_stop_strings_and_tokens_leave_the_text_as_vllms(llm):
    free = greedy(llm)
    words = free.text.split()
    stop = words[2]
    got = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=["zz", stop]))
    out = got[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)          # vLLM's "stop", not "stop_string"
    assert out.text == free.text[:free.text.index(stop)]
    kept = llm.generate([PROMPT], sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                                 stop=stop, include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == free.text[:free.text.index(stop) + len(stop)]
    token = free.token_ids[3]
    first = free.token_ids.index(token)
    ended = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                  stop_token_ids=[token]))[0].outputs[0]
    assert ended.token_ids == free.token_ids[:first + 1] and ended.stop_reason == token
    assert ended.text == llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=first, ignore_eos=True)
                                      )[0].outputs[0].text                 # the stop token's text left out


def test_vllms_defaults_not_the_generation_configs(llm):
    """Unset fields are vLLM's (16 tokens, temperature 1.0, no repetition penalty), not the model's config."""
    llm.engine.model.generation_config.repetition_penalty = 1.8
    llm.engine.model.generation_config.max_new_tokens = 3
    out = llm.generate([PROMPT], SamplingParams(temperature=0, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 16
    assert out.token_ids[:8] == greedy(llm).token_ids
    a, b = (llm.generate([PROMPT], SamplingParams(seed=3, max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids
            for _ in range(2))
    assert a == b


def test_a_vllm_object_is_read_by_its_attributes(llm):
    fields = {f: getattr(SamplingParams(), f) for f in SamplingParams.__dataclass_fields__}
    vllm_like = SimpleNamespace(**{**fields, "temperature": 0.0, "max_tokens": 8, "ignore_eos": True, "best_of": None,
                                   "use_beam_search": False})
    assert llm.generate([PROMPT], vllm_like)[0].outputs[0].token_ids == greedy(llm).token_ids
    with pytest.raises(ValueError, match="use_beam_search=True is not supported"):
        llm.generate([PROMPT], SimpleNamespace(**{**fields, "use_beam_search": True}))
    with pytest.raises(ValueError, match=r"\['top_k'\] given beside SamplingParams"):
        llm.generate([PROMPT], SamplingParams(), top_k=3)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([PROMPT], [SamplingParams(), SamplingParams()])


def test_chat_runs_the_template_as_vllms(llm):
    tokenizer = llm.get_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                               "{% if add_generation_prompt %}w9{% endif %}")
    conversation = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7"}]
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert out.prompt == "w5 w6 w7 w9" and out.prompt_token_ids == tokenizer.encode("w5 w6 w7 w9",
                                                                                   add_special_tokens=False)
    same = llm.generate([{"prompt_token_ids": out.prompt_token_ids}], SamplingParams(temperature=0, max_tokens=4,
                                                                                      ignore_eos=True))[0]
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
    two = llm.chat([conversation, conversation[:1]], SamplingParams(temperature=0, max_tokens=2),
                   add_generation_prompt=False)
    assert [o.prompt for o in two] == ["w5 w6 w7 ", "w5 w6 "]


def test_generators_streams_and_vllms_structured_outputs_params(llm):
    from dataclasses import dataclass

    from hf_paged.engine.structured import StructuredOutput
    from hf_paged.integrations.vllm_params import structured_output

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate((p for p in [PROMPT, "w9"]), params)) == 2           # a generator is read once
    tokens = [e.token for e in llm.stream([PROMPT], params)]
    assert tokens == llm.generate([PROMPT], params)[0].outputs[0].token_ids

    @dataclass
    class StructuredOutputsParams:            # vLLM's, as a dataclass (not a mapping)
        json: object = None
        regex: str | None = None
        choice: list | None = None
        grammar: str | None = None
        json_object: bool | None = None
        disable_fallback: bool = False
        disable_any_whitespace: bool = False
        whitespace_pattern: str | None = None

    assert structured_output(StructuredOutputsParams(choice=["a", "b"])) == StructuredOutput(choice=("a", "b"))
    assert structured_output({"json": {"type": "object"}, "disable_fallback": True, "disable_any_whitespace": True}) \
        == StructuredOutput(json={"type": "object"}, disable_any_whitespace=True)
    with pytest.raises(ValueError, match="whitespace_pattern is not supported"):
        structured_output(StructuredOutputsParams(regex="a", whitespace_pattern=" "))
    fields = {f: getattr(SamplingParams(), f) for f in SamplingParams.__dataclass_fields__}
    with pytest.raises(ValueError, match="guided_decoding=.* is not supported"):      # an older vLLM's field
        llm.generate([PROMPT], SimpleNamespace(**fields, guided_decoding={"regex": "w5"}))
