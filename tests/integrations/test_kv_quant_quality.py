"""Quantised KV through generate and the engine, for every format and family, against the default path.

Quantised outputs are not token-equal to the default path; each mode is held to a per-format bound on
how far the quantised run's numbers are from the unquantised model's on the same tokens (teacher
forcing with the default attention and no cache):
- greedy and sampling (n = 2): the KL divergence of each step's next-token distribution;
- beam search: each chosen token's log-probability as the beam scored it;
- the engine (greedy, a prefix-cache hit forced): the regret of each chosen token (best log-prob minus
  the chosen one's), i.e. how far the token is from the unquantised argmax.
Bounds: ~3-10x what these tiny random models show (their distributions are flat; 7B-class models are
measured on SmolLM2 by `python -m bench kv-quant`); "auto" must stay at float noise. A negative control proves
the checks fail on a dequantisation that is off by a quarter step.
"""
import pytest
import torch

import hf_paged
from hf_paged import kv_formats
from tiny_models import EOS, make_batch, make_model, patched

FORMATS = ["auto", "fp8", "fp8_e5m2", "int8", "int4", "kivi", "nvfp4"]
MAX_KL = {"auto": 1e-5, "fp8": 1e-3, "fp8_e5m2": 3e-3, "int8": 1e-4, "int4": 3e-3, "kivi": 3e-3, "nvfp4": 3e-3}
MAX_LOGPROB_ERROR = {"auto": 1e-4, "fp8": 0.08, "fp8_e5m2": 0.15, "int8": 0.03, "int4": 0.2, "kivi": 0.2,
                     "nvfp4": 0.2}
MAX_REGRET = {"auto": 1e-4, "fp8": 0.08, "fp8_e5m2": 0.2, "int8": 0.03, "int4": 0.25, "kivi": 0.25, "nvfp4": 0.25}


def block_size(kv_cache_dtype):
    """kivi's blocks are its key groups of 32 (hf_paged.kivi); 8 elsewhere, so that blocks fill often."""
    return 32 if kv_cache_dtype == "kivi" else 8


def _reference_log_probs(model, sequences, attention_mask, prompt_width):
    """log-softmax of the default path's logits for each generated position: [N, T, V]."""
    with torch.no_grad():
        logits = model(input_ids=sequences, attention_mask=attention_mask).logits.float()
    return logits[:, prompt_width - 1:-1].log_softmax(-1)


def _live(generated):
    """Bool [N, T]: the steps up to and including each row's first EOS."""
    eos = (generated == EOS).long()
    return torch.cumsum(eos, 1) - eos == 0


def step_kl(model, out, prompt_mask, prompt_width):
    generated = out.sequences[:, prompt_width:]
    live = _live(generated)
    copies = out.sequences.shape[0] // prompt_mask.shape[0]
    mask = torch.cat([prompt_mask.repeat_interleave(copies, 0), live.long()], 1)
    ref = _reference_log_probs(model, out.sequences, mask, prompt_width)
    got = torch.stack(out.logits, 1).float().log_softmax(-1)
    return (ref.exp() * (ref - got)).sum(-1)[live]


