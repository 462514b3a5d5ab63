"""The objects nested in request bodies (stream options, response formats, vLLM's structured-output
parameters) and the strict base every request schema shares.

Strict, because a body is JSON from anyone: ``"5"`` is not an integer, ``1.0`` and ``true`` are not token
ids, NaN and Infinity are not numbers. ``extra="forbid"``: a field nobody knows is refused with a 400
naming it (vLLM only logs such fields and ignores them; a typo that silently changes nothing is worse).
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)


class StreamOptions(Strict):
    """include_usage: a last chunk with the usage. continuous_usage_stats: vLLM's usage in every chunk
    (accepted; the usage comes in the last chunk)."""
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None


class JsonSchemaFormat(Strict):
    """OpenAI's ``response_format.json_schema``: the schema travels as ``schema``."""
    name: str
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(Strict):
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``; vLLM's
    ``structural_tag`` formats validate (their fields below) so that the refusal can name the type."""
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: Optional[JsonSchemaFormat] = None
    structures: Optional[list[Any]] = None
    triggers: Optional[list[Any]] = None
    format: Optional[Any] = None


class StructuredOutputsParams(Strict):
    """vLLM's ``structured_outputs``: one of json (a schema, or its JSON text), regex, choice, grammar,
    json_object. disable_fallback only picks among vLLM's backends (this server has one) and is ignored;
    the other options change the constraint and are refused unless neutral."""
    json_: Optional[Union[str, dict[str, Any]]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None
    structural_tag: Optional[str] = None
    disable_fallback: bool = False


class RepetitionDetection(Strict):
    """vLLM's ``repetition_detection`` (refused unless ``max_pattern_size`` is 0: off)."""
    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0
