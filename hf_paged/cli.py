"""The ``hf-paged`` command (also ``python -m hf_paged``), an application-layer module.

    hf-paged serve MODEL [flags]     # OpenAI-compatible server (needs the ``serve`` extra)
    hf-paged demo [demo flags]       # python -m hf_paged.demo

MODEL: a transformers checkpoint directory (or a hub id the machine can reach), a ChatGLM2/3
directory (loaded through hf_paged.integrations.chatglm), or ``smollm2`` (the embedded
SmolLM2-135M-Instruct). Engine flags are named as vLLM names them.
"""
from __future__ import annotations

import argparse
import sys

from .kv_formats import KV_CACHE_DTYPES


def _bytes(text: str) -> int:
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _positive(cast):
    def parse(text):
        value = cast(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-paged", description="hf_paged: paged KV cache and engine for transformers")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="OpenAI-compatible server on the continuous-batching engine",
                       description="Serve MODEL with an OpenAI-compatible API (/v1/completions, "
                                   "/v1/chat/completions, /v1/models, /health, /metrics).")
    s.add_argument("model", metavar="MODEL_DIR", help="checkpoint directory, hub id, or 'smollm2'")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    s.add_argument("--served-model-name", help="the model name in the API (default: MODEL_DIR)")
    s.add_argument("--dtype", default="auto", choices=["auto", "float32", "float", "bfloat16", "float16", "half"])
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    s.add_argument("--max-num-batched-tokens", type=_positive(int), default=512)
    s.add_argument("--max-num-seqs", type=_positive(int), default=64)
    s.add_argument("--max-model-len", type=_positive(int), default=None)
    s.add_argument("--block-size", type=_positive(int), default=16)
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    s.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV block storage: auto (the model's dtype) or a quantised format (fp8 = fp8_e4m3)")
    s.add_argument("--kv-cache-memory-bytes", type=_bytes, default=None, help="KV pool size, e.g. 256M, 2G")
    s.add_argument("--max-queue", type=_positive(int), default=256,
                   help="waiting requests before answering 503 with Retry-After (default 256)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds to let in-flight requests finish on SIGTERM before cancelling them")
    s.add_argument("--max-body-bytes", type=_bytes, default=None, help="request body limit (default 4M)")
    s.add_argument("--trust-remote-code", action="store_true", help="for a ChatGLM directory's tokenizer only")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    sub.add_parser("demo", help="python -m hf_paged.demo (its flags follow)", add_help=False)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        from . import demo

        return demo.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        from hf_paged.integrations.server.main import serve
    except ImportError as exc:
        print(f"hf-paged serve needs the 'serve' extra ({exc.name} is missing): pip install 'hf-paged[serve]'",
              file=sys.stderr)
        return 2
    knobs = dict(gpu_memory_utilization=args.gpu_memory_utilization,
                 max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                 max_model_len=args.max_model_len, block_size=args.block_size,
                 enable_prefix_caching=args.enable_prefix_caching, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                 kv_cache_dtype=args.kv_cache_dtype)
    return serve(args.model, host=args.host, port=args.port, api_key=args.api_key,
                 served_model_name=args.served_model_name, dtype=args.dtype, max_queue=args.max_queue,
                 shutdown_timeout=args.shutdown_timeout, max_body_bytes=args.max_body_bytes,
                 trust_remote_code=args.trust_remote_code, log_level=args.log_level, **knobs)


if __name__ == "__main__":
    sys.exit(main())