def _generate(model, kv_cache_dtype, ids, mask, **kwargs):
    with patched(model, kv_cache_dtype=kv_cache_dtype, block_size=block_size(kv_cache_dtype)):
        return model.generate(input_ids=ids, attention_mask=mask, cache_implementation="paged",
                              return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_greedy_and_sampling_stay_within_the_kl_bound(family, kv_cache_dtype, one_torch_thread):
    model = make_model(family, seed=3)
    ids, mask = make_batch([9, 30, 45], seed=4)
    greedy = _generate(model, kv_cache_dtype, ids, mask, max_new_tokens=24, do_sample=False, output_logits=True)
    torch.manual_seed(0)
    sampled = _generate(model, kv_cache_dtype, ids, mask, max_new_tokens=16, do_sample=True, num_return_sequences=2,
                        output_logits=True)
    for out in (greedy, sampled):
        kl = step_kl(model, out, mask, ids.shape[1])
        assert kl.numel() > 0 and kl.max() <= MAX_KL[kv_cache_dtype], (kv_cache_dtype, kl.max().item())


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_beam_search_scores_stay_within_the_bound(family, kv_cache_dtype, one_torch_thread):
    model = make_model(family, seed=3)
    ids, mask = make_batch([9, 30], seed=4)
    out = _generate(model, kv_cache_dtype, ids, mask, max_new_tokens=12, num_beams=3, num_return_sequences=2,
                    do_sample=False, output_scores=True)
    scores = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices, normalize_logits=False)
    width = ids.shape[1]
    generated = out.sequences[:, width:]
    live = out.beam_indices[:, :generated.shape[1]] >= 0
    full_mask = torch.cat([mask.repeat_interleave(2, 0), live.long()], 1)
    ref = _reference_log_probs(model, out.sequences, full_mask, width).gather(-1, generated.unsqueeze(-1))[..., 0]
    error = (scores - ref)[live].abs()
    assert error.numel() > 0 and error.max() <= MAX_LOGPROB_ERROR[kv_cache_dtype], (kv_cache_dtype, error.max().item())


def engine_regret(model, llm, prompts, **kwargs):
    outputs = llm.generate(prompts, max_new_tokens=12, do_sample=False, ignore_eos=True, **kwargs)
    regrets = []
    for prompt, output in zip(prompts, outputs):
        tokens = output.outputs[0].token_ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        log_probs = logits.float().log_softmax(-1)
        chosen = log_probs.gather(-1, torch.tensor(tokens).unsqueeze(-1))[:, 0]
        regrets.append(log_probs.max(-1).values - chosen)
    return torch.cat(regrets)


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_engine_with_prefix_hits_stays_within_the_regret_bound(family, kv_cache_dtype, one_torch_thread):
    model = make_model(family, seed=3)
    bs = block_size(kv_cache_dtype)
    length = 3 * bs + 6
    ids, _ = make_batch([length, 9], seed=4)
    shared = ids[0, -length:].tolist()
    llm = hf_paged.LLM(model, kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=2**20, block_size=bs)
    first = engine_regret(model, llm, [shared, ids[1, -9:].tolist()])
    second = engine_regret(model, llm, [shared[:3 * bs + 1] + [7, 8, 9], shared])      # 3 full blocks cached
    assert llm.stats()["prefix_hit_tokens"] >= 2 * 3 * bs
    regret = torch.cat([first, second])
    assert regret.max() <= MAX_REGRET[kv_cache_dtype], (kv_cache_dtype, regret.max().item())
    assert llm.stats()["bytes_per_token"] == hf_paged.PagedCache(model.config, kv_cache_dtype=kv_cache_dtype,
                                                                 dtype=model.dtype).bytes_per_token


def test_bf16_model_with_quantised_kv(one_torch_thread):
    model = make_model("llama", seed=3, dtype=torch.bfloat16)
    ids, mask = make_batch([9, 30], seed=4)
    reference = _generate(model, "auto", ids, mask, max_new_tokens=8, do_sample=False, output_logits=True)
    for name in ("fp8", "int8", "int4", "nvfp4"):
        out = _generate(model, name, ids, mask, max_new_tokens=8, do_sample=False, output_logits=True)
        first = (out.logits[0].float() - reference.logits[0].float()).abs().max()
        assert 0 < first <= 0.25, (name, first.item())       # prefill logits: bf16 noise is ~0.03 here


def test_negative_control_a_quarter_step_off_fails_the_bound(monkeypatch, one_torch_thread):
    """The bounds can fail: shifting every dequantised int4 element by a quarter of its group's step
    breaks the KL bound (and int8's by half a step breaks int8's)."""
    real = kv_formats.dequantize

    def off_by_a_fraction(fmt, codes, scales, dtype):
        values = real(fmt, codes, scales, torch.float32)
        step = scales[..., : scales.shape[-1] // (1 + fmt.asymmetric)].float()
        shift = (0.25 if fmt.asymmetric else 0.5) * step.repeat_interleave(values.shape[-1] // step.shape[-1], -1)
        return (values + shift).to(dtype)

    from hf_paged.backends import quantized_torch

    from hf_paged.backends import cpp_build
    monkeypatch.setattr(quantized_torch, "dequantize", off_by_a_fraction)
    # The shift is put into the PyTorch codec, so the PyTorch path must run (the CPU kernel dequantises in
    # C++; tests/backends/test_cpu_kernel_quant.py holds it to this codec).
    monkeypatch.setenv(cpp_build.KERNEL_ENV, "0")
    model = make_model("llama", seed=3)
    ids, mask = make_batch([9, 30, 45], seed=4)
    for name in ("int4", "int8"):
        out = _generate(model, name, ids, mask, max_new_tokens=16, do_sample=False, output_logits=True)
        assert step_kl(model, out, mask, ids.shape[1]).max() > MAX_KL[name], name


# Held-out real text on the real SmolLM2 (fp32): the mean KL against the default path per text kind, one
# forward per passage (per-token formats store the same codes whatever the order of writes, and kivi's reads
# depend only on positions, so this equals decoding token by token). int8: ~1.5x what 2026-12-03 measured
# (README "Quantised KV blocks"), also held to the issue's +0.5% perplexity on every kind. fp8_e4m3: per kind,
# between the searched scale's KL (3.1e-3 / 5.7e-3 / 4.6e-3) and amax / 448's (4.5e-3 / 7.6e-3 / 5.8e-3), so
# the codec without its scale search fails every kind. kivi: ~1.3x what the bench decoded on 2026-12-05
# (4.1e-3 / 5.8e-3 / 5.8e-3), below what it measured before the read rule and sink (9.5e-3 / 1.5e-2 / 1.6e-2),
# and the issue's +1% perplexity on every kind.
HELD_OUT_MAX_KL = {"int8": 6e-4, "fp8_e4m3": {"docstring": 4.0e-3, "comment": 6.8e-3, "license": 5.3e-3},
                   "kivi": {"docstring": 5.5e-3, "comment": 7.5e-3, "license": 7.5e-3}}
HELD_OUT_MAX_PPL_PCT = {"int8": 0.5, "kivi": 1.0}


@pytest.mark.slow
def test_real_text_of_every_kind_stays_within_the_held_out_bounds():
    from hf_paged.integrations import smollm2

    from bench.kv_quant_texts import PROMPT, held_out_passages

    try:
        model, tokenizer = smollm2.load_smollm2(dtype=torch.float32, verbose=False)
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        pytest.fail(f"{exc}\nThis test needs the real weights: {smollm2.INSTALL_COMMAND}", pytrace=False)
    hf_paged.patch(model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = {}
        for kind, _, ids in held_out_passages(tokenizer):
            with torch.no_grad():
                ref = model(input_ids=ids[None], use_cache=False).logits[0, PROMPT - 1:-1].float().log_softmax(-1)
            for name in HELD_OUT_MAX_KL:
                cache = hf_paged.PagedCache(model.config, kv_cache_dtype=name, dtype=model.dtype,
                                            block_size=32 if name == "kivi" else 16)
                with torch.no_grad(), hf_paged.use_paged_attention(model):
                    logits = model(input_ids=ids[None], past_key_values=cache).logits[0, PROMPT - 1:-1]
                got = logits.float().log_softmax(-1)
                target = ids[PROMPT:, None]
                rows.setdefault((name, kind), []).append(((ref.exp() * (ref - got)).sum(-1),
                                                          ref.gather(-1, target)[:, 0] - got.gather(-1, target)[:, 0]))
    finally:
        torch.set_num_threads(threads)
    assert {kind for _, kind in rows} == {"docstring", "comment", "license"}
    for (name, kind), parts in rows.items():
        kl = torch.cat([p[0] for p in parts]).mean()
        ppl_pct = 100 * (torch.cat([p[1] for p in parts]).mean().exp() - 1)
        bound = HELD_OUT_MAX_KL[name]
        bound = bound[kind] if isinstance(bound, dict) else bound
        assert 0 < kl <= bound, (name, kind, kl.item(), bound)
        assert ppl_pct <= HELD_OUT_MAX_PPL_PCT.get(name, float("inf")), (name, kind, ppl_pct.item())
