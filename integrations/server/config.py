"""The server's settings beside the engine's: each default stated once, here or in ``EngineConfig``.

``AppConfig`` is what ``create_app`` takes besides the model and the EngineConfig knobs; ``ServeConfig``
adds what ``serve`` needs to load the model and bind a socket. ``hf-paged serve`` has one flag per
field (``hf_paged.cli`` reads the defaults and the help below). No web imports.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields

MiB = 2**20
TOOL_CALL_PARSERS = ("hermes", "llama3_json")      # --tool-call-parser: how tool_parsers reads calls
REASONING_PARSERS = ("deepseek_r1", "qwen3")        # --reasoning-parser: how reasoning.py splits off thinking


@dataclass(frozen=True)
class AppConfig:
    """served_model_name: the model's name in the API (default: the checkpoint's name). api_key: require
    ``Authorization: Bearer KEY`` (or ``x-api-key: KEY``) on every endpoint but /health and /ping.
    max_queue: sequences that may wait beyond the max_num_seqs the engine runs before answering 503 with
    Retry-After (a request of n sequences takes n). shutdown_timeout: seconds to let in-flight requests finish on
    SIGTERM
    before cancelling them. max_body_bytes: request body limit (413 above it). generation_config: where
    unset sampling fields come from, as vLLM's flag: "auto", the model's generation config where it sets
    temperature, top_p, top_k, min_p, repetition_penalty or max_new_tokens, else vLLM's defaults (temperature
    1.0); "vllm", vLLM's defaults only. enable_auto_tool_choice: answer tool calls (chat completions' tools
    with tool_choice auto, required or a named function), read out of the model's text by tool_call_parser, as
    vLLM's flags of these names. tool_call_parser: how the model writes a call: hermes (Qwen 2.5 / 3, Hermes)
    or llama3_json (Llama 3.1+). reasoning_parser: how a reasoning model's thinking (``<think>...</think>``) is
    split off its answer into the message's ``reasoning`` (vLLM's flag): deepseek_r1 (DeepSeek-R1 and its
    Llama / Qwen distills) or qwen3 (Qwen3, QwQ); structured output then applies after the thinking."""
    served_model_name: str | None = None
    api_key: str | None = None
    max_queue: int = 256
    shutdown_timeout: float = 30.0
    max_body_bytes: int = 4 * MiB
    generation_config: str = "auto"
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def validate(self) -> None:
        if not isinstance(self.max_queue, int) or self.max_queue < 1:
            raise ValueError(f"max_queue must be a positive int, got {self.max_queue!r}")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive int, got {self.max_body_bytes!r}")
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be 'auto' or 'vllm', got {self.generation_config!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got "
                             f"{self.reasoning_parser!r}")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("enable_auto_tool_choice (--enable-auto-tool-choice) needs tool_call_parser "
                             f"(--tool-call-parser: {' or '.join(TOOL_CALL_PARSERS)})")
        if not 0 <= self.shutdown_timeout < float("inf"):        # NaN fails it too
            raise ValueError(f"shutdown_timeout must be a finite number of seconds >= 0, got {self.shutdown_timeout!r}")


@dataclass(frozen=True)
class ServeConfig(AppConfig):
    """host: address to bind; 127.0.0.1 accepts this machine only. port: TCP port to listen on.
    dtype: weights' dtype (auto: the checkpoint's). trust_remote_code: for a ChatGLM directory's
    tokenizer only. log_level: the server's logging level. quantization: weight quantisation applied at
    load (integrations/weight_quant.SCHEMES; None: as the checkpoint is, a pre-quantised one included)."""
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "auto"
    quantization: str | None = None
    trust_remote_code: bool = False
    log_level: str = "info"


def partition(options: dict, config_class: type) -> tuple[dict, dict]:
    """(the options named after ``config_class``'s dataclass fields, the others)."""
    names = {f.name for f in fields(config_class)}
    return ({k: v for k, v in options.items() if k in names},
            {k: v for k, v in options.items() if k not in names})


def split_options(options: dict, config_class: type[AppConfig]) -> tuple[AppConfig, dict]:
    """(``config_class`` built and validated from its fields among ``options``, the rest: EngineConfig
    knobs, which ``Engine`` checks)."""
    mine, rest = partition(options, config_class)
    config = config_class(**mine)
    config.validate()
    return config, rest


def field_docs(config_class: type) -> dict[str, str]:
    """Each documented field's text in the docstrings of ``config_class`` and its bases, written as
    ``name: text. name: text.``; text before the first name is not any field's."""
    names = "|".join(re.escape(f.name) for f in fields(config_class))
    docs: dict[str, str] = {}
    for cls in reversed(config_class.__mro__):
        doc = " ".join((cls.__dict__.get("__doc__") or "").split())
        marks = list(re.finditer(rf"\b({names}): ", doc))
        ends = [m.start() for m in marks[1:]] + [len(doc)]
        docs.update({m.group(1): doc[m.end():end].strip().replace("``", "") for m, end in zip(marks, ends)})
    return docs
