"""Models spread over devices by accelerate's device_map: each layer's pools where that layer runs."""
from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_paged
from hf_paged.families import UnsupportedModelError
from tiny_models import make_batch, make_model, patched, sequences


def test_offloaded_layer_generates_what_the_default_path_does(tmp_path):
    """Layer 1's weights live on disk (meta in memory, loaded by accelerate's hook for each forward)."""
    make_model("qwen2", num_hidden_layers=3).save_pretrained(tmp_path)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path, device_map=device_map,
                                                 offload_folder=str(tmp_path / "offload")).eval()
    assert model.model.layers[1].self_attn.k_proj.weight.device.type == "meta"
    ids, mask = make_batch([4, 9, 6], seed=3)
    for kwargs in (dict(do_sample=False), dict(do_sample=False, num_beams=3)):
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, **kwargs)
        with patched(model):
            got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, cache_implementation="paged",
                                 **kwargs)
        assert torch.equal(sequences(want), sequences(got))
    with patched(model):
        outs = hf_paged.generate_many(model, [[5, 6, 7], [9] * 11], max_new_tokens=5)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]


def test_each_layer_reports_where_it_runs():
    model = make_model("llama")
    attention = model.model.layers[1].self_attn
    attention.k_proj.to("meta")
    attention._hf_hook = types.SimpleNamespace(execution_device="cuda:1")   # what accelerate's hook says
    geometry = hf_paged.model_geometry(model)
    assert geometry.layer_devices == (torch.device("cpu"), torch.device("cuda:1"))
    del attention._hf_hook
    with pytest.raises(UnsupportedModelError, match="layer 1's weights are on the meta device"):
        hf_paged.model_geometry(model)


def test_one_device_has_no_layer_devices():
    assert hf_paged.model_geometry(make_model("glm")).layer_devices is None
