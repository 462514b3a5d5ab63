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
torchao int8/int4 and bnb nf4/fp4 are continuous in their input, so their tokens match the default path,
with one exception by CPU: **bnb >= 0.50's 4-bit CPU kernel on CPUs with AVX-512 BF16** (its
``support_avx512bf16_for_cpu`` path, taken on a module's first inference forward: the weights are repacked and
``gemv_4bit`` runs in bfloat16) rounds every activation to bf16, so a 1-ulp fp32 difference that crosses a
bf16 rounding boundary moves the logits by ~1e-3 and can, rarely, change a token. Measured on a tiny llama on
an AMD EPYC (Zen 4, AVX-512 BF16), 8 padded prompts, 12 greedy tokens: paged against sdpa 1.0e-3 (nf4) and
1.5e-3 (fp4), tokens equal; transformers' own eager against sdpa 0.55 (nf4, tokens differ) and 3.1e-3 (fp4).
``bnb_float32_kernel(model)`` keeps those linears on bnb's float32 dequantising path (exact on the paged
path: 4.8e-7, the tests' reference on every CPU), at that path's speed.
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
loads it as it is. ``save_compressed_tensors`` writes one in compressed-tensors' format (vLLM's
``W4A16`` "pack-quantized" or ``W8A8`` "int-quantized"): transformers loads its packed codes and unpacks them
into float weights on the first forward (compressed-tensors has no CPU kernel for packed weights, so in
memory the model is as large as unquantised; the saving is on disk). W4A16's weights are then fixed values, as
exact on the paged path as any float model. W8A8 also rounds each linear's input to int8 per token on every
call (dynamic, one scale per row, so no row depends on another), which, like LLM.int8's rounding, can turn
attention's float rounding into a code flip. Libraries are optional: a missing one raises ImportError naming
the pip extra.
"""
from __future__ import annotations

import copy
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


INT4_ON_CPU = ("torchao-int4 has no CPU kernel in torchao (its int4 weight-only layouts need CUDA or XPU); on a "
               "CPU use --quantization bnb-nf4 / bnb-fp4 (4-bit) or torchao-int8, or serve from a machine with a "
               "GPU (the model loads onto CUDA when one is present)")


def quantize_loaded(model, scheme: str):
    """Apply a torchao scheme in place to a loaded model (its linears; embeddings stay as they are)."""
    require("torchao")
    if scheme == "torchao-int4" and model.device.type == "cpu":
        # torchao's int4 weight-only layouts run on CUDA (mslk, tinygemm) or XPU/NPU kernels only; on a CPU
        # quantize_ fails deep inside with "Requires mslk" (checked with torchao 0.18).
        raise ValueError(INT4_ON_CPU)
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    config = Int8WeightOnlyConfig() if scheme == "torchao-int8" else Int4WeightOnlyConfig(group_size=128)
    quantize_(model, config)
    return model


def bnb_float32_kernel(model):
    """Keep ``model``'s bitsandbytes 4-bit linears off bnb's AVX-512 BF16 CPU kernel (which rounds activations
    to bf16, see the module doc) and on its float32 dequantising path; call it before the first forward (the
    kernel repacks the weights on that forward). Returns the number of linears switched."""
    require("bitsandbytes")
    import bitsandbytes as bnb

    switched = 0
    for name, module in model.named_modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        if getattr(getattr(module.weight, "quant_state", None), "packing_format_for_cpu", False):
            raise ValueError(f"{name} already ran on bitsandbytes' bf16 CPU kernel (its weights are repacked); "
                             "call bnb_float32_kernel(model) right after loading, before any forward")
        module.support_avx512bf16_for_cpu = False
        switched += 1
    return switched


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


# compressed-tensors presets written by save_compressed_tensors, and the checkpoint format of each.
CT_FORMATS = {"W4A16": "pack-quantized", "W8A8": "int-quantized"}


def save_compressed_tensors(model, directory: str, preset: str = "W4A16", group_size: int | None = None) -> None:
    """Write ``model`` (unchanged) to ``directory`` as a compressed-tensors checkpoint of ``preset``, every
    linear but ``lm_head`` quantised. Round to nearest from each weight's own min/max (no calibration data, no
    GPTQ): the scales are what compressed-tensors computes for a dynamic tensor of the preset's strategy.
    ``group_size``: for W4A16's groups (default the preset's, 128); it must divide every linear's in_features."""
    require("compressed_tensors")
    if preset not in CT_FORMATS:
        raise ValueError(f"unknown compressed-tensors preset {preset!r}; known: {', '.join(CT_FORMATS)}")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus, apply_quantization_config,
                                                 preset_name_to_scheme)

    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group_size is not None and scheme.weights.group_size is not None:
        scheme.weights.group_size = group_size
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                quantization_status=QuantizationStatus.INITIALIZED)
    model = copy_model(model)
    apply_quantization_config(model, config, show_progress=False)
    for name, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is not None:
            _set_weight_qparams(name, module)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=CT_FORMATS[preset])
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)     # writes quantization_config into config.json


def copy_model(model):
    """A copy of ``model``'s weights in a new module of its class (deepcopy fails on a model an engine or a
    patch has touched: they attach locks). Tied tensors are cloned once but come back as separate parameters."""
    with torch.device("meta"):
        fresh = type(model)(model.config)
    clones: dict[int, torch.Tensor] = {}
    state = {name: clones.setdefault(t.data_ptr(), t.detach().clone()) for name, t in model.state_dict().items()}
    fresh.load_state_dict(state, assign=True)
    for name, buffer in model.named_buffers():      # non-persistent buffers (RoPE's inv_freq) are no state
        if name not in state:
            owner, _, attr = name.rpartition(".")
            fresh.get_submodule(owner).register_buffer(attr, buffer.clone(), persistent=False)
    fresh.generation_config = copy.deepcopy(model.generation_config)
    return fresh.eval()


def _set_weight_qparams(name: str, module) -> None:
    """One quantised linear's ``weight_scale`` / ``weight_zero_point`` from its weight's min/max."""
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.utils import calculate_qparams, compute_dynamic_scales_and_zp

    args = module.quantization_scheme.weights
    weight = module.weight.detach()
    if args.group_size is not None and weight.shape[-1] % args.group_size:
        raise ValueError(f"{name}: in_features {weight.shape[-1]} is not a multiple of the group size "
                         f"{args.group_size}; pass save_compressed_tensors(..., group_size=G) with G dividing it")
    if args.strategy == "channel":      # one scale per output row (W8A8)
        scale, zero = calculate_qparams(weight.amin(1, keepdim=True), weight.amax(1, keepdim=True), args)
    else:
        scale, zero = compute_dynamic_scales_and_zp(weight, args, module)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    module.quantization_status = QuantizationStatus.FROZEN     # compress_model quantises FROZEN modules
