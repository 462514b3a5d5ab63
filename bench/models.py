"""The benchmark models: SmolLM2-135M-Instruct (real weights, offline) and a tiny random Llama."""
from __future__ import annotations

import torch

from hf_paged.cache import kv_bytes_per_token  # noqa: F401  (bench modules import it from here)


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32):
    """4 layers, hidden 256, 4 query / 2 KV heads of 64 (vLLM's CPU attention needs head_dim 64), vocab 4096."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    config = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, vocab_size=4096, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    return model


def smollm2(dtype: torch.dtype = torch.float32):
    from hf_paged.integrations.smollm2 import load_smollm2  # noqa: PLC0415
    model, _ = load_smollm2(dtype=dtype)
    return model


def load(name: str, dtype: torch.dtype = torch.float32):
    if name == "tiny":
        return tiny_llama(dtype=dtype)
    if name == "smollm2":
        return smollm2(dtype=dtype)
    raise ValueError(f"unknown model {name!r}; expected 'tiny' or 'smollm2'")



def describe(model) -> dict:
    c = model.config
    return {"layers": c.num_hidden_layers, "hidden": c.hidden_size, "heads": c.num_attention_heads,
            "kv_heads": c.num_key_value_heads, "head_dim": getattr(c, "head_dim", None), "vocab": c.vocab_size,
            "params": sum(p.numel() for p in model.parameters()), "dtype": str(model.dtype).replace("torch.", ""),
            "kv_bytes_per_token": kv_bytes_per_token(c, model.dtype)}
