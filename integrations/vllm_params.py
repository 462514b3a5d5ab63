"""vLLM's ``SamplingParams`` for ``hf_paged.LLM``: its field names, its defaults and its text rules, so that
a vLLM script's ``llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, stop=["\\n"]))`` runs
as it is (a vLLM ``SamplingParams`` object is read the same way, by its attributes).

What differs from the engine's own settings (generate's names, the model's generation config under them):
- every field has vLLM's value when not given (temperature 1.0: sampling, top-k off, 16 new tokens, no
  repetition penalty), whatever the model's generation config says;
- the text leaves out a stop string and the stop token (EOS or ``stop_token_ids``) unless
  ``include_stop_str_in_output``, and keeps special tokens' text with ``skip_special_tokens=False``;
- ``finish_reason`` is vLLM's: "stop" for a stop string too (``stop_reason`` names it), "abort" for a
  cancelled request.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from hf_paged.engine.continuation import CONTEXT, complete_characters, continuation
from hf_paged.engine.stop_strings import StopStrings
from hf_paged.engine.structured import StructuredOutput

from .server.defaults import GREEDY_BELOW     # vLLM's _SAMPLING_EPS: a lower temperature is greedy


@dataclass
class SamplingParams:
    """vLLM's SamplingParams fields this engine runs, with vLLM's defaults (``max_tokens=None``: up to the
    context). ``structured_outputs``: a ``hf_paged.engine.structured.StructuredOutput`` or the same fields
    as a dict (vLLM's ``StructuredOutputsParams``)."""
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True       # only True (a slow tokenizer's option)
    detokenize: bool = True                           # False: no text (vLLM's "")
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: object = None

    @classmethod
    def read(cls, params) -> SamplingParams:
        """``params`` as this class: itself, or another object with vLLM's attribute names (vLLM's own
        SamplingParams), whose fields this engine does not run must keep their defaults."""
        if isinstance(params, cls):
            return params
        names = {f.name for f in fields(cls)}
        known = {name: getattr(params, name) for name in names if hasattr(params, name)}
        unsupported = {"best_of": None, "use_beam_search": False, "length_penalty": 1.0, "truncate_prompt_tokens": None,
                       "guided_decoding": None, "logits_processors": None}
        for name, default in unsupported.items():
            value = getattr(params, name, default)
            if value is not None and value != default and not (name == "best_of" and value == known.get("n", 1)):
                raise ValueError(f"SamplingParams.{name}={value!r} is not supported by hf_paged.LLM (leave it at "
                                 f"{default!r})")
        return cls(**known)

    def settings(self, tokenizer, vocab_size: int) -> dict:
        """The engine's settings (``Engine.add_request`` keywords), each given, so that none comes from the
        model's generation config (but its EOS ids, as vLLM's)."""
        if not isinstance(self.max_tokens, int) and self.max_tokens is not None:
            raise ValueError(f"max_tokens must be an int or None, got {self.max_tokens!r}")
        if not self.spaces_between_special_tokens:
            raise ValueError("spaces_between_special_tokens=False is not supported by hf_paged.LLM (fast tokenizers "
                             "decode special tokens as they are)")
        greedy = self.temperature < GREEDY_BELOW
        out = dict(max_new_tokens=self.max_tokens if self.max_tokens is not None else 2**31 - 1,
                   num_return_sequences=self.n, do_sample=not greedy, repetition_penalty=self.repetition_penalty,
                   presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                   min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, logprobs=self.logprobs,
                   prompt_logprobs=self.prompt_logprobs, logit_bias=self.logit_bias,
                   allowed_token_ids=self.allowed_token_ids, stop_token_ids=self.stop_token_ids,
                   stop_strings=[self.stop] if isinstance(self.stop, str) else list(self.stop or []) or None,
                   bad_words_ids=bad_words_ids(tokenizer, self.bad_words, vocab_size))
        if not greedy:       # (min_p 0 is left out: no warper, and no generation config sets one)
            out.update(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
                       min_p=self.min_p or None)
        if self.seed is not None:
            out["seed"] = self.seed
        so = self.structured_outputs
        if so is not None:
            out["structured_output"] = so if isinstance(so, StructuredOutput) else structured_output(so)
        return {k: v for k, v in out.items() if v is not None}


def structured_output(so) -> StructuredOutput:
    """vLLM's ``StructuredOutputsParams`` (its object or a dict of its fields) as the engine's StructuredOutput;
    options that would change the constraint and are not implemented are refused by name, the backend's own
    knobs (``disable_fallback``, ``disable_additional_properties``: schemas are strict here) left out."""
    def get(name):
        return so.get(name) if isinstance(so, Mapping) else getattr(so, name, None)
    for name in ("whitespace_pattern", "structural_tag"):
        if get(name) is not None:
            raise ValueError(f"structured_outputs.{name} is not supported by hf_paged.LLM")
    choice = get("choice")
    return StructuredOutput(json=get("json"), json_object=bool(get("json_object")), regex=get("regex"),
                            choice=None if choice is None else tuple(choice), grammar=get("grammar"),
                            disable_any_whitespace=bool(get("disable_any_whitespace")))


def bad_words_ids(tokenizer, words, vocab_size: int) -> list[list[int]] | None:
    """vLLM's rule (``SamplingParams.update_from_tokenizer``): each word, left-stripped, tokenized without
    special tokens; and with a leading space where that gives another first token and as many tokens."""
    if not words:
        return None
    if tokenizer is None:
        raise ValueError("bad_words need a tokenizer: hf_paged.LLM(model, tokenizer)")
    out = []
    for word in words:
        spellings = bad_word_spellings(lambda text: tokenizer.encode(text, add_special_tokens=False), word)
        if not spellings:
            raise ValueError(f"bad_words entry {word!r} tokenizes to no token")
        out += spellings
    return [ids for ids in out if all(t < vocab_size for t in ids)] or None


def bad_word_spellings(encode, word: str) -> list[list[int]]:
    """The token-id sequences vLLM bans for one bad word (``encode``: text -> ids without special tokens):
    the word left-stripped, and with a leading space where that gives another first token and as many
    tokens (the word in the middle of a text); [] when it tokenizes to nothing."""
    plain = encode(word.lstrip()) if word.strip() else []
    if not plain:
        return []
    spaced = encode(" " + word.lstrip())
    return [plain] + ([spaced] if spaced and spaced[0] != plain[0] and len(spaced) == len(plain) else [])


def as_vllm_output(output, params: SamplingParams, tokenizer, eos_ids: frozenset):
    """``output`` (a RequestOutput) with vLLM's text and finish reasons (see the module's docstring);
    ``eos_ids``: the EOS ids the engine stopped on."""
    if output.error is not None or tokenizer is None:
        return output
    stop_tokens = set(params.stop_token_ids or []) | (set() if params.ignore_eos else set(eos_ids))
    completions = []
    for seq in output.outputs:
        ids, reason = list(seq.token_ids), seq.finish_reason
        if reason == "stop" and ids and ids[-1] in stop_tokens and not params.include_stop_str_in_output:
            ids = ids[:-1]
        context = output.prompt_token_ids[-CONTEXT:]
        skip = params.skip_special_tokens
        text = complete_characters(continuation(tokenizer, context, ids, skip_special_tokens=skip))
        if reason == "stop_string":       # the first one that ends after the text of the first min_tokens tokens
            stops = StopStrings([params.stop] if isinstance(params.stop, str) else params.stop)
            after = len(continuation(tokenizer, context, ids[:params.min_tokens], skip_special_tokens=skip)) \
                if params.min_tokens else 0
            text = stops.cut(text, keep=params.include_stop_str_in_output, after=after)[0]
        if not params.detokenize:
            text = ""
        completions.append(replace(seq, text=text, finish_reason={"stop_string": "stop", "cancelled": "abort"}.get(
            reason, reason)))
    output.outputs = completions
    return output
