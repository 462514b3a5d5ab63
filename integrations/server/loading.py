"""Load a model for serving: the one loader of ``hf-paged serve``, its Ray Serve deployment and the Ray
Data actors.

``name``: ``smollm2`` (the embedded SmolLM2-135M-Instruct), a ChatGLM directory (config.json
``model_type: "chatglm"``, through ``load_chatglm``), or any transformers checkpoint directory / hub id
(AutoModelForCausalLM + AutoTokenizer; a directory loads offline). No web imports.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..weight_quant import INT4_ON_CPU, check_scheme, load_quantized, quantize_model

DTYPES = {"auto": None, "float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}


def torch_dtype(dtype) -> torch.dtype | None:
    """``dtype`` (a torch.dtype or one of DTYPES' names) as a torch.dtype; None for "auto"."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)} (or a torch.dtype)")
    return DTYPES[dtype]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(name: str, dtype="auto", device: str | None = None, trust_remote_code: bool = False,
               tokenizer=None, quantization: str | None = None):
    """(model in eval mode on ``device``, tokenizer) for ``name``; ``dtype``: see ``torch_dtype`` (auto:
    the checkpoint's); ``device``: default ``default_device()`` ("cuda" when there is a GPU). ``tokenizer``: a
    path / hub id to load it from (default: ``name``), or a tokenizer object, returned as it is.
    ``trust_remote_code``: for a ChatGLM directory's tokenizer only (the model never runs remote code)."""
    check_scheme(quantization)        # quantization: a weight_quant scheme applied at load, or None
    dtype = torch_dtype(dtype)
    device = device or default_device()
    if quantization == "torchao-int4" and torch.device(device).type == "cpu":
        raise ValueError(INT4_ON_CPU)             # before loading the model, not after
    if name == "smollm2":
        from ..smollm2 import load_smollm2

        model, own = load_smollm2(dtype=dtype or torch.float32)
        model = model.to(device)
        model = quantize_model(model, quantization) if quantization else model
        return model, own if tokenizer is None else _tokenizer(tokenizer)
    path = Path(name).expanduser()
    local = path.is_dir()
    if not local and (path.exists() or name.startswith((".", "/", "~"))):
        raise FileNotFoundError(f"{name}: not a checkpoint directory")
    source = str(path) if local else name
    if local and quantization and _quantization_method(path):
        raise ValueError(f"{name} is already quantised ({_quantization_method(path)}: its config.json has a "
                         f"quantization_config); drop --quantization {quantization}, which would quantise it again")
    if local and _model_type(path) == "chatglm":
        from ..chatglm import load_chatglm

        model = load_chatglm(source, dtype=dtype, device=device).eval()
        model = quantize_model(model, quantization) if quantization else model
        return model, _tokenizer(tokenizer, source, local_files_only=True, trust_remote_code=trust_remote_code)
    from transformers import AutoModelForCausalLM

    options = dict(local_files_only=True) if local else {}
    if quantization:
        return load_quantized(source, quantization, dtype, device, **options), _tokenizer(tokenizer, source, **options)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype or "auto", **options).to(device).eval()
    return model, _tokenizer(tokenizer, source, **options)


def _quantization_method(path: Path) -> str | None:
    """The quant_method of a checkpoint directory's quantization_config (a pre-quantised checkpoint), or None."""
    config = path / "config.json"
    try:
        found = json.loads(config.read_text()).get("quantization_config") if config.is_file() else None
    except (json.JSONDecodeError, AttributeError):
        return None                                   # _model_type names a broken config.json
    return (found.get("quant_method") or "quantised") if isinstance(found, dict) else None


def _model_type(path: Path) -> str | None:
    config = path / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{path}: no config.json: not a transformers checkpoint directory "
                                "(model.save_pretrained(dir) writes one)")
    try:
        return json.loads(config.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"{config}: not a valid config.json ({exc})") from None


def _tokenizer(tokenizer, source: str | None = None, **options):
    """The given tokenizer object, the one at the given path / hub id, or (None) ``source``'s with ``options``."""
    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        return tokenizer
    from transformers import AutoTokenizer

    if tokenizer is not None:
        return AutoTokenizer.from_pretrained(str(tokenizer))
    folder = Path(source)
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"{source}: no tokenizer in the checkpoint directory (none of "
                                f"{', '.join(TOKENIZER_FILES)}); save the model's tokenizer there "
                                "(tokenizer.save_pretrained(dir))")
    return AutoTokenizer.from_pretrained(source, **options)


# A checkpoint directory's tokenizer files: one of these makes it loadable by AutoTokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model")
