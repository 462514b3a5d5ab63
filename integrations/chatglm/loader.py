"""``load_chatglm``: a ChatGLM2/3/GLM-4-chat checkpoint directory as a native ``GlmForCausalLM``."""
from __future__ import annotations

import json
import os

import torch
from transformers import GlmForCausalLM

from .config import ChatGLMCheckpointError, _read_shape, chatglm_config_to_glm
from .weights import _load_state_dict


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _resolve_dtype(dtype, cfg: dict) -> torch.dtype:
    """``dtype`` if given, else the checkpoint's ``torch_dtype``/``dtype``, else float32."""
    if dtype is None:
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or torch.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        dtype = _DTYPES[dtype]
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype {dtype} is not supported; use torch.float32, float16 or bfloat16")
    return dtype


def load_chatglm(path: str, dtype=None, device="cpu", save_to: str | None = None,
                 _config_overrides: dict | None = None) -> GlmForCausalLM:
    """Load a ChatGLM2/ChatGLM3/GLM-4-chat checkpoint directory as a native ``GlmForCausalLM``.

    path: directory with config.json (``model_type: "chatglm"``) and one of ``model.safetensors``,
        sharded safetensors with ``model.safetensors.index.json``, ``pytorch_model.bin``, or sharded
        ``.bin`` with ``pytorch_model.bin.index.json`` (``.bin`` read with ``weights_only=True``).
        No remote code runs; the tokenizer is not touched.
    dtype: torch.float32 / float16 / bfloat16 (or their names); default: the checkpoint's
        ``torch_dtype``, else float32.
    device: where the returned model lives (built on CPU, then moved).
    save_to: if given, also ``save_pretrained`` there (safetensors), reloadable with
        ``GlmForCausalLM.from_pretrained(save_to)`` with no ChatGLM code at all.
    _config_overrides: test hook only, see :func:`chatglm_config_to_glm`.

    Returns the model in eval mode; ``config.num_key_value_heads == multi_query_group_num`` (K/V
    projections ``[groups*kv_channels, hidden]``, never expanded to the query heads).
    Raises UnsupportedChatGLMConfig / ChatGLMCheckpointError (both ValueError).
    """
    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ChatGLMCheckpointError(config_path, None, f"cannot read config.json: {e}")
    shape = _read_shape(cfg)
    config = chatglm_config_to_glm(cfg, _config_overrides)
    dtype = _resolve_dtype(dtype, cfg)
    config.dtype = dtype
    state = _load_state_dict(path, shape, dtype)

    # Build without allocating or initialising weights, then adopt the loaded tensors as parameters.
    with torch.device("meta"):
        model = GlmForCausalLM(config)
    model.load_state_dict(state, strict=True, assign=True)
    # The rotary frequencies are non-persistent buffers: recompute them for real (in fp32, as always).
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    model = model.to(device).eval()
    if save_to is not None:
        model.save_pretrained(save_to)
    return model
