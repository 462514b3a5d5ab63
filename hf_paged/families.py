"""Per-family adapters: what hf_paged needs to know about each supported model family.

All five are native transformers models whose attention calls ``cache.update`` with post-RoPE keys
and then the registered attention function, so an adapter is a declaration: where the KV geometry
lives in the config, and which layers use a sliding window.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

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


def config_geometry(config) -> KVGeometry:
    """The KV geometry ``config`` describes (the whole model, every KV head)."""
    return adapter_for(config).geometry(config.get_text_config(decoder=True))


def model_geometry(model) -> KVGeometry:
    """The KV geometry of ``model`` as this process holds it.

    Under transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")``) each rank's
    ``k_proj`` holds ``num_kv_heads / tp_size`` heads, and its KV pools must hold only those; the local
    count is read from the sharded module, not the config. Layers spread over devices by a
    ``device_map`` give each layer's device (its accelerate hook's execution device where its weights are
    offloaded).
    """
    geometry = config_geometry(model.config)
    attention = attention_modules(model, geometry.num_layers)
    tp_size = tensor_parallel_size(model)
    if tp_size > 1 and geometry.num_kv_heads % tp_size:
        raise UnsupportedModelError(
            f"tensor parallelism over {tp_size} ranks needs num_key_value_heads ({geometry.num_kv_heads}) to be a "
            f"multiple of {tp_size} (transformers' tp_plan shards whole KV heads; it cannot run this model either). "
            f"Use a tp_size that divides {geometry.num_kv_heads}.")
    local = {_local_kv_heads(module, geometry.head_dim) for module in attention}
    if len(local) != 1:
        raise UnsupportedModelError(f"layers hold different numbers of KV heads {sorted(local)}; hf_paged needs one")
    devices = tuple(_execution_device(module, i) for i, module in enumerate(attention))
    return replace(geometry, num_kv_heads=local.pop(),
                   layer_devices=devices if len(set(devices)) > 1 else None)


def tensor_parallel_size(model) -> int:
    """The number of ranks ``model`` is sharded over by transformers' ``tp_plan`` (1 when it is not)."""
    return getattr(model, "tp_size", None) or getattr(model, "_tp_size", None) or 1


def attention_modules(model, num_layers: int) -> list:
    """The model's attention modules in layer order (every supported family names them ``self_attn``
    with a ``layer_idx`` and a ``k_proj``)."""
    found = {m.layer_idx: m for m in model.modules() if hasattr(m, "k_proj") and hasattr(m, "layer_idx")}
    if sorted(found) != list(range(num_layers)):
        raise UnsupportedModelError(f"found attention modules for layers {sorted(found)} but the config has "
                                    f"{num_layers} layers; hf_paged cannot tell where each layer's KV lives")
    return [found[i] for i in range(num_layers)]


def _local_kv_heads(attention, head_dim: int) -> int:
    weight = attention.k_proj.weight
    if hasattr(weight, "to_local"):         # a DTensor shard of transformers' tensor parallelism
        weight = weight.to_local()
    return weight.shape[0] // head_dim


def _execution_device(attention, layer: int) -> torch.device:
    device = attention.k_proj.weight.device
    if device.type != "meta":
        return device
    hook = getattr(attention, "_hf_hook", None) or getattr(attention.k_proj, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is None:
        raise UnsupportedModelError(
            f"layer {layer}'s weights are on the meta device and no accelerate hook says where it runs; load the "
            "model with a device_map (accelerate) or materialise its weights before using hf_paged")
    return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
