"""Weight-quantised models for the paged path: the schemes ``hf-paged serve --quantization`` accepts and
how each one is applied to a loaded or a saved model.

Schemes (vLLM's flag name ``--quantization``; ``bitsandbytes`` is vLLM's value and means bnb 4-bit nf4):

- ``bnb-int8``: bitsandbytes LLM.int8 (``load_in_8bit``), ``bnb-nf4`` / ``bnb-fp4`` / ``bitsandbytes``:
  bitsandbytes 4-bit, compute in the model's float dtype. Applied at load time (from_pretrained with a
  ``BitsAndBytesConfig``), so an in-memory model is saved to a temporary directory and loaded again.
- ``torchao-int8``: torchao int8 weight-only, ``torchao-int4``: torchao int4 weight-only (group 128),
  applied in place to a loaded model (``torchao.quantization.quantize_``).

Exactness on the paged path. The paged path feeds every quantised linear the same activations as the
default path (same shapes, dtype, contiguity; pad queries' attention output is zero) up to the float
rounding of attention itself: paged attention reduces in another order than SDPA/eager, ~1e-7 apart in fp32.
torchao int8/int4 and bnb nf4/fp4 are continuous in their input, so their tokens match the default path.
**bnb int8 (LLM.int8) is not**: it casts activations to fp16 and rounds each row to int8 codes (row absmax
/ 127), so a 1-ulp fp32 difference can flip a code and the logits move by ~1. Measured on SmolLM2-135M
(each of the demo's 8 prompts alone, 24 greedy tokens): transformers' own default path with
``attn_implementation="eager"`` against ``"sdpa"`` agrees on 3/8 rows, first-step logits up to 2.6 apart;
paged against sdpa agrees on 5/8, up to 2.0 apart. Which outputs can differ: any token after the first
hidden state whose fp16/int8 rounding lands on the other side of a boundary; nothing in hf_paged changes
that (the same holds between any two correct attention kernels). LLM.int8 also picks its fp16 outlier
columns (|x| > 6) over all rows of one call, so in a batch a row's output depends on the other rows and on
pad positions, in the default path too; each prompt alone is its defined reference. The tests check the
invariant (same linear inputs up to attention rounding) and the tokens where no boundary is hit.

A pre-quantised checkpoint (its config.json has a ``quantization_config``) needs no scheme: transformers
loads it as it is. Libraries are optional: a missing one raises ImportError naming the pip extra.
"""
from __future__ import annotations

import importlib.util
import tempfile

import torch

EXTRA = "quant"
BNB = {"bnb-int8": "int8", "bnb-nf4": "nf4", "bnb-fp4": "fp4", "bitsandbytes": "nf4"}
TORCHAO = {"torchao-int8", "torchao-int4"}
SCHEMES = (*BNB, *sorted(TORCHAO))


def require(module: str) -> None:
    """ImportError naming the extra when ``module`` is not installed."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"weight quantisation with {module} needs it installed: pip install 'hf_paged[{EXTRA}]' "
                          f"(or pip install {module})")


def check_scheme(scheme: str | None) -> None:
    if scheme is not None and scheme not in SCHEMES:
        raise ValueError(f"unknown quantization {scheme!r}; known: {', '.join(SCHEMES)} (a pre-quantised "
                         "checkpoint needs none)")


def bnb_config(scheme: str, dtype: torch.dtype):
    """transformers' BitsAndBytesConfig for a bitsandbytes scheme; 4-bit computes in ``dtype``."""
    require("bitsandbytes")
    from transformers import BitsAndBytesConfig

    kind = BNB[scheme]
    if kind == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_compute_dtype=dtype)


def quantize_loaded(model, scheme: str):
    """Apply a torchao scheme in place to a loaded model (its linears; embeddings stay as they are)."""
    require("torchao")
    if scheme == "torchao-int4" and model.device.type == "cpu":
        # torchao's int4 weight-only layouts run on CUDA (mslk, tinygemm) or XPU/NPU kernels only; on a CPU
        # quantize_ fails deep inside with "Requires mslk" (checked with torchao 0.18).
        raise ValueError("torchao-int4 has no CPU kernel in torchao (its int4 weight-only layouts need CUDA "
                         "or XPU); on a CPU use --quantization bnb-nf4 / bnb-fp4 (4-bit) or torchao-int8, "
                         "or load the model on a GPU (--device cuda)")
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    config = Int8WeightOnlyConfig() if scheme == "torchao-int8" else Int4WeightOnlyConfig(group_size=128)
    quantize_(model, config)
    return model


def load_quantized(source: str, scheme: str, dtype: torch.dtype | None, device: str, **options):
    """``AutoModelForCausalLM.from_pretrained(source)`` with ``scheme`` applied, in eval mode on ``device``."""
    from transformers import AutoModelForCausalLM

    check_scheme(scheme)
    if scheme in BNB:
        config = bnb_config(scheme, dtype or torch.float32)
        # bitsandbytes places its layers at load time; .to() on a quantised model is refused.
        return AutoModelForCausalLM.from_pretrained(source, dtype=dtype or "auto", quantization_config=config,
                                                    device_map=device, **options).eval()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype or "auto", **options).to(device).eval()
    return quantize_loaded(model, scheme)


def quantize_model(model, scheme: str):
    """``model`` with ``scheme`` applied: torchao in place; bitsandbytes by saving ``model`` to a temporary
    directory and loading it back quantised (the only route transformers gives bitsandbytes)."""
    check_scheme(scheme)
    if scheme not in BNB:
        return quantize_loaded(model, scheme)
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        quantised = load_quantized(directory, scheme, model.dtype, str(model.device), local_files_only=True)
    quantised.generation_config = model.generation_config
    return quantised
