"""Tool calls read out of a model's text, as vLLM 0.32's ``--tool-call-parser`` reads them: ``hermes``
(Qwen 2.5 / 3, Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, after optional
text) and ``llama3_json`` (Llama 3.1+: ``{"name": ..., "parameters": {...}}`` objects in the text).

``parse(kind, text)`` is vLLM's non-streaming ``extract_tool_calls`` (the same calls, content and fallbacks:
text that does not parse is content, no call); ``StreamParser`` turns a choice's text deltas into the
``delta`` objects of a chat stream (content, then each call's id and name, then its arguments as they come).
A call is ``{"id", "type": "function", "function": {"name", "arguments"}}``, arguments a JSON text.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from .config import TOOL_CALL_PARSERS as PARSERS

HERMES, LLAMA3_JSON = PARSERS
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
LLAMA_BOT = "<|python_tag|>"
_HERMES_CALLS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_DECODER = json.JSONDecoder()


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"                     # vLLM's make_tool_call_id


def tool_call(name, arguments: str) -> dict:
    """A call; a ``name`` that is no string raises TypeError, as vLLM's call model refuses it (the parser then
    leaves the whole text as content)."""
    if not isinstance(name, str):
        raise TypeError(f"a tool call's name must be a string, not {type(name).__name__}")
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class Parsed:
    """What a parser found: ``calls`` (possibly none) and the text that is content (None: none)."""
    calls: list[dict]
    content: str | None


def parse(kind: str, text: str) -> Parsed:
    """The calls in a whole answer (``kind``: one of PARSERS)."""
    return _hermes(text) if kind == HERMES else _llama3_json(text)


def _hermes(text: str) -> Parsed:
    if HERMES_START not in text:
        return Parsed([], text)
    try:
        found = [json.loads(a or b) for a, b in _HERMES_CALLS.findall(text)]
        calls = [tool_call(f["name"], json.dumps(f["arguments"], ensure_ascii=False)) for f in found]
    except Exception:          # vLLM's: a call that does not parse (or lacks a key) leaves the whole text as content
        return Parsed([], text)
    return Parsed(calls, text[:text.find(HERMES_START)] or None)


def _llama3_json(text: str) -> Parsed:
    if LLAMA_BOT not in text and "{" not in text:
        return Parsed([], text)
    calls, end = [], -1
    for match in re.finditer(r"\{", text):
        start = match.start()
        if start <= end:           # inside an object already read
            continue
        try:
            obj, length = _DECODER.raw_decode(text[start:])
            end = start + length
            arguments = obj["arguments"] if "arguments" in obj else obj["parameters"]
            calls.append(tool_call(obj["name"], json.dumps(arguments, ensure_ascii=False)))
        except Exception:          # vLLM's: any "{" that is not a call's object leaves the whole text as content
            return Parsed([], text)
    return Parsed(calls, None) if calls else Parsed([], text)


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (held back: a tag may be arriving)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _complete_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


@dataclass
class StreamParser:
    """One choice's stream. ``feed(delta_text)`` returns the delta object to send (``content`` and / or
    ``tool_calls``) or None; ``finish()`` whatever was held back, at the end. hermes streams as vLLM's
    parser does (each call's name once it is complete, then its arguments' text as written); llama3_json
    holds an answer that begins with a call (``{`` or ``<|python_tag|>``) to its end and sends its calls
    whole then (vLLM sends their arguments piece by piece), and streams any other answer as content."""
    kind: str
    text: str = ""
    sent_content: int = 0
    names: list[str] = field(default_factory=list)
    args_sent: list[str] = field(default_factory=list)
    calls_sent: int = 0

    def feed(self, delta: str) -> dict | None:
        self.text += delta
        return self._hermes_delta() if self.kind == HERMES else self._llama_delta(delta, final=False)

    def finish(self) -> dict | None:
        return None if self.kind == HERMES else self._llama_delta("", final=True)

    @property
    def called(self) -> bool:
        """A tool call was streamed."""
        return bool(self.names) or self.calls_sent > 0

    def _hermes_delta(self) -> dict | None:
        text = self.text
        start = text.find(HERMES_START)
        sendable = start if start >= 0 else len(text) - partial_tag(text, HERMES_START)
        content = None
        if sendable > self.sent_content:
            content, self.sent_content = text[self.sent_content:sendable], sendable
        deltas = []
        for i, (body, complete) in enumerate(self._hermes_bodies()):
            if i == len(self.names):
                name = re.search(r'"name"\s*:\s*"([^"]+)"', body)
                if not name:
                    break                  # call i's name is not whole yet: nothing of later calls either
                self.names.append(name.group(1))
                self.args_sent.append("")
                deltas.append({"index": i, "id": call_id(), "type": "function", "function": {"name": name.group(1)}})
            arguments = re.search(r'"arguments"\s*:\s*', body)
            if arguments:
                raw = body[arguments.end():]
                if complete:               # the object's own closing brace is not the arguments'
                    raw = raw.rstrip()
                    raw = raw[:-1].rstrip() if raw.endswith("}") else raw
                if len(raw) > len(self.args_sent[i]):
                    deltas.append({"index": i, "function": {"arguments": raw[len(self.args_sent[i]):]}})
                    self.args_sent[i] = raw
        out = {}
        if content:
            out["content"] = content
        if deltas:
            out["tool_calls"] = deltas
        return out or None

    def _hermes_bodies(self) -> list[tuple[str, bool]]:
        """(the JSON text, whether it is complete) of each ``<tool_call>`` so far."""
        bodies, pos, text = [], 0, self.text
        while (start := text.find(HERMES_START, pos)) >= 0:
            begin = start + len(HERMES_START)
            end = text.find(HERMES_END, begin)
            if end >= 0:
                bodies.append((text[begin:end].strip(), True))
                pos = end + len(HERMES_END)
                continue
            raw = text[begin:]
            raw = raw[:len(raw) - partial_tag(raw, HERMES_END)].strip()
            bodies.append((raw, bool(raw) and _complete_json(raw)))
            break
        return bodies

    def _llama_delta(self, delta: str, final: bool) -> dict | None:
        if not (self.text.startswith(LLAMA_BOT) or self.text.startswith("{")):
            if final or not delta:
                return None
            return {"content": delta}
        if not final:
            return None                    # a call's object: held to the end
        parsed = _llama3_json(self.text)
        if not parsed.calls:
            return {"content": self.text} if self.text else None
        self.calls_sent = len(parsed.calls)
        return {"tool_calls": [{"index": i, **call} for i, call in enumerate(parsed.calls)]}
