"""The supported model families, declared: what hf_paged needs to know about each, read from a config.

All are native transformers models whose attention calls ``cache.update`` with post-RoPE keys and
then the registered attention function, so a family is a declaration: where the KV geometry lives in
the config, and which layers use a sliding window. Beside the five families the project was built for
(llama, qwen2, qwen3, glm, glm4) stand their relatives whose attention is one of theirs: Mistral and
Mixtral (LLaMA's attention with a window over every layer), SmolLM3 and Granite (LLaMA's, without RoPE
on some layers / with its own scale), Qwen2-MoE and Qwen3-MoE (Qwen2's and Qwen3's attention; the MoE
blocks are MLPs, which the cache never sees). What a loaded model instance holds (its
tensor-parallel share of the heads, each layer's device) is read by ``hf_paged.introspect``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVGeometry:
    """Shape of the KV cache a model needs. ``sliding_windows[i]`` is 0 for full-attention layers."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_windows: tuple[int, ...]
    # Where each layer's attention runs (accelerate's device_map may spread layers); None = one device.
    layer_devices: tuple[torch.device, ...] | None = None

    def bytes_per_token(self, dtype: torch.dtype, kv_format=None) -> int:
        """KV bytes one token takes over all layers, keys and values, in ``dtype`` or, when given, in the
        quantised ``kv_format`` (an ``hf_paged.kv_formats.KVFormat``; scales included)."""
        if kv_format is not None:
            per_head = kv_format.bytes_per_head_token(self.head_dim)
        else:
            per_head = self.head_dim * torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * per_head


@dataclass(frozen=True)
class ModelFamily:
    """One supported ``model_type``; ``geometry`` reads its KV geometry from a (decoder) config."""
    model_type: str
    notes: str
    # True: every layer's attention takes config.sliding_window whenever it is set (Mistral, Mixtral and
    # Qwen3-MoE pass it whatever use_sliding_window says); False: layer_types, else use_sliding_window decide.
    window_from_config: bool = False

    def geometry(self, config) -> KVGeometry:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        layers = config.num_hidden_layers
        return KVGeometry(layers, kv_heads, head_dim, _sliding_windows(config, layers, self.window_from_config))


def _sliding_windows(config, num_layers: int, from_config: bool = False) -> tuple[int, ...]:
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None) or 0
    if from_config:
        return (window,) * num_layers
    if layer_types is None:
        return (window,) * num_layers if window and getattr(config, "use_sliding_window", True) else (0,) * num_layers
    return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)


FAMILIES = {
    family.model_type: family
    for family in (
        ModelFamily("llama", "LLaMA / SmolLM: GQA, RoPE."),
        ModelFamily("qwen2", "Qwen2 / Qwen2.5: QKV bias, optional sliding window on some layers."),
        ModelFamily("qwen3", "Qwen3: q/k RMSNorm before RoPE (inside the model), optional sliding window."),
        ModelFamily("glm", "GLM-4-9B-chat-hf and ChatGLM2/3 checkpoints loaded by integrations.chatglm:"
                             " partial interleaved RoPE, few KV heads."),
        ModelFamily("glm4", "GLM-4-0414: as glm, with two extra norms per layer."),
        ModelFamily("mistral", "Mistral: LLaMA's attention, config.sliding_window on every layer.", True),
        ModelFamily("smollm3", "SmolLM3: LLaMA's attention, no RoPE on the no_rope_layers, a window by layer_types."),
        ModelFamily("granite", "Granite: LLaMA's attention scaled by attention_multiplier; multipliers elsewhere."),
        ModelFamily("mixtral", "Mixtral: Mistral's attention, MoE MLPs.", True),
        ModelFamily("qwen2_moe", "Qwen2-MoE / Qwen1.5-MoE: Qwen2's attention (window by layer_types), MoE MLPs."),
        ModelFamily("qwen3_moe", "Qwen3-MoE: Qwen3's attention, config.sliding_window on every layer, MoE MLPs.",
                    True),
    )
}


class UnsupportedModelError(ValueError):
    pass


def family_for(config) -> ModelFamily:
    """The family of a (decoder) config, or a clear error naming the supported model types."""
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    model_type = getattr(text_config, "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"hf_paged does not support model_type={model_type!r}; supported: {', '.join(sorted(FAMILIES))}. "
            "(ChatGLM2/3 checkpoints: load them with hf_paged.integrations.chatglm.load_chatglm first.)"
        )
    return FAMILIES[model_type]


def config_geometry(config) -> KVGeometry:
    """The KV geometry ``config`` describes (the whole model, every KV head)."""
    return family_for(config).geometry(config.get_text_config(decoder=True))
