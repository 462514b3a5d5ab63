"""A pre-quantised checkpoint on the paged path: a tiny llama written in compressed-tensors' format
(``save_compressed_tensors``: W4A16 "pack-quantized", W8A8 "int-quantized"), loaded back by plain
``from_pretrained`` (its config.json's ``quantization_config``, no options), then patched generate, the engine
and ``hf-paged serve``'s loader against the same loaded model's default path."""
from __future__ import annotations

import pytest
import torch
from tiny_models import make_batch, make_model, patched, word_tokenizer

import hf_paged

pytest.importorskip("compressed_tensors")
from transformers import AutoModelForCausalLM  # noqa: E402

from hf_paged.integrations.weight_quant import save_compressed_tensors  # noqa: E402

PRESETS = ["W4A16", "W8A8"]
# Logit tolerance against the default path. W4A16's weights are fixed floats once unpacked: attention's
# float rounding only. W8A8 rounds every linear's input to int8 per token, so that rounding can flip a code
# (one step = the row's absmax / 127): on this model and batch the default path's own eager and sdpa
# attention differ by 6.7e-3 (measured 2026-12-03), paged against sdpa by 4.4e-4.
TOLERANCE = {"W4A16": 1e-4, "W8A8": 1e-2}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """preset -> a checkpoint directory (with a tokenizer, for the server's loader)."""
    base, out = make_model("llama"), {}
    for preset in PRESETS:
        directory = tmp_path_factory.mktemp(preset)
        save_compressed_tensors(base, str(directory), preset)
        word_tokenizer().save_pretrained(directory)
        out[preset] = str(directory)
    return out


def _load(directory: str):
    """A fresh load: its linears still hold the checkpoint's codes until the first forward."""
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True).eval()
    model.generation_config.pad_token_id = 0
    return model


def test_the_checkpoint_is_compressed(checkpoints):
    import json

    config = json.load(open(f"{checkpoints['W4A16']}/config.json"))["quantization_config"]
    assert (config["quant_method"], config["format"]) == ("compressed-tensors", "pack-quantized")
    k_proj = _load(checkpoints["W4A16"]).model.layers[0].self_attn.k_proj
    assert k_proj.weight_packed.dtype == torch.int32 and getattr(k_proj, "weight", None) is None


@pytest.mark.parametrize("release", [True, False])
@pytest.mark.parametrize("preset", PRESETS)
def test_patched_generate_equals_default_path(checkpoints, preset, release):
    """Paged first, on a fresh load (the cache is built while k_proj holds packed codes), then the default path."""
    model = _load(checkpoints[preset])
    ids, mask = make_batch([5, 9, 3, 7, 9, 2, 6, 8], seed=1)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
              output_logits=True, return_dict_in_generate=True)
    with patched(model, release_finished_rows=release):
        out = model.generate(cache_implementation="paged", **kw)
    ref = model.generate(**kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits)) < TOLERANCE[preset]


@pytest.mark.parametrize("preset", PRESETS)
def test_engine_equals_generate_per_prompt(checkpoints, preset):
    """The engine built on a fresh load (nothing unpacked yet), prepacked linears on: each prompt's tokens
    equal that prompt alone through the default path, and the model's quantising forwards survive the engine."""
    model = _load(checkpoints[preset])
    prompts = [[5, 17, 33, 9], [40, 41, 42, 43, 44, 45], [7]]
    outs = hf_paged.LLM(model, None, max_num_seqs=2).generate(prompts, max_new_tokens=8, do_sample=False)
    for prompt, out in zip(prompts, outs):
        ref = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
        assert torch.equal(out.sequences[0], ref[0])
    assert "forward" in model.model.layers[0].mlp.down_proj.__dict__       # compressed-tensors' forward kept


def test_engine_after_unpacking_keeps_the_quantising_forward(checkpoints):
    """An engine built after a forward (weights unpacked to float) must not prepack over W8A8's forward,
    which rounds activations: its tokens equal the default path's, and the forward is still there."""
    model = _load(checkpoints["W8A8"])
    prompt = [5, 17, 33, 9, 40, 41]
    ref = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    out = hf_paged.LLM(model, None, max_num_seqs=1).generate([prompt], max_new_tokens=8, do_sample=False)[0]
    assert torch.equal(out.sequences[0], ref[0])
    assert "forward" in model.model.layers[0].self_attn.q_proj.__dict__


