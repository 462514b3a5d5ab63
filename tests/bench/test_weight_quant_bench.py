"""The weight-quant bench's byte count: every tensor once (tied embeddings), quantised tensors by what
they store, checked against the parameters' own sizes on a tiny llama."""
from __future__ import annotations

import pytest
import torch
from tiny_models import make_model

from bench.weight_quant import weight_bytes


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())      # parameters() dedupes ties


def test_float_model_counts_each_parameter_once():
    model = make_model("llama", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert weight_bytes(model) == _param_bytes(model)


@pytest.mark.parametrize("scheme, library, at_most", [("torchao-int8", "torchao", 0.30), ("bnb-nf4", "bitsandbytes", 0.20)])
def test_quantised_linears_count_their_codes(scheme, library, at_most):
    """int8 codes + a scale per row are ~1/4 of fp32; nf4 ~1/8 plus absmax per 64: the linears' share of
    the bytes shrinks accordingly (the embeddings and norms stay fp32)."""
    pytest.importorskip(library)
    from hf_paged.integrations.weight_quant import quantize_model

    model = make_model("llama")
    linears = sum(m.weight.numel() * 4 for n, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and n != "lm_head")
    before = weight_bytes(model)
    after = weight_bytes(quantize_model(model, scheme))
    assert 0 < before - after and after - (before - linears) <= at_most * linears
