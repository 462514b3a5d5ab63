"""Request schemas of the OpenAI API (the fields the official client sends), ``extra="forbid"``.

Standard fields the engine does not implement are accepted by the schema and refused with a 400 that
names them (``unsupported()``), unless they carry their neutral value. Extensions (as vLLM's):
``top_k`` (-1 or 0: off) and ``ignore_eos``.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 64
MAX_SEED = 2**63 - 1
# The engine's finish reasons as OpenAI (and vLLM's metrics) name them.
FINISH_REASONS = {"stop": "stop", "stop_string": "stop", "length": "length", "cancelled": "abort"}


def finish_reason(engine_reason: str | None) -> str:
    """OpenAI's ``finish_reason`` for the engine's (none at all: the request was cancelled, "abort")."""
    return FINISH_REASONS.get(engine_reason, engine_reason or "abort")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None


class _Sampling(_Strict):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    ignore_eos: bool = False

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)

    def unsupported(self) -> Optional[tuple[str, str]]:
        """(param, message) of the first set field the engine does not implement, or None."""
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                return name, f"{name} is not supported by this server (only 0)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported by this server"
        if len(self.stops()) > 4:
            return "stop", "at most 4 stop sequences"
        return None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=1)         # OpenAI's default for completions
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: Optional[bool] = False
    best_of: Optional[int] = Field(None, ge=1)
    suffix: Optional[str] = None

    def unsupported(self):
        if self.logprobs is not None:
            return "logprobs", "logprobs are not implemented by this server"
        if self.echo:
            return "echo", "echo is not implemented by this server"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of other than n is not supported by this server"
        if self.suffix:
            return "suffix", "suffix is not supported by this server"
        return super().unsupported()


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    response_format: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    service_tier: Optional[str] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None

    def unsupported(self):
        if self.logprobs or self.top_logprobs is not None:
            return "logprobs", "logprobs are not implemented by this server"
        if self.response_format and self.response_format.get("type") != "text":
            return "response_format", "only response_format {'type': 'text'} is supported"
        if self.tools:
            return "tools", "tools are not supported by this server"
        if self.tool_choice not in (None, "none"):
            return "tool_choice", "tool_choice is not supported by this server"
        return super().unsupported()
