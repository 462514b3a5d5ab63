"""Structured output: a request's grammar (JSON schema, any JSON object, regex, choice, lark/GBNF)
compiled by llguidance (the grammar engine vLLM also uses) and applied as a token bitmask to logits.

Life of a constrained sequence: the server (any thread) calls ``GrammarCompiler.compile(spec)``, which
returns a cached immutable :class:`Grammar`; the engine thread gives the sequence ``grammar.matcher()``
and, each step, calls :func:`apply_masks` on the batch's logits before sampling, then
``matcher.accept(token)`` with the sampled token, and ends the sequence on the EOS that follows ``is_finished``.

EOS rule: the mask allows the compiler's ``eos_token_ids`` exactly when the grammar may end here (an
accepting state), and *only* them once it must end (``is_finished``: nothing can follow, e.g. after a
JSON object's closing brace or a complete choice). So decoding a finished object emits EOS: the engine
ends a sequence on it, as vLLM's does (the EOS counted as a token, its text left out), or at once where the
request stops on no EOS (``ignore_eos``). ``accept`` of an EOS id after the end is a no-op.

llguidance is imported inside functions only, so ``import hf_paged`` works without it.
"""
from __future__ import annotations

import json as _json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

INSTALL_HINT = 'structured output needs llguidance: pip install llguidance (or pip install "hf-paged[serve]")'
KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _llguidance():
    """The ``llguidance`` module (and its ``hf`` helpers), or an ImportError naming the install command."""
    try:
        import llguidance  # noqa: PLC0415  (optional dependency, imported on first use)
        import llguidance.hf  # noqa: PLC0415, F401
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return llguidance


@dataclass(frozen=True)
class StructuredOutput:
    """What a request asks for, as vLLM's ``StructuredOutputsParams``: exactly one of

    - ``json``: a JSON schema, a dict or its JSON text; strict as vLLM's: an object schema that names its
      properties allows no others unless it says so (``closed_objects``);
    - ``json_object``: any JSON object;
    - ``regex``: Rust regex syntax, matched in full; ``\\d`` / ``\\D`` are ASCII digits / not them, as in
      vLLM's default backend (``ascii_digits``: in Rust's and Python's own syntax ``\\d`` is any Unicode
      digit, and SmolLM2 once wrote a phone number in U+1FBF8 digits for it);
    - ``choice``: exactly one of these strings (a non-empty list or tuple);
    - ``grammar``: llguidance's lark syntax; GBNF (``root ::= ...`` rules) is converted to lark first
      (llguidance's own ``gbnf_to_lark``: its lark parser alone rejects ``::=``).
    JSON may have whitespace wherever JSON allows it, as vLLM's default; ``disable_any_whitespace`` (vLLM's
    option) makes it compact: ``", "`` and ``": "`` separators, no other whitespace. ``after_token``: the grammar
    waits for this token id (a reasoning model's ``</think>``, as vLLM's reasoning parsers gate structured
    output): nothing is masked until the sequence generates it, and the grammar applies from the next token;
    ``from_token``: a token that ends the wait too, taken as the grammar's first (qwen3's ``<tool_call>``).
    """
    json: object = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    after_token: int | None = None
    from_token: int | None = None

    def _set(self) -> list[str]:
        return [k for k in KINDS
                if (self.json_object is not False if k == "json_object" else getattr(self, k) is not None)]

    def validate(self) -> None:
        """Raise ValueError unless exactly one kind is set, with a value of the right type."""
        kinds = self._set()
        if len(kinds) != 1:
            raise ValueError(f"structured output needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(kinds) if kinds else 'none'}")
        kind = kinds[0]
        for name in ("after_token", "from_token"):
            token = getattr(self, name)
            if token is not None and (not isinstance(token, int) or isinstance(token, bool) or token < 0):
                raise ValueError(f"structured output {name} must be a token id, got {token!r}")
        value = getattr(self, kind)
        if kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) for c in value):
                raise ValueError("structured output choice must be a non-empty list of strings")
        elif kind == "json_object":
            if value is not True:
                raise ValueError("structured output json_object must be True or False")
        elif kind == "json":
            if not isinstance(value, (dict, str)):
                raise ValueError("structured output json must be a JSON schema: a dict or its JSON text")
        elif not isinstance(value, str):
            raise ValueError(f"structured output {kind} must be a string")

    @property
    def kind(self) -> str:
        """The one field set: ``json``, ``json_object``, ``regex``, ``choice`` or ``grammar``."""
        self.validate()
        return self._set()[0]

    def cache_key(self) -> tuple[str, str, bool]:
        """A hashable key (kind, text, compact JSON), equal for equal specs (a schema's text and its dict agree;
        key order counts, since it is the order llguidance generates properties in). Validates first."""
        kind = self.kind
        compact = bool(self.disable_any_whitespace) and kind in ("json", "json_object")
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as exc:
                    raise ValueError(f"structured output json: not valid JSON: {exc}") from None
            return kind, _json.dumps(schema), compact
        if kind == "choice":
            return kind, _json.dumps(list(self.choice)), compact
        return kind, "" if kind == "json_object" else getattr(self, kind), compact


