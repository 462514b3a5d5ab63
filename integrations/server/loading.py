"""Load what ``hf-paged serve MODEL`` names: ``smollm2`` (the embedded SmolLM2-135M-Instruct), a ChatGLM
directory (config.json ``model_type: "chatglm"``, through ``load_chatglm``), or any transformers
checkpoint directory / hub id (AutoModelForCausalLM + AutoTokenizer; a directory loads offline)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

DTYPES = {"auto": None, "float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}


def load_model(name: str, dtype: str = "auto", device: str | None = None, trust_remote_code: bool = False):
    """(model in eval mode, tokenizer) for ``name``; ``dtype``: one of DTYPES (auto: the checkpoint's).
    ``trust_remote_code``: for a ChatGLM directory's tokenizer only (the model never runs remote code)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = DTYPES[dtype]
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "smollm2":
        from ..smollm2 import load_smollm2

        model, tokenizer = load_smollm2(dtype=torch_dtype or torch.float32)
        return model.to(device), tokenizer
    path = Path(name).expanduser()
    local = path.is_dir()
    if not local and (path.exists() or name.startswith((".", "/", "~"))):
        raise FileNotFoundError(f"{name}: not a checkpoint directory")
    model_type = None
    if local and (path / "config.json").is_file():
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    if model_type == "chatglm":
        from ..chatglm import load_chatglm

        model = load_chatglm(str(path), dtype=torch_dtype, device=device).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                                  trust_remote_code=trust_remote_code)
        return model, tokenizer
    kwargs = dict(local_files_only=True) if local else {}
    model = AutoModelForCausalLM.from_pretrained(str(path) if local else name, dtype=torch_dtype or "auto",
                                                 **kwargs).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path) if local else name, **kwargs)
    return model, tokenizer
