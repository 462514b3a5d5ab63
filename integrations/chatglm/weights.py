"""ChatGLM tensors → Glm tensors: the expected names and shapes, the mapping (``query_key_value`` split),
reading the weight files (safetensors or ``.bin`` with ``weights_only=True``, single or sharded), and the
strict state-dict assembly."""
from __future__ import annotations

import json
import os
import re
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from .config import ChatGLMCheckpointError, ChatGLMShape


# --------------------------------------------------------------------------------------------------
# Tensor names, shapes and the mapping
# --------------------------------------------------------------------------------------------------

_LAYER = re.compile(r"^transformer\.encoder\.layers\.(\d+)\.(.+)$")
# Stored by THUDM's checkpoints (a persistent buffer) but never read by the remote forward, which
# recomputes the frequencies from rope_ratio; its shape is still checked.
_IGNORED = "transformer.rotary_pos_emb.inv_freq"


def _expected_shapes(s: ChatGLMShape) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every ChatGLM tensor a checkpoint of shape ``s`` must hold: its shape, and the config.json
    fields that determine it (for error messages)."""
    groups = "multi_query_group_num" if s.multi_query else "num_attention_heads"
    qkv_rows = (s.num_heads + 2 * s.num_groups) * s.head_dim
    qkv_why = f"(num_attention_heads + 2 * {groups}) * kv_channels"
    vocab = ((s.vocab_size, s.hidden_size), "[padded_vocab_size, hidden_size]")
    norm = ((s.hidden_size,), "[hidden_size]")
    shapes = {
        "transformer.embedding.word_embeddings.weight": vocab,
        "transformer.encoder.final_layernorm.weight": norm,
        "transformer.output_layer.weight": vocab,
    }
    for i in range(s.num_layers):
        p = f"transformer.encoder.layers.{i}."
        shapes[p + "input_layernorm.weight"] = norm
        shapes[p + "post_attention_layernorm.weight"] = norm
        shapes[p + "self_attention.query_key_value.weight"] = (
            (qkv_rows, s.hidden_size), f"[{qkv_why}, hidden_size]")
        if s.qkv_bias:
            shapes[p + "self_attention.query_key_value.bias"] = ((qkv_rows,), f"[{qkv_why}]")
        shapes[p + "self_attention.dense.weight"] = (
            (s.hidden_size, s.num_heads * s.head_dim), "[hidden_size, num_attention_heads * kv_channels]")
        shapes[p + "mlp.dense_h_to_4h.weight"] = (
            (2 * s.ffn_hidden_size, s.hidden_size), "[2 * ffn_hidden_size, hidden_size]")
        shapes[p + "mlp.dense_4h_to_h.weight"] = (
            (s.hidden_size, s.ffn_hidden_size), "[hidden_size, ffn_hidden_size]")
    return shapes


def _split_qkv(t: torch.Tensor, s: ChatGLMShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a fused ``query_key_value`` weight ``[rows, hidden]`` or bias ``[rows]`` into q, k, v.

    Returns ``q [heads*hd, ...]``, ``k [groups*hd, ...]``, ``v [groups*hd, ...]``, each with its own
    storage (shared storage would make save_pretrained treat them as tied).
    """
    hd, rest = s.head_dim, t.shape[1:]
    if s.multi_query:
        q, k, v = t.split([s.num_heads * hd, s.num_groups * hd, s.num_groups * hd], dim=0)
    else:
        per_head = t.reshape(s.num_heads, 3, hd, *rest)
        q, k, v = (per_head[:, j].reshape(s.num_heads * hd, *rest) for j in range(3))
    return q.clone(), k.clone(), v.clone()


def _map_tensor(name: str, t: torch.Tensor, s: ChatGLMShape) -> list[tuple[str, torch.Tensor]]:
    """The GlmForCausalLM state-dict entries made from ChatGLM tensor ``name`` (already shape-checked)."""
    fixed = {
        "transformer.embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "transformer.encoder.final_layernorm.weight": "model.norm.weight",
        "transformer.output_layer.weight": "lm_head.weight",
    }
    if name in fixed:
        return [(fixed[name], t)]
    layer, rest = _LAYER.match(name).groups()
    p = f"model.layers.{layer}."
    if rest.startswith("self_attention.query_key_value."):
        kind = rest.rsplit(".", 1)[1]  # weight | bias
        q, k, v = _split_qkv(t, s)
        return [(p + f"self_attn.q_proj.{kind}", q), (p + f"self_attn.k_proj.{kind}", k),
                (p + f"self_attn.v_proj.{kind}", v)]
    renamed = {
        "input_layernorm.weight": "input_layernorm.weight",
        "post_attention_layernorm.weight": "post_attention_layernorm.weight",
        "self_attention.dense.weight": "self_attn.o_proj.weight",
        "mlp.dense_h_to_4h.weight": "mlp.gate_up_proj.weight",
        "mlp.dense_4h_to_h.weight": "mlp.down_proj.weight",
    }
    return [(p + renamed[rest], t)]


# --------------------------------------------------------------------------------------------------
# Reading weight files
# --------------------------------------------------------------------------------------------------

_LAYOUTS = (  # (index file, single file, format), in order of preference
    ("model.safetensors.index.json", "model.safetensors", "safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model.bin", "bin"),
)