# JSON-schema keywords whose values are schemas (a map of them, a list of them, or one or a list); allOf is left
# as it is: its branches describe one object together, and closing each would forbid the others' keys
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
                "not", "if", "then", "else", "contains", "propertyNames")


def closed_objects(schema):
    """``schema`` with ``"additionalProperties": false`` on every object schema that lists ``properties`` or
    ``patternProperties`` and says nothing of others: vLLM's JSON schemas are strict (its default backend's
    strict mode), so a model writes the keys the schema names and no others. An explicit
    ``additionalProperties`` is kept; values (``const``, ``enum``, ``default``) are never touched, and neither
    is an ``allOf`` or an object schema beside one (its branches name its keys together)."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_objects(sub) for name, sub in closed[key].items()}
    for key in _SCHEMA_LISTS + _SCHEMA_ONES:
        value = closed.get(key)
        if isinstance(value, list):
            closed[key] = [closed_objects(sub) for sub in value]
        elif isinstance(value, dict):
            closed[key] = closed_objects(value)
    if "additionalProperties" not in closed and "allOf" not in closed \
            and ("properties" in closed or "patternProperties" in closed):
        closed["additionalProperties"] = False
    return closed


def ascii_digits(pattern: str) -> str:
    """``pattern`` with ``\\d`` as ``[0-9]`` (``0-9`` inside a class) and ``\\D`` as ``[^0-9]`` outside one:
    the ASCII digits vLLM's default grammar backend (xgrammar) reads them as. Escapes (``\\\\d``: a backslash
    and a d) and a class's leading ``]`` (a literal) are kept as they are."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            escaped = pattern[i + 1]
            if escaped == "d":
                out.append("0-9" if in_class else "[0-9]")
            elif escaped == "D" and not in_class:
                out.append("[^0-9]")
            else:
                out.append(c + escaped)
            i += 2
            continue
        out.append(c)
        i += 1
        if c == "[" and not in_class:
            in_class = True
            for lead in "^]":             # "[^" and a first "]" belong to the class's opening
                if pattern.startswith(lead, i):
                    out.append(lead)
                    i += 1
        elif c == "]" and in_class:
            in_class = False
    return "".join(out)


class StructuredOutputUnavailable(ValueError):
    """Structured output cannot run with this engine at all (no tokenizer, or one llguidance cannot read):
    the engine's limit, not the grammar's fault."""


def _eos_words(eos_token_ids, words: int) -> torch.Tensor:
    """An int32 bitmask row [words] allowing only ``eos_token_ids`` (bit t % 32 of word t // 32)."""
    row = [0] * words
    for t in eos_token_ids:
        row[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in row], dtype=torch.int32)


def _text_tokenizer(llg, tokenizer, vocab_size: int, eos: list[int]):
    """llguidance's tokenizer over ``vocab_size`` ids in which only the tokenizer's *special* added tokens are
    special, as Hugging Face reads them (``decode(skip_special_tokens=True)`` keeps the others' text).

    llguidance's own ``from_tokenizer`` marks every added token special, Qwen's ``<tool_call>`` and ``<think>``
    too: a grammar's text never matches them, yet its forced-text path tokenizes the text into them, so the
    mask allowed a token that ``consume_token`` refused (a choice or regex starting "<tool_call>" ended after it).
    Here the others are text, and grammar text is tokenized with the special tokens split into pieces (text
    is text; a special token is reachable only by llguidance's token reference, ``<|im_end|>`` in lark)."""
    from copy import copy  # noqa: PLC0415

    base = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    backend = copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    backend.encode_special_tokens = True
    text = {i for i, t in backend.get_added_tokens_decoder().items() if not t.special}
    # llguidance's special ids less the text ones (ids past the tokenizer's stay special: never allowed)
    special = [i for i in range(vocab_size) if base.is_special_token(i) and i not in text]

    class Wrapper:                      # llguidance.TokenizerWrapper's fields and call
        eos_token_id = eos[0]
        bos_token_id = None
        tokens = [base.decode_bytes([i]) for i in range(vocab_size)]
        special_token_ids = special

        def __call__(self, data: bytes) -> list[int]:
            try:
                return backend.encode(data.decode("utf-8"), add_special_tokens=False).ids
            except UnicodeDecodeError as bad:      # an incomplete UTF-8 tail: its bytes greedily
                return (backend.encode(data[:bad.start].decode("utf-8"), add_special_tokens=False).ids
                        + base.greedy_tokenize(data[bad.start:]))

    return llg.LLTokenizer(llg.TokenizerWrapper(Wrapper()), n_vocab=vocab_size, eos_token=eos)


class GrammarCompiler:
    """Compiles :class:`StructuredOutput` specs for one model; build once per engine.

    Holds llguidance's tokenizer (~0.5 s to build) over ``vocab_size`` ids: the model's embedding rows,
    which may exceed ``len(tokenizer)``; ids without a token are never allowed. ``eos_token_ids`` are the
    ids the mask allows when the grammar may (or must) end. JSON's whitespace follows the spec's
    ``disable_any_whitespace``; a schema's ``x-guidance`` options override that. ``compile`` is thread-safe
    (a lock guards the LRU of ``cache_size`` grammars; compiling itself runs outside it); ``mask_threads`` sizes llguidance's mask-filling thread pool
    (None: its default, 80% of the CPUs).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int], *, cache_size: int = 64,
                 mask_threads: int | None = None):
        llg = _llguidance()
        if not eos_token_ids:
            raise ValueError("GrammarCompiler needs at least one EOS token id")
        if vocab_size < len(tokenizer) or max(eos_token_ids) >= vocab_size:
            raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {len(tokenizer)} ids or an EOS id")
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        try:
            self._tokenizer = _text_tokenizer(llg, tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        except (ValueError, TypeError, AttributeError) as exc:
            raise StructuredOutputUnavailable(
                f"structured output cannot use this tokenizer ({type(tokenizer).__name__}): llguidance reads "
                f"Hugging Face fast tokenizers whose decoder it knows (byte-level, metaspace, byte fallback) and "
                f"said: {exc}") from None
        self._limits = llg.LLParserLimits(verbose_errors=False)   # errors without the whole parser state
        self._executor = llg.LLExecutor(mask_threads)
        self._eos_row = _eos_words(self.eos_token_ids, (self.vocab_size + 31) // 32)
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> Grammar:
        """The compiled grammar of ``spec`` (the same object for an equal spec while cached; with
        ``after_token``, a gated view of it).

        Raises ValueError naming the kind, with llguidance's reason, for a spec it cannot compile.
        """
        grammar = self._compiled(spec)
        if spec.after_token is None and spec.from_token is None:
            return grammar
        return Grammar(self, grammar.kind, grammar._template, (spec.after_token, spec.from_token))

    def _compiled(self, spec: StructuredOutput) -> Grammar:
        key = spec.cache_key()
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = Grammar(self, key[0], self._template(*key))
        with self._lock:
            grammar = self._cache.setdefault(key, grammar)  # a racing compile of the same spec: first one wins
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _template(self, kind: str, text: str, compact: bool):
        """A fresh llguidance ``LLMatcher`` for one spec (building it is the compile step)."""
        llg = _llguidance()
        try:
            if kind in ("json", "json_object"):
                schema = _json.dumps(closed_objects(_json.loads(text))) if kind == "json" else '{"type": "object"}'
                options = ({"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
                           if compact else {})
                grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            elif kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(ascii_digits(text))
            elif kind == "choice":   # one lark terminal of JSON-escaped literals: a lexer DFA, however many
                # (as grammar rules, "start: a | b | ...", llguidance's parser refuses tokens past 2,000 alternatives)
                grammar = llg.LLMatcher.grammar_from_lark(
                    "start: CHOICE\nCHOICE: " + " | ".join(_json.dumps(c) for c in _json.loads(text)))
            else:                    # lark passes through; GBNF (``::=``) is converted to lark
                grammar = llg.grammar_from("grammar", text)
        except ValueError as exc:
            raise ValueError(f"structured output {kind}: llguidance cannot compile it: {exc}") from None
        matcher = llg.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            reason = matcher.get_error().replace("<non-verbose/>", "").strip()
            raise ValueError(f"structured output {kind}: llguidance cannot compile it: {reason}")
        return matcher


class Grammar:
    """One compiled spec; immutable, shared by every sequence (and thread) that uses it. ``wait``: (after, from)
    tokens its matchers wait for before the grammar applies (``StructuredOutput.after_token`` / ``from_token``)."""

    def __init__(self, compiler: GrammarCompiler, kind: str, template, wait: tuple | None = None):
        self.kind = kind
        self.compiler = compiler
        self.wait = wait
        self._template = template     # never advanced: only deep-copied

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher for one sequence, at the grammar's start (a deep copy: microseconds)."""
        return GrammarMatcher(self, self._template.deep_copy(), self.wait)