def test_serve_loader_needs_no_quantization_flag(checkpoints):
    """``hf-paged serve DIR``'s loader reads the checkpoint's own quantization_config; its paged generate
    equals its default path."""
    from hf_paged.integrations.server.loading import load_model

    model, _ = load_model(checkpoints["W4A16"], dtype="float32", device="cpu")
    assert hasattr(model.model.layers[0].self_attn.k_proj, "weight_packed")
    ids, mask = make_batch([4, 7, 2], seed=3)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    with patched(model):
        out = model.generate(cache_implementation="paged", **kw)
    assert torch.equal(out, model.generate(**kw))


def test_server_completion_equals_generate(checkpoints):
    """An in-process server over the loaded checkpoint: a greedy completion is the default path's tokens."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from live_server import running
    from tiny_models import chat_word_tokenizer

    from hf_paged.integrations.server import create_app

    model, tokenizer = _load(checkpoints["W4A16"]), chat_word_tokenizer()
    prompt = [5, 17, 33, 9, 40]
    app = create_app(model, tokenizer, served_model_name="tiny", num_blocks=16, max_num_seqs=2, block_size=16)
    with running(app) as url:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    ref = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    whole, ahead = tokenizer.decode(ref[0]), tokenizer.decode(prompt)      # the text continues the prompt's
    assert whole.startswith(ahead) and reply["choices"][0]["text"] == whole[len(ahead):] != ""


def test_group_size_that_does_not_divide_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a multiple of the group size 96.*group_size="):
        save_compressed_tensors(make_model("llama"), str(tmp_path), "W4A16", group_size=96)


def test_copy_model_runs_like_the_original_after_a_patch():
    """copy_model (the writer's copy; deepcopy fails on a model a patch or an engine touched): same tokens,
    RoPE's non-persistent buffers included, the original's tensors not shared."""
    from hf_paged.integrations.weight_quant import copy_model

    model = make_model("llama", tie_word_embeddings=True)
    ids, mask = make_batch([5, 3], seed=2)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    with patched(model):
        model.generate(cache_implementation="paged", **kw)
    copied = copy_model(model)
    assert torch.equal(copied.generate(**kw), model.generate(**kw))
    assert copied.lm_head.weight.data_ptr() != model.lm_head.weight.data_ptr()


def test_serve_loader_refuses_quantising_twice_and_int4_on_a_cpu_before_loading(checkpoints):
    """--quantization on a pre-quantised checkpoint was applied to what it could reach (lm_head alone) or ignored;
    torchao-int4 on a CPU was refused only after the model loaded, advising a flag serve does not have."""
    from hf_paged.integrations.server.loading import load_model

    with pytest.raises(ValueError, match="is already quantised \\(compressed-tensors.*drop --quantization bnb-nf4"):
        load_model(checkpoints["W4A16"], device="cpu", quantization="bnb-nf4")
    with pytest.raises(ValueError, match="torchao-int4 has no CPU kernel.*machine with a GPU"):
        load_model("/no/such/checkpoint", device="cpu", quantization="torchao-int4")


def test_serve_loader_quantises_a_chatglm_directory(tmp_path):
    """A ChatGLM directory took the ChatGLM loader's early return: --quantization was silently ignored."""
    pytest.importorskip("torchao")
    import shutil
    from pathlib import Path

    from hf_paged.integrations.server.loading import load_model
    from tiny_models import word_tokenizer

    path = shutil.copytree(Path(__file__).parent.parent / "fixtures" / "chatglm3-tiny", tmp_path / "chatglm")
    model, _ = load_model(str(path), device="cpu", quantization="torchao-int8", tokenizer=word_tokenizer())
    weight = model.model.layers[0].self_attn.q_proj.weight
    assert "Int8" in type(weight).__name__, type(weight).__name__
