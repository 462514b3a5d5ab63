"""ChatGLM config.json → GlmConfig, and the errors of the ChatGLM loader (see the package docstring)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from transformers import GlmConfig


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
