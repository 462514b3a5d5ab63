"""What a loaded model instance holds, read from its modules: the KV heads this process has (a
tensor-parallel rank holds a share), and the device each layer's attention runs on (a device_map).
The declared, config-level facts are in ``hf_paged.families``."""
from __future__ import annotations

from dataclasses import replace

import torch

from .families import KVGeometry, UnsupportedModelError, config_geometry


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


def _k_weight(k_proj) -> torch.Tensor:
    """``k_proj``'s weight as stored: a compressed-tensors "pack-quantized" linear that has not run yet has
    no ``weight`` but ``weight_packed`` (int32 words of 4-bit codes) until its first forward unpacks it."""
    weight = getattr(k_proj, "weight", None)
    return weight if weight is not None else k_proj.weight_packed


def _local_kv_heads(attention, head_dim: int) -> int:
    k_proj = attention.k_proj
    weight = _k_weight(k_proj)
    if hasattr(weight, "to_local"):         # a DTensor shard of transformers' tensor parallelism
        weight = weight.to_local()
    # bitsandbytes' 4-bit Params4bit is stored packed ([out*in/2, 1] uint8); its quant_state keeps the
    # logical [out, in] shape. compressed-tensors' packed weight keeps it in the ``weight_shape`` buffer.
    # Every other weight (torchao subclasses, int8, DTensor shards) has it as shape.
    shape = getattr(getattr(weight, "quant_state", None), "shape", None)
    if shape is None and getattr(k_proj, "weight", None) is None:
        shape = [int(n) for n in k_proj.weight_shape]
    shape = shape or weight.shape
    return shape[0] // head_dim


def _execution_device(attention, layer: int) -> torch.device:
    device = _k_weight(attention.k_proj).device
    if device.type != "meta":
        return device
    hook = getattr(attention, "_hf_hook", None) or getattr(attention.k_proj, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is None:
        raise UnsupportedModelError(
            f"layer {layer}'s weights are on the meta device and no accelerate hook says where it runs; load the "
            "model with a device_map (accelerate) or materialise its weights before using hf_paged")
    return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)


LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def length_dependent_rope(model) -> tuple[str, int] | None:
    """(rope type, tokens) where ``model``'s rotary embedding changes its frequencies with the longest
    position of each forward (transformers' ``dynamic_rope_update``: dynamic NTK grows them past the original
    context, longrope switches to its long factors past ``original_max_position_embeddings``): a forward whose
    positions all stay within ``tokens`` computes the original frequencies whatever else it holds. None for
    static RoPE (default, linear, llama3, yarn, ...). Dynamic NTK's limit is one below its original context:
    at it, a model whose frequencies an earlier longer call grew keeps them."""
    found = []
    for module in model.modules():
        kinds = getattr(module, "rope_type", None)
        if kinds is None or not hasattr(module, "original_max_seq_len"):       # not a rotary embedding
            continue
        for layer_type, kind in (kinds.items() if isinstance(kinds, dict) else [(None, kinds)]):
            if kind == "dynamic":
                found.append((kind, int(module.original_max_seq_len) - 1))
            elif kind == "longrope":
                params = module.config.rope_parameters
                params = params[layer_type] if layer_type is not None else params
                found.append((kind, int(params.get("original_max_position_embeddings")
                                        or module.original_max_seq_len)))
    return min(found, key=lambda f: f[1]) if found else None


EXTENDING_ROPE = ("linear", "dynamic", "yarn")   # llama3 / longrope count their extension in max_position_embeddings


def trained_context(text_config) -> int | None:
    """The context a model's positions cover, as vLLM derives its max_model_len: ``max_position_embeddings``,
    or that times the RoPE scaling factor of the types that extend it (yarn: its
    original_max_position_embeddings times it); None when the config names no length."""
    limit = getattr(text_config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None
    params = getattr(text_config, "rope_parameters", None) or {}
    groups = list(params.values()) if all(isinstance(v, dict) for v in params.values()) else [params]
    longest = limit
    for group in groups:                  # one per layer type where the config has several
        kind, factor = group.get("rope_type", group.get("type")), group.get("factor")
        if kind in EXTENDING_ROPE and isinstance(factor, (int, float)) and factor > 1:
            base = group.get("original_max_position_embeddings") if kind == "yarn" else None
            longest = max(longest, int((base or limit) * factor))
    return longest


def weights_key(model) -> tuple:
    """Which tensors the model's parameters are and how often each was written in place: it changes when
    weights are loaded (``load_state_dict``'s ``copy_`` bumps a tensor's version) or converted (new storage).
    What was computed from the weights (prefix-cached K/V, prepacked copies) is stale once it changes."""
    key = []
    for p in model.parameters():
        # an inference tensor (made under torch.inference_mode) has no version counter: its storage alone
        version = 0 if p.is_inference() else p._version
        try:
            key.append((id(p), p.data_ptr(), version))
        except (RuntimeError, NotImplementedError):        # a tensor subclass without plain storage
            key.append((id(p), id(p.data), version))
    return tuple(key)
