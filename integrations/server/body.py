"""A request body, read and validated: size-limited (413), then parsed and validated in one pass by
pydantic's JSON parser (``model_validate_json``), so that no body makes a 500.

Why not ``json.loads`` then ``model_validate``: ``json.loads`` recurses in Python and raises
RecursionError on a body nested a few thousand levels deep, accepts ``NaN`` / ``Infinity`` and turns a
10,000-digit number into an int the schema would only look at later. pydantic's parser stops at a
nesting depth of 200 and refuses those literals and numbers as invalid JSON. Every failure is an
``ApiError`` (400 or 413) naming the field where there is one; fields the schema does not know are
logged and ignored, as vLLM does (``request_parts.Body``).
"""
from __future__ import annotations

import logging

from fastapi import Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from .errors import ApiError

log = logging.getLogger("hf_paged.server")
# pydantic's names for the members of a union in an error's location ("str", "list[int]", ...)
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "bytes"})


async def read_body(request: Request, limit: int) -> bytes:
    too_large = ApiError(413, f"request body over {limit} bytes (max_body_bytes, --max-body-bytes)",
                         code="body_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    raw = bytearray()
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise too_large
    except ClientDisconnect:           # gone while sending its body: nobody to answer, nothing to log as ours
        raise ApiError(499, "the client disconnected while sending the request body", code="client_closed") from None
    return bytes(raw)


def error_param(loc) -> str | None:
    """The dotted field path of a pydantic error location, without the union members' type tags."""
    parts = [str(p) for p in loc if isinstance(p, int) or (p not in _TYPE_TAGS and "[" not in p)]
    return ".".join(parts) or None


def validation_error(exc: ValidationError) -> ApiError:
    """The 400 for the first error pydantic found (the body is not JSON, not an object, or a field is
    unknown or has a bad value)."""
    err = exc.errors(include_url=False)[0]
    kind, msg = err.get("type"), err.get("msg", "")
    if kind == "json_invalid":
        return ApiError(400, f"malformed JSON body: {msg} (a body is one JSON object, UTF-8 encoded)",
                        code="invalid_json")
    param = error_param(err.get("loc", ()))
    if param is None:
        return ApiError(400, f"the JSON body must be an object: {msg}", code="invalid_json")
    got = "" if kind == "missing" else f" (got {err.get('input')!r:.80})"
    return ApiError(400, f"invalid value {param!r}: {msg.removeprefix('Value error, ')}{got}", param=param,
                    code="invalid_request")


def parse(raw: bytes, schema):
    """``schema`` validated from a body of JSON bytes."""
    try:
        value = schema.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None
    except (ValueError, RecursionError) as exc:        # pragma: no cover - pydantic reports these itself
        raise ApiError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    ignored = value.ignored_fields() if hasattr(value, "ignored_fields") else []
    if ignored:
        log.warning("The following fields were present in the request but ignored: %s", ignored)
    return value


async def read_json(request: Request, schema, limit: int):
    """The request's body as ``schema`` (413 above ``limit`` bytes, 400 for anything else wrong)."""
    return parse(await read_body(request, limit), schema)
