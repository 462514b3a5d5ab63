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
from .config import ChatGLMCheckpointError, ChatGLMLoadError, UnsupportedChatGLMConfig, chatglm_config_to_glm
from .loader import load_chatglm

__all__ = [
    "ChatGLMLoadError",
    "UnsupportedChatGLMConfig",
    "ChatGLMCheckpointError",
    "chatglm_config_to_glm",
    "load_chatglm",
]
