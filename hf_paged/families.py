"""Per-family adapters: what hf_paged needs to know about each supported model family.

All five are native transformers models whose attention calls ``cache.update`` with post-RoPE keys
and then the registered attention function, so an adapter is a declaration: where the KV geometry
lives in the config, and which layers use a sliding window.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGeometry:
    """Shape of the KV cache a model needs. ``sliding_windows[i]`` is 0 for full-attention layers."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_windows: tuple[int, ...]


@dataclass(frozen=True)
class FamilyAdapter:
    model_type: str
    notes: str

    def geometry(self, config) -> KVGeometry:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        layers = config.num_hidden_layers
        return KVGeometry(layers, kv_heads, head_dim, _sliding_windows(config, layers))


def _sliding_windows(config, num_layers: int) -> tuple[int, ...]:
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None) or 0
    if layer_types is None:
        return (window,) * num_layers if window and getattr(config, "use_sliding_window", True) else (0,) * num_layers
    return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)


ADAPTERS = {
    adapter.model_type: adapter
    for adapter in (
        FamilyAdapter("llama", "LLaMA / SmolLM: GQA, RoPE."),
        FamilyAdapter("qwen2", "Qwen2 / Qwen2.5: QKV bias, optional sliding window on some layers."),
        FamilyAdapter("qwen3", "Qwen3: q/k RMSNorm before RoPE (inside the model), optional sliding window."),
        FamilyAdapter("glm", "GLM-4-9B-chat-hf and ChatGLM2/3 checkpoints loaded by integrations.chatglm:"
                             " partial interleaved RoPE, few KV heads."),
        FamilyAdapter("glm4", "GLM-4-0414: as glm, with two extra norms per layer."),
    )
}


class UnsupportedModelError(ValueError):
    pass


def adapter_for(config) -> FamilyAdapter:
    """The adapter for a (decoder) config, or a clear error naming the supported model types."""
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    model_type = getattr(text_config, "model_type", None)
    if model_type not in ADAPTERS:
        raise UnsupportedModelError(
            f"hf_paged does not support model_type={model_type!r}; supported: {', '.join(sorted(ADAPTERS))}. "
            "(ChatGLM2/3 checkpoints: load them with hf_paged.integrations.chatglm.load_chatglm first.)"
        )
    return ADAPTERS[model_type]
