"""What a chat request's ``tools`` and ``tool_choice`` ask, as vLLM 0.32 serves them with
``--enable-auto-tool-choice --tool-call-parser hermes|llama3_json``.

- ``tool_choice`` "none" (or no tools): the template sees the tools, the answer is text.
- "auto" (the default with tools): the model writes what it likes; the parser reads calls out of it. Where a
  tool says ``"strict": true``, a call the model opens must be one of the tools with those arguments (a
  grammar: free text, each call in the parser's format).
- "required": the answer is one or more calls (hermes: calls only; llama3_json: text with at least one call).
- a named function (``{"type": "function", "function": {"name": ...}}``): the answer is one call of it.
The grammar for "required" and a named function constrains each call's name, and its arguments to the
tool's ``parameters`` where the tool is strict (else any JSON), as vLLM's structural tags do (its default
``VLLM_ENFORCE_STRICT_TOOL_CALLING``). Without the flags "auto" is refused as vLLM refuses it, and so are
"required" and named choices.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from hf_paged.engine.structured import StructuredOutput, ascii_digits, closed_objects

from .errors import ApiError
from .tool_parsers import HERMES, HERMES_END, HERMES_START, Parsed, parse

MAX_STRICT_TOOLS = 1000        # each a row item of llguidance's parser, which takes at most 2,000
NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def choice_error(tools, choice) -> tuple[str, str] | None:
    """vLLM's ``check_tool_usage`` (what any server refuses): (param, message), or None."""
    if tools == []:
        return "tools", ("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                         "entirely.")
    if choice is None or choice == "none":
        return None
    if tools is None:
        return "tool_choice", "When using `tool_choice`, `tools` must be set."
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        return "tool_choice", (f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" or "
                               "\"required\" are supported.")
    if isinstance(choice, dict):
        if choice.get("type", "function") != "function":
            return "tool_choice.type", (f"Invalid value for `tool_choice`: type {choice.get('type')!r}! Only named "
                                        f"function tools are supported. {NAMED_USAGE}")
        function = choice.get("function")
        if not isinstance(function, dict):
            return "tool_choice.function", f"Invalid value for `function`: `{function}` in `tool_choice`! {NAMED_USAGE}"
        if "name" not in function:
            return "tool_choice.function.name", f"Expected field `name` in `function` in `tool_choice`! {NAMED_USAGE}"
        name = function["name"]
        if not isinstance(name, str) or not name:
            return "tool_choice.function.name", (f"Invalid `name` in `function`: `{name}` in `tool_choice`! "
                                                 f"{NAMED_USAGE}")
        if all(tool["function"]["name"] != name for tool in tools):
            return "tool_choice", "The tool specified in `tool_choice` does not match any of the specified `tools`"
    return None


@dataclass(frozen=True)
class ToolUse:
    """A request's tool calling: ``parser`` (a tool_parsers kind), ``mode`` "auto", "required" or "named"
    (``name``: the function), ``tools`` (OpenAI function tools), ``single``: parallel_tool_calls is false
    (one call answered, the first)."""
    parser: str
    mode: str
    tools: tuple
    name: str | None = None
    single: bool = False

    def answer(self, text: str, engine_reason: str | None) -> tuple[dict, str | None]:
        """(the chat message's ``content`` / ``tool_calls``, the finish reason) for a whole answer, as vLLM's."""
        parsed = self.read(text)
        calls = parsed.calls[:1] if self.single else parsed.calls
        if self.mode != "auto":         # (no calls parsed: vLLM's message has no tool_calls key)
            reason = "tool_calls" if self.mode == "required" and engine_reason == "stop" else engine_reason
            return {"content": parsed.content or "", **({"tool_calls": calls} if calls else {})}, reason
        if calls:
            return {"content": parsed.content, "tool_calls": calls}, "tool_calls"
        return {"content": parsed.content}, engine_reason

    def read(self, text: str) -> Parsed:
        """The parser's calls and content, with vLLM's rule for content: blank beside calls is none, and so is
        the text of a required or named choice that made no call."""
        parsed = parse(self.parser, text)
        blank = parsed.content is None or not parsed.content.strip()
        if parsed.calls:
            return Parsed(parsed.calls, None if blank else parsed.content)
        return Parsed([], None if blank and self.mode != "auto" else parsed.content)

    def streamed(self, parser, text: str, last: bool) -> dict:
        """What ``text`` adds to a streamed answer read by ``parser`` (``tool_parsers.StreamParser``): its
        ``content`` and ``tool_calls`` deltas, with what the parser held back where ``text`` is the last; with
        ``single``, the first call's deltas only (vLLM's)."""
        out = parser.feed(text) or {}
        if last:
            for key, value in (parser.finish() or {}).items():
                out[key] = out.get(key, "" if key == "content" else []) + value
        if self.single and "tool_calls" in out:
            out["tool_calls"] = [c for c in out["tool_calls"] if c["index"] == 0]
            if not out["tool_calls"]:
                del out["tool_calls"]
        return out

    def stream_reason(self, called: bool, engine_reason: str | None) -> str | None:
        """A stream's finish reason: "tool_calls" where calls were streamed and the choice is not named."""
        return "tool_calls" if called and self.mode != "named" and engine_reason == "stop" else engine_reason

    def grammar(self) -> StructuredOutput | None:
        """The constraint on the answer, or None (auto without a strict tool, calls in parallel allowed). A call
        is written as vLLM's structural tags write it (hermes: ``<tool_call>``, optionally a newline, ``{"name":
        NAME, "arguments": ARGS}``, the same newline, ``</tool_call>``; llama3_json: ``{"name": NAME,
        "parameters": ARGS}``). The tools without a schema of their own share one rule (their names one
        terminal: llguidance's parser takes at most 2,000 alternatives in a row), each strict tool has its own."""
        strict_any = any(t["function"].get("strict") is True for t in self.tools)
        if self.mode == "auto" and not strict_any and not self.single:
            return None
        functions = [t["function"] for t in self.tools if self.mode != "named" or t["function"]["name"] == self.name]
        hermes = self.parser == HERMES
        opening = json.dumps('{"name": ')
        if hermes:                  # after <tool_call>: the body, with a newline on both sides or on neither
            body = f'{opening} fn "}}"'
            rest, trigger = f'("\\n" {body} "\\n" | {body}) {json.dumps(HERMES_END)}', HERMES_START
            call = f"{json.dumps(HERMES_START)} {rest}"
        else:                       # after {"name": (the trigger)
            rest, trigger = 'fn "}"', '{"name": '
            call = f"{opening} {rest}"
        rules = f"fn: {self._names_and_arguments(functions)}\n"
        if self.mode == "named" or (self.mode == "required" and hermes):       # calls only
            many = "+" if self.mode == "required" and not self.single else ""
            return StructuredOutput(grammar=f"start: call{many}\ncall: {call}\n{rules}")
        # text with calls in it, each opened by the trigger (at least one for "required"), as llguidance's
        # StructTag writes it; the text before a call is lazy: it ends at the trigger's first occurrence
        tags = ("tag+" if self.mode == "required" else "tag*") if not self.single else \
               ("tag" if self.mode == "required" else "tag?")
        text = f"TEXT: /(?s:.*)/ & ~/(?s:.*{_regex(trigger)}.*)/\ntrig[lazy]: /(?s:.*)/ {json.dumps(trigger)}"
        return StructuredOutput(grammar=f"start: {tags} tail\ntail: TEXT\n{text}\ntag: trig {rest}\n{rules}")

    def either(self, asked: StructuredOutput) -> StructuredOutput | None:
        """Under "auto" with a strict tool, a request's structured output as vLLM combines them: calls (as under
        "required") or the asked format. None where the format's kind does not combine (a lark or GBNF grammar:
        then the format applies alone, as vLLM's where its backend cannot combine them)."""
        fmt = _format_rule(asked)
        if fmt is None:
            return None
        calls = replace(self, mode="required").grammar().grammar.replace("start:", "calls:", 1)
        return StructuredOutput(grammar=f"start: calls | fmt\n{fmt}\n{calls}")

    def _names_and_arguments(self, functions: list[dict]) -> str:
        """Lark for ``NAME, "arguments": ARGS`` (llama3_json: ``"parameters"``) of any of ``functions``: the
        strict ones' arguments their parameters' schema, the others' any JSON (vLLM's)."""
        key = json.dumps(", " + json.dumps("arguments" if self.parser == HERMES else "parameters") + ": ")
        strict = [f for f in functions if f.get("strict") is True and f.get("parameters") is not None]
        if len(strict) > MAX_STRICT_TOOLS:
            raise ApiError(400, f"{len(strict)} strict tools: a grammar of calls takes at most {MAX_STRICT_TOOLS} "
                                "(each strict tool's arguments are a rule of their own); leave \"strict\" out of the "
                                "others", param="tools", code="invalid_request")
        loose = [f["name"] for f in functions if f not in strict]
        alternatives = [f"{json.dumps(json.dumps(f['name'], ensure_ascii=False))} {key} "
                        f"%json {json.dumps(closed_objects(f['parameters']))}" for f in strict]
        if loose:
            names = " | ".join(json.dumps(json.dumps(n, ensure_ascii=False)) for n in dict.fromkeys(loose))
            alternatives.append(f"loose {key} %json {{}}")
            return " | ".join(alternatives) + f"\nloose: LOOSE\nLOOSE: {names}"
        return " | ".join(alternatives)


def _format_rule(asked: StructuredOutput) -> str | None:
    """``asked`` as a lark rule ``fmt`` (JSON schemas closed as the json kind closes them), or None for a grammar."""
    kind = asked.kind
    if kind == "json":
        schema = json.loads(asked.json) if isinstance(asked.json, str) else asked.json
        return f"fmt: %json {json.dumps(closed_objects(schema))}"
    if kind == "json_object":
        return 'fmt: %json {"type": "object"}'
    if kind == "choice":
        return "fmt: FMT\nFMT: " + " | ".join(json.dumps(c) for c in asked.choice)
    if kind == "regex":
        return "fmt: FMT\nFMT: /" + ascii_digits(asked.regex).replace("/", "\\/") + "/"
    return None


def _regex(text: str) -> str:
    """``text`` as a literal in a lark regex (Rust syntax; ``/`` ends the regex)."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c for c in text)


def tool_use(req, parser: str | None, enabled: bool) -> ToolUse | None:
    """The request's tool calling (None: tool_choice "none" or no tools), or a 400 where the server was not
    started for it (vLLM's words: ``--enable-auto-tool-choice``, ``--tool-call-parser``)."""
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else None)
    if choice is None or choice == "none" or not req.tools:
        return None
    if not (enabled and parser):
        if choice == "auto":
            raise ApiError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                                "set", param="tool_choice", code="unsupported")
        what = f'function "{choice["function"]["name"]}"' if isinstance(choice, dict) else f'"{choice}"'
        raise ApiError(400, f"tool_choice={what} requires --tool-call-parser to be set (and --enable-auto-tool-choice)",
                       param="tool_choice", code="unsupported")
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    return ToolUse(parser, "named" if named else choice, tuple(req.tools), named, req.parallel_tool_calls is False)
