"""Tiny random models of the five supported families and their relatives, and helpers to compare against transformers.

(A module of its own, not conftest.py: tests/backends has a conftest too, and ``from conftest import``
would pick whichever is first on sys.path.)
"""
from __future__ import annotations

import contextlib

import torch
from transformers import (Glm4Config, Glm4ForCausalLM, GlmConfig, GlmForCausalLM, GraniteConfig, GraniteForCausalLM,
                          LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig,
                          MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, SmolLM3Config,
                          SmolLM3ForCausalLM)

import hf_paged

VOCAB = 256
PAD, EOS, BOS = 0, 1, 2
COMMON = dict(vocab_size=VOCAB, num_hidden_layers=2, intermediate_size=256, max_position_embeddings=512,
              pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, tie_word_embeddings=False)

# GQA everywhere; head_dim 64 for most and 32 for qwen2, so two head sizes are covered.
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                                  head_dim=64)),
    "glm": (GlmConfig, GlmForCausalLM, dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=64)),
    "glm4": (Glm4Config, Glm4ForCausalLM, dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1,
                                               head_dim=64)),
}

# The families' relatives (hf_paged.families): windows shorter than the tests' prompts where the family has
# one (Qwen3-MoE's attention takes config.sliding_window on every layer); MoE layers beside a dense one
# (Qwen2-MoE's mlp_only_layers); SmolLM3's fourth layer without RoPE and windowed; Granite's multipliers.
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=64)
RELATIVES = {
    "mistral": (MistralConfig, MistralForCausalLM, dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                                        head_dim=32, sliding_window=9)),
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                                        num_local_experts=4, num_experts_per_tok=2,
                                                        sliding_window=None)),
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM, dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                                        num_hidden_layers=4, use_sliding_window=True,
                                                        sliding_window=8)),
    "granite": (GraniteConfig, GraniteForCausalLM, dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                                        attention_multiplier=0.09, residual_multiplier=0.6,
                                                        embedding_multiplier=3.0, logits_scaling=2.0)),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, num_experts=4,
        shared_expert_intermediate_size=96, mlp_only_layers=[1], use_sliding_window=True, sliding_window=7,
        max_window_layers=3, **MOE)),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
        sliding_window=11, use_sliding_window=True, **MOE)),
}


def make_model(family: str, seed: int = 0, dtype=torch.float32, **overrides):
    config_cls, model_cls, shape = FAMILIES[family] if family in FAMILIES else RELATIVES[family]
    config = config_cls(**{**COMMON, **shape, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    return model


def make_batch(lengths, seed: int = 0, width: int | None = None):
    """Left-padded random prompts of the given lengths: (input_ids, attention_mask) [B, width]."""
    gen = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask


def left_padded(prompts: list[list[int]], pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [B, max_len] of the given token lists, right-aligned."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


@contextlib.contextmanager
def patched(model, **options):
    hf_paged.patch(model, **options)
    try:
        yield model
    finally:
        hf_paged.unpatch(model)


def generate_both(model, seed: int = 0, **kwargs):
    """(reference, paged) generate outputs for the same arguments and RNG seed."""
    torch.manual_seed(seed)
    reference = model.generate(**kwargs)
    with patched(model):
        torch.manual_seed(seed)
        paged = model.generate(cache_implementation="paged", **kwargs)
    return reference, paged


def sequences(out):
    return out if isinstance(out, torch.Tensor) else out.sequences


def word_tokenizer():
    """An offline word-level tokenizer over the tiny models' vocabulary: token i is the word 'w<i>'."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(3, VOCAB)}
    vocab.update({"<pad>": PAD, "</s>": EOS, "<s>": BOS})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    tok.padding_side = "left"
    return tok


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w9{% endif %}"


def chat_word_tokenizer():
    """``word_tokenizer()`` with a chat template: messages joined by spaces, the assistant's turn opened by w9."""
    tok = word_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok
