"""Weight-quantised tiny models on the paged path: patched generate and the engine against the same
quantised model's default path (greedy, fp32 compute, a left-padded batch)."""
from __future__ import annotations

import pytest
import torch
from tiny_models import make_batch, make_model, patched

import hf_paged
from hf_paged.integrations.weight_quant import bnb_float32_kernel, quantize_model

LIBRARY = {"bnb-nf4": "bitsandbytes", "bnb-fp4": "bitsandbytes", "bnb-int8": "bitsandbytes",
           "torchao-int8": "torchao"}


def _quantised(scheme: str, float32_kernel: bool = True):
    """The tiny llama quantised; bitsandbytes 4-bit on its float32 path unless ``float32_kernel`` is False (its
    AVX-512 BF16 CPU kernel rounds activations to bf16: a float-rounding difference in attention can cross a
    bf16 boundary, so equality within 1e-4 is not defined there; see integrations/weight_quant.py)."""
    pytest.importorskip(LIBRARY[scheme])
    model = quantize_model(make_model("llama"), scheme)
    if float32_kernel and scheme in ("bnb-nf4", "bnb-fp4"):
        assert bnb_float32_kernel(model) > 0
    return model


@pytest.mark.parametrize("release", [True, False])
@pytest.mark.parametrize("scheme", sorted(LIBRARY))
def test_patched_generate_equals_default_path(scheme, release):
    model = _quantised(scheme)
    ids, mask = make_batch([5, 9, 3, 7, 9, 2, 6, 8], seed=1)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
              output_logits=True, return_dict_in_generate=True)
    ref = model.generate(**kw)
    with patched(model, release_finished_rows=release):
        out = model.generate(cache_implementation="paged", **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits)) < 1e-4


@pytest.mark.parametrize("scheme", sorted(LIBRARY))
def test_engine_equals_generate_per_prompt(scheme):
    """The engine packs rows into one [1, N] forward; compared with each prompt alone through generate
    (bitsandbytes' 4-bit kernel differs for a single-token input, so the batch-of-one default path is the
    defined reference for a row)."""
    model = _quantised(scheme)
    prompts = [[5, 17, 33, 9], [40, 41, 42, 43, 44, 45], [7]]
    outs = hf_paged.LLM(model, None, max_num_seqs=1).generate(prompts, max_new_tokens=8, do_sample=False)
    for prompt, out in zip(prompts, outs):
        ref = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
        assert torch.equal(out.sequences[0], ref[0])


def _linear_inputs(model, **kw) -> dict:
    """Each quantised linear's first-call input (the prefill's), by module name."""
    seen, hooks = {}, []

    def record(name):
        def hook(module, args, out) -> None:       # returns None: a hook's value would replace the output
            seen.setdefault(name, args[0].detach().clone())
        return hook

    for name, module in model.named_modules():
        if name.endswith(("_proj", "lm_head")):
            hooks.append(module.register_forward_hook(record(name)))
    try:
        model.generate(**kw)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


@pytest.mark.parametrize("scheme", ["bnb-int8", "bnb-nf4"])
def test_linears_see_the_default_paths_inputs(scheme):
    """The invariant the paged path keeps for every scheme: each quantised linear gets the default path's
    input (shape, dtype, contiguity), equal up to attention's float rounding. LLM.int8 rounds that input to
    fp16 and int8, so on a real model this rounding alone can change tokens (see weight_quant's docstring)."""
    model = _quantised(scheme)
    kw = dict(input_ids=torch.tensor([[5, 17, 33, 9, 40, 41, 2]]), max_new_tokens=1, do_sample=False)
    ref = _linear_inputs(model, **kw)
    with patched(model):
        out = _linear_inputs(model, cache_implementation="paged", **kw)
    assert ref.keys() == out.keys() and len(ref) > 0
    for name, a in ref.items():
        b = out[name]
        assert (a.shape, a.dtype, a.is_contiguous()) == (b.shape, b.dtype, b.is_contiguous()), name
        assert (a - b).abs().max().item() < 1e-5, name


@pytest.mark.parametrize("scheme", ["bnb-nf4", "bnb-fp4"])
def test_bnb_float32_kernel_keeps_4bit_linears_off_the_bf16_kernel(scheme):
    """``bnb_float32_kernel``: after a forward no 4-bit linear was repacked for bnb's bf16 CPU kernel, and
    the paged path's linears see the default path's inputs; on a model whose linears already ran that kernel
    (only CPUs with AVX-512 BF16 have it) the call is refused, naming when to call it."""
    from bitsandbytes.functional import has_avx512bf16

    model = _quantised(scheme)
    model.generate(input_ids=torch.tensor([[5, 17, 33]]), max_new_tokens=2, do_sample=False)
    states = [m.weight.quant_state for m in model.modules() if type(m).__name__ == "Linear4bit"]
    assert states and not any(getattr(s, "packing_format_for_cpu", False) for s in states)
    if not has_avx512bf16():
        pytest.skip("this CPU has no AVX-512 BF16: bitsandbytes has no bf16 CPU kernel to refuse")
    machine = _quantised(scheme, float32_kernel=False)
    machine.generate(input_ids=torch.tensor([[5, 17, 33]]), max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match="before any forward"):
        bnb_float32_kernel(machine)


def test_server_loader_quantizes_a_checkpoint(tmp_path):
    """``hf-paged serve DIR --quantization bnb-nf4``'s loader: the model comes back 4-bit and its paged
    generate equals its default path."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb
    from tiny_models import word_tokenizer

    from hf_paged.integrations.server.loading import load_model

    make_model("llama").save_pretrained(tmp_path)
    word_tokenizer().save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), dtype="float32", device="cpu", quantization="bnb-nf4")
    assert isinstance(model.model.layers[0].self_attn.k_proj, bnb.nn.Linear4bit)
    ids, mask = make_batch([4, 7, 2], seed=3)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    ref = model.generate(**kw)
    with patched(model):
        assert torch.equal(model.generate(cache_implementation="paged", **kw), ref)


def test_unknown_scheme_is_refused():
    from hf_paged.integrations.server.loading import load_model

    with pytest.raises(ValueError, match="known: bnb-int8"):
        load_model("smollm2", quantization="int3")


def test_torchao_int4_on_cpu_is_refused_with_the_alternatives():
    pytest.importorskip("torchao")
    with pytest.raises(ValueError, match="no CPU kernel.*bnb-nf4"):
        quantize_model(make_model("llama"), "torchao-int4")


@pytest.mark.parametrize("scheme", sorted(LIBRARY))
def test_server_completion_equals_generate(scheme):
    """An in-process ``hf-paged serve`` app over the quantised model: a greedy completion's text is the
    decoded tokens of the same prompt alone through the default-path generate."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from live_server import running
    from tiny_models import chat_word_tokenizer

    from hf_paged.integrations.server import create_app

    model, tokenizer = _quantised(scheme), chat_word_tokenizer()
    prompt = [5, 17, 33, 9, 40]
    ref = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    app = create_app(model, tokenizer, served_model_name="tiny", num_blocks=16, max_num_seqs=2, block_size=16)
    with running(app) as url:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    assert reply["usage"]["completion_tokens"] == 6
    whole, ahead = tokenizer.decode(ref[0]), tokenizer.decode(prompt)      # the text continues the prompt's
    assert whole.startswith(ahead) and reply["choices"][0]["text"] == whole[len(ahead):] != ""
