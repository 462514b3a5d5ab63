"""``hf_paged.LLM`` built the way vLLM's is: from a checkpoint path (the server's loader), the same tokens as
the engine's LLM on the loaded model; loading options refused for a model already loaded; the engine's own
LLM names the way to load a path."""
from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.engine import LLM as EngineLLM
from tiny_models import make_model, word_tokenizer


def test_a_checkpoint_path_is_loaded_as_vllms_llm_loads_it(tmp_path):
    model, tokenizer = make_model("llama", seed=4), word_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompts = ["w5 w6 w7", "w9"]
    settings = dict(max_new_tokens=5, do_sample=False, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in EngineLLM(model, tokenizer).generate(prompts, **settings)]
    llm = hf_paged.LLM(tmp_path, dtype="float32", device="cpu", block_size=8)
    assert llm.engine.model.dtype == torch.float32 and llm.engine.config.block_size == 8
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, **settings)] == want
    with pytest.raises(ValueError, match="dtype, quantization apply when LLM loads the model from a path"):
        hf_paged.LLM(model, tokenizer, dtype="bfloat16", quantization="int8")
    with pytest.raises(TypeError, match=r"hf_paged.LLM\('/nowhere'\) loads the checkpoint"):
        EngineLLM("/nowhere")
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        hf_paged.LLM(tmp_path / "missing")