def _weight_files(path: str) -> tuple[str, list[tuple[str, set[str] | None]]]:
    """The checkpoint's format and its weight files, each with the tensor names its index assigns it
    (``None`` for an unsharded checkpoint)."""
    for index_name, single_name, fmt in _LAYOUTS:
        index_path = os.path.join(path, index_name)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ChatGLMCheckpointError(index_path, None, f"not a valid index (needs 'weight_map'): {e}")
            shards: dict[str, set[str]] = {}
            for tensor, shard in weight_map.items():
                shards.setdefault(shard, set()).add(tensor)
            for shard, tensors in shards.items():
                if not os.path.isfile(os.path.join(path, shard)):
                    raise ChatGLMCheckpointError(
                        index_path, sorted(tensors)[0],
                        f"names shard {shard!r} (for {len(tensors)} tensors), which does not exist in {path}")
            return fmt, [(os.path.join(path, shard), shards[shard]) for shard in sorted(shards)]
        single_path = os.path.join(path, single_name)
        if os.path.isfile(single_path):
            return fmt, [(single_path, None)]
    looked = ", ".join(n for layout in _LAYOUTS for n in layout[:2])
    raise ChatGLMCheckpointError(path, None, f"no weights found; looked for {looked}")


def _read_safetensors(file: str) -> Iterator[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]]:
    """Yield ``(name, shape, load)`` per tensor; ``load()`` reads the data. Header errors name the file."""
    try:
        handle = safe_open(file, framework="pt")
        names = list(handle.keys())
        shapes = {n: tuple(handle.get_slice(n).get_shape()) for n in names}
    except Exception as e:  # SafetensorError has no importable public base; OSError for I/O
        raise ChatGLMCheckpointError(file, None, f"unreadable safetensors file (truncated or corrupt?): {e}")
    for n in names:
        yield n, shapes[n], (lambda n=n: handle.get_tensor(n))


def _read_bin(file: str) -> Iterator[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]]:
    """Yield ``(name, shape, load)`` per tensor of a torch ``.bin`` (``weights_only`` unpickling)."""
    try:
        # mmap: tensors stay in the page cache instead of being copied; zip-format files only.
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        try:  # legacy (pre-zip) torch.save format, which cannot be mmapped
            state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception:
            raise ChatGLMCheckpointError(
                file, None, f"unreadable torch checkpoint (truncated or corrupt?): {e}") from None
    if not isinstance(state, dict):
        raise ChatGLMCheckpointError(file, None, f"holds a {type(state).__name__}, not a state dict")
    for n, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise ChatGLMCheckpointError(file, str(n), f"is a {type(t).__name__}, not a tensor")
        yield n, tuple(t.shape), (lambda t=t: t)


def _check_tensor(file: str, name: str, got: tuple[int, ...], shape: ChatGLMShape,
                  expected: dict[str, tuple[tuple[int, ...], str]]) -> bool:
    """Raise unless ``name`` with shape ``got`` belongs in a checkpoint of ``shape``; False means
    "known but unused, skip it"."""
    if name == _IGNORED:
        if got != (shape.head_dim // 4,):
            raise ChatGLMCheckpointError(
                file, name, f"shape {list(got)}, expected [{shape.head_dim // 4}] = [kv_channels // 4]")
        return False
    if name not in expected:
        raise ChatGLMCheckpointError(
            file, name, "unexpected tensor: not part of a ChatGLM2/3 model with this config.json "
                        "(adapter, prefix encoder, quantized weights, or a config mismatch?)")
    want, why = expected[name]
    if got != want:
        raise ChatGLMCheckpointError(
            file, name, f"shape {list(got)} does not match config.json, which implies {list(want)} = {why}")
    return True


def _load_state_dict(path: str, shape: ChatGLMShape, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Read, check and map every tensor of the checkpoint at ``path`` into a Glm state dict in ``dtype``.

    Strict: every expected tensor exactly once, nothing else, each shard holding exactly what its
    index assigns it. Shapes are checked from the file headers before any data is read.
    """
    fmt, files = _weight_files(path)
    expected = _expected_shapes(shape)
    seen: dict[str, str] = {}  # ChatGLM name -> file it came from
    state: dict[str, torch.Tensor] = {}
    reader = _read_safetensors if fmt == "safetensors" else _read_bin
    for file, indexed in files:
        in_file = set()
        for name, got, load in reader(file):
            in_file.add(name)
            if name in seen:
                raise ChatGLMCheckpointError(file, name, f"also stored in {seen[name]}")
            seen[name] = file
            if indexed is not None and name not in indexed:
                raise ChatGLMCheckpointError(file, name, "present in the shard but not listed for it in the index")
            if not _check_tensor(file, name, got, shape, expected):
                continue
            try:
                tensor = load()
            except Exception as e:
                raise ChatGLMCheckpointError(file, name, f"could not read the tensor data: {e}") from e
            if not tensor.is_floating_point():
                raise ChatGLMCheckpointError(file, name, f"dtype {tensor.dtype} is not a float dtype")
            state.update(_map_tensor(name, tensor.to(dtype), shape))
        if indexed is not None and indexed - in_file:
            raise ChatGLMCheckpointError(
                file, sorted(indexed - in_file)[0], "listed in the index for this shard but not stored in it")
    missing = sorted(set(expected) - set(seen))
    if missing:
        where = files[0][0] if len(files) == 1 else os.path.dirname(files[0][0])
        raise ChatGLMCheckpointError(
            where, missing[0],
            f"missing from the checkpoint ({len(missing)} of {len(expected)} expected tensors are missing)")
    return state
