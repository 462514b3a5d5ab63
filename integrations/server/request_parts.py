"""The objects nested in request bodies (stream options, response formats, vLLM's structured-output
parameters) and the base every request schema shares.

Lenient where vLLM's schemas are (pydantic's lax mode: ``"5"`` and ``5.0`` are the integer 5, ``true`` is 1),
and a field nobody here knows is ignored and logged, as vLLM's server does (a client written for vLLM or
OpenAI may send fields this server has no use for: ``prompt_cache_key``, ``safety_identifier``, ...).
Strict where a mistake would be silent: NaN and Infinity are not numbers, and prompt token ids are
integers (``protocol.prompt_shape``).
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr


class Body(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)
    _ignored: tuple[str, ...] = PrivateAttr(default=())

    def model_post_init(self, context: Any) -> None:
        """Unknown fields are set aside (never read as attributes): ``ignored_fields`` names them."""
        extra = self.__pydantic_extra__
        if extra:
            self._ignored = tuple(extra)
            extra.clear()

    def ignored_fields(self, prefix: str = "") -> list[str]:
        """The dotted names of the unknown fields here and in the objects nested in this one."""
        names = [prefix + name for name in self._ignored]
        for name in type(self).model_fields:
            value = getattr(self, name)
            items = enumerate(value) if isinstance(value, list) else [(None, value)]
            for i, item in items:
                if isinstance(item, Body):
                    names += item.ignored_fields(f"{prefix}{name}." + ("" if i is None else f"{i}."))
        return names


class StreamOptions(Body):
    """include_usage: a last chunk with the usage. continuous_usage_stats: with include_usage, vLLM's usage so
    far in every chunk (its choice's)."""
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None


class JsonSchemaFormat(Body):
    """OpenAI's ``response_format.json_schema``: the schema travels as ``schema``."""
    name: str
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(Body):
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``; vLLM's
    ``structural_tag`` formats validate (their fields below) so that the refusal can name the type."""
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: Optional[JsonSchemaFormat] = None
    structures: Optional[list[Any]] = None
    triggers: Optional[list[Any]] = None
    format: Optional[Any] = None


class StructuredOutputsParams(Body):
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


class RepetitionDetection(Body):
    """vLLM's ``repetition_detection`` (refused unless ``max_pattern_size`` is 0: off)."""
    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0
