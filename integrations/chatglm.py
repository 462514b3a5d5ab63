"""ChatGLM2 / ChatGLM3 / GLM-4-chat checkpoints on transformers' native ``GlmForCausalLM``, offline.

THUDM's checkpoints (``model_type: "chatglm"``) need ``trust_remote_code``; their remote
``modeling_chatglm.py`` does not use transformers' cache or attention seams, so hf_paged cannot serve
it. The architecture is the one transformers ships as ``glm`` under other tensor names; this module
translates the config and renames/splits the tensors, nothing else:

    transformer.embedding.word_embeddings                 -> model.embed_tokens
    transformer.encoder.layers.N.input_layernorm          -> model.layers.N.input_layernorm
    transformer.encoder.layers.N.self_attention.query_key_value
                                                          -> model.layers.N.self_attn.{q,k,v}_proj
    transformer.encoder.layers.N.self_attention.dense      -> model.layers.N.self_attn.o_proj
    transformer.encoder.layers.N.post_attention_layernorm -> model.layers.N.post_attention_layernorm
    transformer.encoder.layers.N.mlp.dense_h_to_4h        -> model.layers.N.mlp.gate_up_proj
    transformer.encoder.layers.N.mlp.dense_4h_to_h        -> model.layers.N.mlp.down_proj
    transformer.encoder.final_layernorm                   -> model.norm
    transformer.output_layer                              -> lm_head

``query_key_value`` rows are ``[q: heads*hd | k: groups*hd | v: groups*hd]`` with multi-query
attention and ``[head 0: q k v | head 1: q k v | ...]`` (``hd`` rows each) without it, exactly as
the remote ``SelfAttention.forward`` splits them. K/V keep ``groups`` heads: nothing is expanded.

Configs the native model cannot reproduce are refused with :class:`UnsupportedChatGLMConfig`; broken
checkpoints raise :class:`ChatGLMCheckpointError` naming the file and the tensor. Both are
``ValueError`` subclasses (via :class:`ChatGLMLoadError`).
"""
from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from transformers import GlmConfig, GlmForCausalLM

__all__ = [
    "ChatGLMLoadError",
    "UnsupportedChatGLMConfig",
    "ChatGLMCheckpointError",
    "chatglm_config_to_glm",
    "load_chatglm",
]


class ChatGLMLoadError(ValueError):
    """Base class of every refusal or failure of :func:`load_chatglm`."""


class UnsupportedChatGLMConfig(ChatGLMLoadError):
    """config.json describes something GlmForCausalLM cannot reproduce; ``field`` names the key."""

    def __init__(self, field: str, message: str):
        super().__init__(f"config.json field {field!r}: {message}")
        self.field = field


class ChatGLMCheckpointError(ChatGLMLoadError):
    """A weight file is unreadable or its tensors do not match the config.

    ``file`` is the path of the weight file (or index) concerned, ``tensor`` the ChatGLM tensor name
    when one is known.
    """

    def __init__(self, file: str, tensor: str | None, message: str):
        where = f"{file}" + (f", tensor {tensor!r}" if tensor else "")
        super().__init__(f"{where}: {message}")
        self.file = file
        self.tensor = tensor


# --------------------------------------------------------------------------------------------------
# Config translation
# --------------------------------------------------------------------------------------------------

# THUDM's ChatGLMConfig.__init__ defaults: what the remote code uses when config.json omits a key.
_REMOTE_DEFAULTS = {
    "kv_channels": 128,
    "seq_length": 2048,
    "attention_dropout": 0.0,
    "layernorm_epsilon": 1e-5,
    "rmsnorm": True,
    "apply_residual_connection_post_layernorm": False,
    "post_layer_norm": True,
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "multi_query_attention": False,
    "multi_query_group_num": 1,
    "rope_ratio": 1,
    "fp32_residual_connection": False,
    "quantization_bit": 0,
    "pre_seq_len": None,
    # Not a ChatGLMConfig argument; the remote RotaryEmbedding stores it and never reads it, always
    # rotating interleaved pairs. vLLM reads False as NeoX-style halves, which Glm cannot express.
    "original_rope": True,
}
_REQUIRED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "padded_vocab_size")

# (key, refused value, why GlmForCausalLM cannot compute what the remote code computes with it)
_REFUSED_VALUES = (
    ("rmsnorm", False, "LayerNorm (with bias) is not RMSNorm; GlmForCausalLM has RMSNorm only"),
    ("apply_residual_connection_post_layernorm", True,
     "residuals taken after the norm are not the pre-norm residuals GlmDecoderLayer adds"),
    ("post_layer_norm", False, "GlmModel always applies a final norm"),
    ("add_bias_linear", True, "GlmForCausalLM has no bias on o_proj, gate_up_proj or down_proj"),
    ("original_rope", False,
     "non-interleaved (NeoX-style) rotary halves; Glm rotates interleaved pairs only"),
    ("fp32_residual_connection", True, "Glm keeps the residual stream in the model dtype"),
)


def _get(cfg: dict, key: str):
    """``cfg[key]``, or the remote code's default when the key is absent or null."""
    return cfg[key] if cfg.get(key) is not None else _REMOTE_DEFAULTS[key]