class GrammarMatcher:
    """One sequence's position in its grammar. Not thread-safe: only the engine thread touches it.
    ``waiting``: the (after, from) tokens it waits for before the grammar applies (None: it applies)."""

    def __init__(self, grammar: Grammar, matcher, waiting: tuple | None = None):
        self.grammar = grammar
        self._matcher = matcher
        self.waiting = waiting

    def accept(self, token: int) -> None:
        """Advance by one sampled token; RuntimeError (with llguidance's reason) if the grammar refuses
        it, after which the matcher stays refused (``is_finished``). An EOS id after the end is a no-op.
        While waiting, any token is taken; an awaited one ends the wait (the ``from`` one is the grammar's first)."""
        if self.waiting is not None:
            after, first = self.waiting
            if token not in (after, first):
                return
            self.waiting = None
            if token == after:
                return
        if self._matcher.is_stopped() and token in self.grammar.compiler.eos_token_ids:
            return
        if not self._matcher.consume_token(int(token)):
            reason = self._matcher.get_error().replace("<non-verbose/>", "").strip()
            raise RuntimeError(f"token {token} is outside the {self.grammar.kind} grammar: {reason}")

    @property
    def is_finished(self) -> bool:
        """True once the sequence must end: nothing can follow (or EOS was accepted, or it erred)."""
        return self.waiting is None and self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """True when the output so far is complete (EOS allowed now), finished or not."""
        return self.waiting is None and self._matcher.is_accepting()

    def copy(self) -> GrammarMatcher:
        """An independent matcher at the same position (llguidance deep copy), for forked sequences."""
        return GrammarMatcher(self.grammar, self._matcher.deep_copy(), self.waiting)


def apply_masks(logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> None:
    """Set to -inf, in place, every token a row's matcher disallows; rows whose matcher is None stay as
    they are, and so do rows whose matcher waits (``GrammarMatcher.waiting``). ``logits``: float [S, V] with V
    the compiler's ``vocab_size``, on any device; all matchers come from one :class:`GrammarCompiler`.

    One int32 bitmask [rows with a matcher, ceil(V / 32)] is allocated on the CPU and filled by
    llguidance's thread pool (finished matchers get the EOS-only row), copied to ``logits``' device and
    applied by one masked fill. The bits are unpacked with plain torch ops: llguidance.torch's
    ``apply_token_bitmask_inplace`` is a ``torch.compile`` kernel (~30 s on its first CPU call).
    """
    if len(matchers) != logits.shape[0]:
        raise ValueError(f"{len(matchers)} matchers for {logits.shape[0]} logit rows")
    rows = [i for i, m in enumerate(matchers) if m is not None and m.waiting is None]
    if not rows:
        return
    compiler = matchers[rows[0]].grammar.compiler
    if any(matchers[i].grammar.compiler is not compiler for i in rows):
        raise ValueError("apply_masks needs matchers of grammars from one GrammarCompiler")
    if logits.shape[1] != compiler.vocab_size:
        raise ValueError(f"logits have {logits.shape[1]} columns, the grammars {compiler.vocab_size} token ids")
    words = (logits.shape[1] + 31) // 32
    bitmask = torch.empty((len(rows), words), dtype=torch.int32)
    pending = []
    for j, i in enumerate(rows):
        if matchers[i].is_finished:
            bitmask[j] = compiler._eos_row
        else:
            pending.append((matchers[i]._matcher, j))
    if pending:   # what llguidance.torch.fill_next_token_bitmask_par does, without importing torch.compile
        compiler._executor.unsafe_compute_mask_ptr(pending, bitmask.data_ptr(), words * 4, len(rows))
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1        # [R, words, 32]
    disallowed = (bits.view(len(rows), words * 32)[:, :logits.shape[1]] == 0)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(disallowed, float("-inf"))
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(disallowed, float("-inf"))
