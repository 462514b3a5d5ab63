"""The benchmark models: SmolLM2-135M-Instruct (real weights, offline), a random Llama of its shape, and a
tiny random Llama; their shapes are stated once, here."""
from __future__ import annotations

import torch

from hf_paged.cache.pools import kv_bytes_per_token

# 4 query / 2 KV heads of 64 (vLLM's CPU attention needs head_dim 64); vocab set by the caller.
TINY_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False)
# SmolLM2-135M(-Instruct)'s shape.
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                     rope_theta=1e5, tie_word_embeddings=True)
MODELS = ("smollm2", "random", "tiny")


def random_llama(shape: dict, seed: int = 0, dtype: torch.dtype = torch.float32, **config):
    """A LlamaForCausalLM of ``shape`` (and ``config`` overrides) with weights drawn from ``seed``, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**(shape | config))).to(dtype).eval()


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32):
    """4 layers, hidden 256, 4 query / 2 KV heads of 64, vocab 4096; pad 0, BOS 1, EOS 2."""
    model = random_llama(TINY_SHAPE, seed, dtype, vocab_size=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 2
    return model


def smollm2_random(dtype: torch.dtype = torch.float32):
    """SmolLM2-135M's shape with random weights (where its checkpoint is absent)."""
    model = random_llama(SMOLLM2_SHAPE, 0, dtype, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 2, 2
    return model


def smollm2(dtype: torch.dtype = torch.float32):
    from hf_paged.integrations.smollm2 import load_smollm2
    model, _ = load_smollm2(dtype=dtype, verbose=False)
    return model


def load(name: str, dtype: torch.dtype = torch.float32):
    """``name`` in MODELS: "smollm2" (real weights; raises when not installed), "random", "tiny"."""
    makers = {"smollm2": smollm2, "random": smollm2_random, "tiny": lambda dtype: tiny_llama(dtype=dtype)}
    if name not in makers:
        raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")
    return makers[name](dtype)


def describe(model) -> dict:
    c = model.config
    return {"layers": c.num_hidden_layers, "hidden": c.hidden_size, "heads": c.num_attention_heads,
            "kv_heads": c.num_key_value_heads, "head_dim": getattr(c, "head_dim", None), "vocab": c.vocab_size,
            "params": sum(p.numel() for p in model.parameters()), "dtype": str(model.dtype).replace("torch.", ""),
            "kv_bytes_per_token": kv_bytes_per_token(c, model.dtype)}


def label(name: str, model) -> str:
    """One line naming the model: 'smollm2: 30 layers, hidden 576, 9/3 heads of 64, float32'."""
    d = describe(model)
    return f"{name}: {d['layers']} layers, hidden {d['hidden']}, {d['heads']}/{d['kv_heads']} heads of " \
           f"{d['head_dim']}, {d['dtype']}"
