"""Structured output: the request's constraint as the engine's ``StructuredOutput``, and its grammar
compiled off the event loop.

Four ways to ask, as vLLM reads them: ``response_format`` (json_object, json_schema), vLLM's
``structured_outputs`` object, and the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``. One constraint per request: two different ones answer a 400 naming both (vLLM lets
response_format override structured_outputs silently; a client that sends two means one of them is not
what it gets). The same constraint sent twice is one.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Optional

from hf_paged.engine.structured import StructuredOutput, StructuredOutputUnavailable

from .errors import ApiError

KINDS = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
         "grammar": "grammar"}
# structured_outputs options that change the constraint: accepted only with their neutral value
# (disable_additional_properties either way: schemas are strict here, as vLLM's default backend makes them)
NEUTRAL_OPTIONS = {"whitespace_pattern": None, "structural_tag": None}


def _from_response_format(rf) -> list[tuple[str, StructuredOutput]]:
    if rf is None or rf.type == "text":
        return []
    if rf.type == "structural_tag":
        raise ApiError(400, "response_format type 'structural_tag' is not supported; use json_schema, "
                            "json_object or structured_outputs", param="response_format", code="unsupported")
    if rf.type == "json_object":
        return [("response_format", StructuredOutput(json_object=True))]
    if rf.json_schema is None or rf.json_schema.json_schema is None:
        raise ApiError(400, "response_format type 'json_schema' needs json_schema.schema (the JSON schema)",
                       param="response_format.json_schema.schema", code="invalid_request")
    return [("response_format", StructuredOutput(json=rf.json_schema.json_schema))]


def _from_structured_outputs(so) -> list[tuple[str, StructuredOutput]]:
    if so is None:
        return []
    for name, neutral in NEUTRAL_OPTIONS.items():
        if getattr(so, name) != neutral:
            raise ApiError(400, f"structured_outputs.{name}={getattr(so, name)!r:.60} is not supported "
                                f"(only {neutral!r})", param=f"structured_outputs.{name}", code="unsupported")
    compact = dict(disable_any_whitespace=bool(so.disable_any_whitespace))
    found = [("structured_outputs.json", so.json_ is not None and StructuredOutput(json=so.json_, **compact)),
             ("structured_outputs.regex", so.regex is not None and StructuredOutput(regex=so.regex)),
             ("structured_outputs.choice", so.choice is not None and StructuredOutput(choice=tuple(so.choice))),
             ("structured_outputs.grammar", so.grammar is not None and StructuredOutput(grammar=so.grammar)),
             ("structured_outputs.json_object", bool(so.json_object) and StructuredOutput(json_object=True, **compact))]
    return [(name, spec) for name, spec in found if spec]


def _from_guided(req) -> list[tuple[str, StructuredOutput]]:
    found = [("guided_json", req.guided_json is not None and StructuredOutput(json=req.guided_json)),
             ("guided_regex", req.guided_regex is not None and StructuredOutput(regex=req.guided_regex)),
             ("guided_choice", req.guided_choice is not None and StructuredOutput(choice=tuple(req.guided_choice))),
             ("guided_grammar", req.guided_grammar is not None and StructuredOutput(grammar=req.guided_grammar))]
    return [(name, spec) for name, spec in found if spec]


def structured_spec(req) -> Optional[tuple[str, StructuredOutput]]:
    """(the field that asked, its StructuredOutput), or None for free text; 400 for two different ones."""
    asked = _from_response_format(req.response_format) + _from_structured_outputs(req.structured_outputs)
    asked += _from_guided(req)
    distinct: list[tuple[str, StructuredOutput]] = []
    for name, spec in asked:
        if all(spec != other for _, other in distinct):
            distinct.append((name, spec))
    if len(distinct) > 1:
        (a, _), (b, _) = distinct[:2]
        raise ApiError(400, f"{a} and {b} ask for different structured outputs; send one", param=b,
                       code="invalid_request")
    return distinct[0] if distinct else None


async def compile_structured(engine, param: str, spec: StructuredOutput, after_token: int | None = None,
                             from_token: int | None = None):
    """``engine.compile_grammar(spec)`` in a worker thread (compiling a schema can take long; the event
    loop serves other requests meanwhile), waiting for ``after_token`` / ``from_token`` where given; its ValueError
    is a 400 ``invalid_grammar``, or ``unsupported`` where no grammar could compile (StructuredOutputUnavailable: no
    tokenizer, or one llguidance cannot read)."""
    compile_grammar = getattr(engine, "compile_grammar", None)
    if compile_grammar is None:            # an engine without a grammar compiler (e.g. a stand-in)
        raise ApiError(400, "structured output needs the engine's grammar compiler (Engine.compile_grammar), "
                            "which this engine does not have", param=param, code="unsupported")
    if after_token is not None or from_token is not None:
        spec = replace(spec, after_token=after_token, from_token=from_token)
    try:
        return await asyncio.to_thread(compile_grammar, spec)
    except StructuredOutputUnavailable as exc:
        raise ApiError(400, f"{param}: {exc}", param=param, code="unsupported") from None
    except ValueError as exc:
        raise ApiError(400, f"the {KINDS[spec.kind]} of {param} does not compile: {exc}", param=param,
                       code="invalid_grammar") from None
