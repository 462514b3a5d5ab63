"""The ``hf-paged`` command (also ``python -m hf_paged``), an application-layer module.

    hf-paged serve MODEL [flags]     # OpenAI-compatible server (needs the ``serve`` extra)
    hf-paged demo [demo flags]       # python -m hf_paged.demo

MODEL: a transformers checkpoint directory (or a hub id the machine can reach), a ChatGLM2/3
directory (loaded through hf_paged.integrations.chatglm), or ``smollm2`` (the embedded
SmolLM2-135M-Instruct). Engine flags are named as vLLM names them. Each ``serve`` flag is a field of
``EngineConfig`` or of the server's ``ServeConfig`` (``--max-num-seqs`` is ``max_num_seqs``): its
default and help come from there.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import MISSING, fields

from .engine import EngineConfig
from .integrations.server.config import REASONING_PARSERS, TOOL_CALL_PARSERS, ServeConfig, field_docs
from .integrations.server.loading import DTYPES
from .integrations.weight_quant import SCHEMES
from .kv_formats import KV_CACHE_DTYPES

BYTE_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


def parse_bytes(text: str) -> int:
    """A byte count written as ``1048576``, ``512k``, ``256M``, ``2G``, ``1TiB`` (powers of 1024)."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        return int(float(t[:-1]) * BYTE_UNITS[t[-1]]) if t and t[-1] in BYTE_UNITS else int(t)
    except ValueError:
        raise ValueError(f"not a byte size: {text!r} (e.g. 1048576, 256M, 2G)") from None


def format_bytes(n: int) -> str:
    """``n`` as parse_bytes reads it back, in the largest unit that divides it (4194304 -> "4M")."""
    for unit, size in reversed(BYTE_UNITS.items()):
        if n and n % size == 0:
            return f"{n // size}{unit.upper()}"
    return str(n)


def _positive(cast):
    def parse(text):
        try:
            value = cast(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 0..65535, got {text}")
    return value


POSITIVE_INT, SIZE = _positive(int), _positive(parse_bytes)
# ``serve``'s flags in --help order: (the config holding the field, field, argparse keywords); the
# default is the field's, the help its docstring's text unless given here.
SERVE_FLAGS = [
    (ServeConfig, "host", {}),
    (ServeConfig, "port", dict(type=port_number)),
    (ServeConfig, "api_key", {}),
    (ServeConfig, "served_model_name", dict(help="the model's name in the API (default: MODEL_DIR)")),
    (ServeConfig, "dtype", dict(choices=list(DTYPES))),
    (ServeConfig, "quantization", dict(choices=list(SCHEMES),
        help="weight quantisation at load (pip extra 'quant'); a pre-quantised checkpoint (its config.json "
             "has a quantization_config, e.g. compressed-tensors) needs none")),
    (EngineConfig, "gpu_memory_utilization",
     dict(type=float, help="fraction of the GPU's memory for the weights, a profiled forward and the KV pool")),
    (EngineConfig, "max_num_batched_tokens", dict(type=POSITIVE_INT)),
    (EngineConfig, "max_num_seqs", dict(type=POSITIVE_INT)),
    (EngineConfig, "max_model_len", dict(type=POSITIVE_INT)),
    (EngineConfig, "block_size", dict(type=POSITIVE_INT)),
    (EngineConfig, "enable_prefix_caching", dict(action=argparse.BooleanOptionalAction)),
    (EngineConfig, "kv_cache_dtype", dict(choices=KV_CACHE_DTYPES)),
    (EngineConfig, "kv_cache_memory_bytes", dict(type=SIZE, help="KV pool size, e.g. 256M, 2G")),
    (EngineConfig, "max_logprobs", dict(type=int)),
    (ServeConfig, "max_queue", dict(type=POSITIVE_INT)),
    (ServeConfig, "shutdown_timeout", dict(type=float)),
    (ServeConfig, "max_body_bytes", dict(type=SIZE)),
    (ServeConfig, "generation_config", dict(choices=["auto", "vllm"])),
    (ServeConfig, "enable_auto_tool_choice", dict(action="store_true")),
    (ServeConfig, "tool_call_parser", dict(choices=list(TOOL_CALL_PARSERS))),
    (ServeConfig, "reasoning_parser", dict(choices=list(REASONING_PARSERS))),
    (ServeConfig, "trust_remote_code", dict(action="store_true")),
    (ServeConfig, "log_level", dict(choices=LOG_LEVELS)),
]


def _add_flag(parser, config_class, name: str, options: dict) -> None:
    field = next(f for f in fields(config_class) if f.name == name)
    default = field.default if field.default is not MISSING else None
    help_text = options.pop("help", None) or field_docs(config_class).get(name, "")
    help_text = help_text.rstrip(".").replace("%", "%%")
    if default is not None and options.get("action") != "store_true" and "default:" not in help_text:
        shown = format_bytes(default) if options.get("type") is SIZE else "%(default)s"
        help_text += f" (default: {shown})"
    parser.add_argument("--" + name.replace("_", "-"), default=default, help=help_text or None, **options)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-paged",
                                     description="hf_paged: paged KV cache and engine for transformers")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="OpenAI-compatible server on the continuous-batching engine",
                       description="Serve MODEL with an OpenAI-compatible API (/v1/completions, "
                                   "/v1/chat/completions, /v1/models, /health, /metrics).")
    s.add_argument("model", metavar="MODEL_DIR", help="checkpoint directory, hub id, or 'smollm2'")
    for config_class, name, options in SERVE_FLAGS:
        _add_flag(s, config_class, name, dict(options))
    sub.add_parser("demo", help="python -m hf_paged.demo (its flags follow)", add_help=False)
    return parser


# what the 'serve' extra installs, as imported (checked before the model loads; uvicorn is imported only then)
SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client", "llguidance")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        from . import demo

        return demo.main(argv[1:])
    args = build_parser().parse_args(argv)
    missing = [name for name in SERVE_MODULES if importlib.util.find_spec(name) is None]
    try:
        if missing:
            raise ModuleNotFoundError(name=missing[0])
        from hf_paged.integrations.server.main import checked_options, serve
    except ImportError as exc:
        print(f"hf-paged serve needs the 'serve' extra ({exc.name} is missing): pip install 'hf-paged[serve]'",
              file=sys.stderr)
        return 2
    options = {name: getattr(args, name) for _, name, _ in SERVE_FLAGS}
    try:
        checked_options(options)          # before the model loads: a bad value fails in a second
        return serve(args.model, **options)
    except (ValueError, OSError) as exc:  # bad settings, a missing / broken checkpoint: one line, no traceback
        print(f"hf-paged serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
