"""Structured output: a request's grammar (JSON schema, any JSON object, regex, choice, lark/GBNF)
compiled by llguidance and applied as a token bitmask to the batch's logits (STUB: being built)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StructuredOutput:
    """What a request asks for, as vLLM's ``StructuredOutputsParams``: exactly one of ``json`` (a JSON
    schema: a dict or its JSON text), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of
    these strings) or ``grammar`` (llguidance's lark syntax, which also reads GBNF's ``::=`` rules)."""
    json: object = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