@dataclass(frozen=True)
class ChatGLMShape:
    """The sizes of a ChatGLM checkpoint, read from its config.json (remote defaults filled in)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_groups: int   # KV heads: multi_query_group_num, or num_heads without multi-query attention
    head_dim: int     # kv_channels
    vocab_size: int   # padded_vocab_size
    multi_query: bool
    qkv_bias: bool


def _read_shape(cfg: dict) -> ChatGLMShape:
    """Validate ``cfg`` (a parsed ChatGLM config.json) and return its sizes, or refuse."""
    model_type = cfg.get("model_type")
    if model_type != "chatglm":
        raise UnsupportedChatGLMConfig("model_type", f"expected 'chatglm', got {model_type!r}")
    for key in ("position_encoding_2d", "inner_hidden_size"):
        if key in cfg:
            raise UnsupportedChatGLMConfig(
                key, "this is a first-generation ChatGLM-6B config (2D positions, GLM blocks); only "
                     "ChatGLM2/ChatGLM3/GLM-4-chat checkpoints map onto GlmForCausalLM")
    if cfg.get("vision_config") is not None:
        raise UnsupportedChatGLMConfig("vision_config", "vision models (GLM-4V, CogAgent) are not supported")
    if cfg.get("rope_scaling") is not None:
        raise UnsupportedChatGLMConfig(
            "rope_scaling", f"{cfg['rope_scaling']!r}: the remote code has no rotary scaling; this is not a "
                            "THUDM ChatGLM2/3 config")
    for key in _REQUIRED:
        if key not in cfg:
            raise UnsupportedChatGLMConfig(key, "missing, and ChatGLM checkpoints always set it")
    get = functools.partial(_get, cfg)
    for key, bad, why in _REFUSED_VALUES:
        if bool(get(key)) == bad:
            raise UnsupportedChatGLMConfig(key, f"{bad!r} is not supported: {why}")
    if get("pre_seq_len") is not None:
        raise UnsupportedChatGLMConfig(
            "pre_seq_len", f"{cfg['pre_seq_len']!r}: P-tuning prefixes (prefix_encoder) are not supported; "
                           "load the base checkpoint without the prefix")
    if get("quantization_bit"):
        raise UnsupportedChatGLMConfig(
            "quantization_bit", f"{cfg['quantization_bit']!r}: THUDM's int4/int8 weights are not supported; "
                                "use the fp16/bf16 checkpoint")
    heads = int(cfg["num_attention_heads"])
    multi_query = bool(get("multi_query_attention"))
    groups = int(get("multi_query_group_num")) if multi_query else heads
    if groups < 1 or heads % groups:
        raise UnsupportedChatGLMConfig(
            "multi_query_group_num", f"{groups} KV groups do not divide {heads} attention heads")
    # kv_channels * heads != hidden_size is fine: Glm sizes q/o_proj by head_dim, as the remote code
    # sizes them by kv_channels.
    return ChatGLMShape(
        num_layers=int(cfg["num_layers"]), hidden_size=int(cfg["hidden_size"]),
        ffn_hidden_size=int(cfg["ffn_hidden_size"]), num_heads=heads, num_groups=groups,
        head_dim=int(get("kv_channels")), vocab_size=int(cfg["padded_vocab_size"]),
        multi_query=multi_query, qkv_bias=bool(get("add_qkv_bias")) or bool(get("add_bias_linear")),
    )


_ROPE_KEYS = ("rope_type", "rope_theta", "partial_rotary_factor")


def chatglm_config_to_glm(cfg: dict, _config_overrides: dict | None = None) -> GlmConfig:
    """Translate a ChatGLM config.json dict into the equivalent ``GlmConfig``.

    Raises :class:`UnsupportedChatGLMConfig` naming the field when the native model would compute
    something else. ``_config_overrides`` (GlmConfig keyword -> value; ``rope_theta`` and
    ``partial_rotary_factor`` go into ``rope_parameters``) exists for negative-control tests only.
    """
    shape = _read_shape(cfg)
    get = functools.partial(_get, cfg)
    rope = {
        "rope_type": "default",
        # The remote RotaryEmbedding scales its base: base = 10000 * rope_ratio.
        "rope_theta": 10000.0 * float(get("rope_ratio")),
        # It rotates kv_channels // 2 dims of each head, interleaved pairs: Glm's partial rotary.
        "partial_rotary_factor": 0.5,
    }
    kwargs = dict(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.ffn_hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_groups,
        head_dim=shape.head_dim,
        hidden_act="silu",  # remote swiglu: silu(first half) * second half, as GlmMLP
        attention_dropout=float(get("attention_dropout")),
        max_position_embeddings=int(get("seq_length")),
        rms_norm_eps=float(get("layernorm_epsilon")),
        attention_bias=shape.qkv_bias,
        # The remote model never ties: output_layer is always its own tensor.
        tie_word_embeddings=False,
        pad_token_id=cfg.get("pad_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
        bos_token_id=cfg.get("bos_token_id"),
    )
    for key, value in (_config_overrides or {}).items():
        (rope if key in _ROPE_KEYS else kwargs)[key] = value
    config = GlmConfig(rope_parameters=rope, **kwargs)
    # GlmConfig turns a missing eos_token_id into GLM-4's ids; ChatGLM without one means none.
    config.eos_token_id = kwargs["eos_token_id"]
    config.architectures = ["GlmForCausalLM"]
    return config


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
