"""Reasoning parsers (``--reasoning-parser deepseek_r1|qwen3``): a reasoning model's thinking split off its answer,
as vLLM 0.32's parsers of these names split it (``tests/fixtures/vllm_reasoning_parsers.json`` holds what
vLLM's own classes make of a set of answers, whole and streamed).

Both read ``<think>...</think>``; an answer without ``</think>`` is all thinking (vLLM's rule: a model that never
closes its thinking has no answer yet). They differ where vLLM's do:

- ``deepseek_r1``: needs ``<think>`` and ``</think>`` as tokens of their own (vLLM refuses to start otherwise);
  text after the first ``</think>`` is the answer, verbatim; ``enable_thinking`` plays no part; the prompt's last
  marker decides whether thinking is over before the answer starts (a template that closes an empty think block).
- ``qwen3``: a ``<tool_call>`` inside the thinking ends it (the call is the answer's); ``<think>`` inside the
  thinking and a second ``</think>`` are dropped, and so is the text of special tokens; ``enable_thinking: false``
  (or ``reasoning_effort: "none"``) makes the whole answer content; while streaming, text that may begin a
  marker (``<``, ``</thi``) waits for the next delta.

A ``Reasoning`` is the server's parser for its tokenizer (built once, ``of``); ``for_request`` gives the parser of
one request (its template's ``enable_thinking``), whose ``split`` reads a whole answer and ``stream`` a streamed one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

START, END, TOOL = "<think>", "</think>", "<tool_call>"
# qwen3's terminals (vLLM's parser/qwen3.py): text that may begin one of them waits while thinking is streamed
QWEN3_TERMINALS = (START, END, TOOL, "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")
QWEN3_BOUNDARIES = ("<|im_start|>", "<|im_end|>")      # qwen3's backward scan of the prompt stops at a turn's edge


@dataclass(frozen=True)
class Reasoning:
    """The server's reasoning parser: ``kind`` (config.REASONING_PARSERS) and the ids of its markers in the
    tokenizer (None where a marker is not one token: qwen3 then reads text alone and never ends a prompt's or a
    grammar's wait). ``specials`` / ``special_ids``: the tokenizer's special tokens (qwen3 drops them)."""
    kind: str
    start: int | None
    end: int | None
    tool: int | None = None
    boundaries: frozenset = frozenset()
    specials: tuple = ()
    special_ids: frozenset = frozenset()

    @classmethod
    def of(cls, kind: str, tokenizer) -> Reasoning:
        """The parser ``kind`` for ``tokenizer``; RuntimeError in vLLM's words where deepseek_r1 finds no marker
        tokens."""
        vocab = tokenizer.get_vocab()
        start, end = vocab.get(START), vocab.get(END)
        if kind == "deepseek_r1" and (start is None or end is None):
            raise RuntimeError("DeepSeekR1ReasoningParser reasoning parser could not locate think start/end tokens "
                               "in the tokenizer!")
        if kind == "deepseek_r1":
            return cls(kind, start, end)
        specials = tuple(t for t in getattr(tokenizer, "all_special_tokens", ()) if t not in QWEN3_TERMINALS)
        return cls(kind, start, end, vocab.get(TOOL), frozenset(vocab[t] for t in QWEN3_BOUNDARIES if t in vocab),
                   specials, frozenset(vocab[t] for t in specials if t in vocab))

    def for_request(self, template_kwargs: dict) -> Reasoner:
        """One request's parser: ``template_kwargs``, the chat template's effective options (qwen3 reads
        ``enable_thinking``, True unless set)."""
        thinking = self.kind != "qwen3" or template_kwargs.get("enable_thinking", True) is not False
        return Reasoner(self, thinking)


@dataclass(frozen=True)
class Reasoner:
    """One request's reasoning parser (``thinking``: qwen3's enable_thinking)."""
    parser: Reasoning
    thinking: bool = True

    def ended(self, prompt: list[int]) -> bool:
        """Whether thinking is over before the answer starts (vLLM's ``is_reasoning_end`` on the prompt): the
        prompt's last marker is an end (qwen3: ``</think>`` or ``<tool_call>``, within the last turn; with thinking
        off, always)."""
        p = self.parser
        if p.kind == "qwen3" and not self.thinking:
            return True
        ends = {p.end, p.tool} - {None} if p.kind == "qwen3" else {p.end}
        for token in reversed(prompt):
            if token == p.start:
                return False
            if token in ends:
                return True
            if token in p.boundaries:
                break
        return False

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer; None for an empty part (deepseek_r1 keeps an empty thinking
        as "", as vLLM's)."""
        if self.parser.kind == "deepseek_r1":
            before, marker, after = text.partition(START)
            rest = after if marker else before
            if END not in rest:
                return rest, None
            reasoning, _, content = rest.partition(END)
            return reasoning, content or None
        if not self.thinking:
            return None, text
        reasoning, content = _qwen3(text, self.parser.specials)
        return reasoning or None, content or None

    def count(self, ids: list[int]) -> int:
        """The reasoning tokens among an answer's ``ids`` (vLLM's usage ``reasoning_tokens``): deepseek_r1's, those
        inside ``<think>``...``</think>`` of the answer itself; qwen3's, those before the end, markers and special
        tokens left out."""
        p = self.parser
        if p.kind == "deepseek_r1":
            count = depth = 0
            for token in ids:
                if token == p.start:
                    depth += 1
                elif token == p.end:
                    depth = max(depth - 1, 0)
                elif depth:
                    count += 1
            return count
        if not self.thinking:
            return 0
        count = 0
        for token in ids:
            if token in (p.end, p.tool):
                break
            count += token != p.start and token not in p.special_ids
        return count

    def stream(self, prompt: list[int], include: bool = True) -> ReasoningStream:
        """The parser of one streamed choice of ``prompt``; ``include``: the request's include_reasoning."""
        return ReasoningStream(self, ended=self.ended(prompt), include=include)


