"""A real tiny Llama that writes a given script under greedy decoding: a bigram model built from weights.

Each piece of the script is one token (the byte-level tokenizer's bytes, or a piece added as a token of its
own), and each token of the script has one successor: the prompt's last token leads to the first piece, the
last piece to EOS. The model is one decoder layer whose attention and MLP write nothing into the residual
stream (zero output projections), so the final hidden state is the current token's one-hot embedding,
normalised; the LM head maps it to logits that pick the successor (any other token is followed by EOS).
Server tests use it to make a real engine produce exact answers (reasoning, tool calls) through every layer.
"""
from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

EOS_TEXT = "<|im_end|>"
# added tokens, not special (as Qwen3's <think> / <tool_call>): their text stays in the answer
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def byte_tokenizer(pieces=(), template: str | None = None) -> PreTrainedTokenizerFast:
    """One token per byte, ``<|im_end|>`` the EOS and ``<|im_start|>`` (special, as ChatML's), ``MARKERS`` and
    ``pieces`` added tokens."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TEXT, pad_token=EOS_TEXT,
                                  additional_special_tokens=["<|im_start|>"])
    tok.add_tokens(MARKERS + [p for p in dict.fromkeys(pieces) if p not in MARKERS])
    if template is not None:
        tok.chat_template = template
    return tok


def scripted_model(tok, start: int, script: list[str]):
    """A Llama over ``tok`` that answers ``script`` (each piece one token of ``tok``) greedily after a prompt
    ending in token ``start``, then EOS. No token may occur twice in ``[start] + script``."""
    from tiny_models import make_model  # noqa: PLC0415  (byte_tokenizer alone runs in vLLM's venv: its fixtures)

    chain = [start] + [_one_token(tok, piece) for piece in script] + [tok.eos_token_id]
    if len(set(chain[:-1])) != len(chain) - 1:
        raise ValueError(f"a bigram script needs distinct tokens: {chain}")
    vocab = len(tok)
    hidden = -(-vocab // 64) * 64                 # one-hot embeddings: one dimension per token
    model = make_model("llama", vocab_size=vocab, hidden_size=hidden, num_attention_heads=hidden // 64,
                       num_key_value_heads=hidden // 64, num_hidden_layers=1, intermediate_size=64,
                       max_position_embeddings=4096,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = tok.eos_token_id
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[torch.arange(vocab), torch.arange(vocab)] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = model.lm_head.weight
        head.zero_()
        head[tok.eos_token_id, :vocab] = 1.0     # any token: EOS, unless the script says otherwise
        for a, b in zip(chain, chain[1:]):
            head[b, a] = 5.0
    return model


def _one_token(tok, piece: str) -> int:
    ids = tok(piece, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"script piece {piece!r} is {len(ids)} tokens; add it to the tokenizer (byte_tokenizer's "
                         "pieces)")
    return ids[0]