@dataclass
class ReasoningStream:
    """One streamed choice read delta by delta, as vLLM's ``parse_delta``: ``feed`` gives (reasoning, content) of a
    delta, each None for none; once thinking is over the text passes as content, as it comes."""
    reasoner: Reasoner
    ended: bool = False
    include: bool = True
    came: set = field(default_factory=set)         # the marker ids among the answer's ids before this delta
    held: str = ""                                 # qwen3: text that may begin a marker

    def feed(self, text: str, ids: list[int], last: bool = False) -> tuple[str | None, str | None]:
        if self.ended:                   # passed as it comes (an empty delta too, as vLLM's)
            return None, text
        parser = self.reasoner.parser
        if parser.kind == "deepseek_r1":
            reasoning, content = self._deepseek(text, ids)
            self.ended = parser.end in ids
        else:
            reasoning, content = self._qwen3(text, ids, last)
        p = self.reasoner.parser
        self.came |= {t for t in ids if t in (p.start, p.end, p.tool)}
        if not self.include:
            reasoning = None
        return reasoning, content

    def _deepseek(self, text: str, ids: list[int]) -> tuple[str | None, str | None]:
        """vLLM's DeepSeekR1ReasoningParser.extract_reasoning_streaming (a lone marker token: nothing; a delta
        that opens with ``<think>`` and does not close keeps its text, marker and all, as vLLM's)."""
        p = self.reasoner.parser
        if len(ids) == 1 and ids[0] in (p.start, p.end):
            return None, None
        if p.start not in self.came and p.start in ids and p.end in ids:
            start, end = text.find(START), text.find(END)
            return text[start + len(START):end], text[end + len(END):] or None
        end = text.find(END)
        if p.end in ids and end >= 0:
            return text[:end], text[end + len(END):] or None
        return text, None

    def _qwen3(self, text: str, ids: list[int], last: bool) -> tuple[str | None, str | None]:
        """qwen3's streamed thinking: markers read as in ``split``, but an end (``</think>``, ``<tool_call>``) only
        once its token came (vLLM's stream reads token ids: the text spelled in pieces is thinking); text that may
        begin a marker waits (to the end of the stream, where it goes out as thinking)."""
        p, came = self.reasoner.parser, self.came | set(ids)
        pending = self.held + text
        self.held = ""
        if not last:
            keep = _partial_marker(pending)
            pending, self.held = pending[:len(pending) - keep], pending[len(pending) - keep:]
        ends = {m for m, token in ((END, p.end), (TOOL, p.tool)) if token is None or token in came}
        reasoning, content, ended = _qwen3(pending, p.specials, streaming=True, ends=ends)
        self.ended = ended
        return reasoning or None, content or None


def _qwen3(text: str, specials: tuple, streaming: bool = False, ends=(END, TOOL)):
    """(reasoning, content) of qwen3's state machine over ``text`` starting in thinking (and, streaming, whether
    thinking ended: after the end the text passes as it is, as vLLM's stream passes it); ``ends``: the end markers
    that end thinking (the others are thinking's text)."""
    reasoning, content, pos, thinking = [], [], 0, True
    markers = (START, END, TOOL) + specials
    while pos < len(text):
        if not thinking and streaming:
            content.append(text[pos:])
            break
        hits = [(text.find(m, pos), m) for m in markers if text.find(m, pos) >= 0]
        at, marker = min(hits, key=lambda h: (h[0], -len(h[1]))) if hits else (len(text), "")
        (reasoning if thinking else content).append(text[pos:at])
        pos = at + len(marker)
        if thinking and marker in (END, TOOL) and marker not in ends:
            reasoning.append(marker)
        elif marker == END and thinking:
            thinking = False
        elif marker == TOOL:
            if thinking:
                thinking = False
            content.append(TOOL)
        elif marker == START and not thinking:
            content.append(START)
    out = ("".join(reasoning), "".join(content))
    return (*out, not thinking) if streaming else out


def _partial_marker(text: str) -> int:
    """The length of ``text``'s longest end that is a proper beginning of a qwen3 terminal (0: none)."""
    for n in range(min(len(text), max(map(len, QWEN3_TERMINALS)) - 1), 0, -1):
        if any(t.startswith(text[-n:]) and len(t) > n for t in QWEN3_TERMINALS):
            return n
    return 0
