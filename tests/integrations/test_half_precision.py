"""Half precision (fp16, bf16): the paged path against transformers' default path (DynamicCache + sdpa).

In half precision the two paths round differently (another attention summation order; pad columns
skipped, not masked), so logits differ by a few units of the dtype's resolution and a greedy argmax can
flip where the reference's top-2 logits are nearly tied. The check is the fp32 SmolLM2 test's
(tests/integrations/test_smollm2.py), with tolerances stated here and chosen by measurement:

* at every step of every row, up to the row's first differing token (or its EOS), every logit and every
  score is within TOL of the reference's;
* a row's first differing token must come at a near-tie: a step where the reference's top-2 logit gap
  is below NEAR_TIE. A divergence anywhere else fails. Near-ties where the tokens still agree are
  printed as well, and the comparison goes on past them;
* near-ties must not swallow the test: at least MIN_COMPARED of the reference's (row, step) pairs up
  to EOS are compared token for token.

Both figures are in units of ``eps(dtype) * max|reference logit at that step|`` ("eps*scale"; eps is
2**-10 for fp16, 2**-7 for bf16): rounding differences scale with the logits' size, and so do the
gaps they can close. Measured (CPU, torch 2.13, transformers 5.24, 2 threads), before any divergence:

                          max |logit diff|                      top-2 margin change   |logits|
                          fp16                bf16              (either dtype)
  tiny models, 2 layers   1.95e-3 = 2.4 e*s   1.37e-2 = 2.1 e*s  <= 2.6 e*s            <= 1.6
  SmolLM2-135M, 30 layers 0.164   = 8.0 e*s   1.53    = 9.8 e*s  <= 3.1 e*s            <= 40

(tiny: the five families x seeds 0-7 and 28, 16 new tokens; SmolLM2: the demo's 8 prompts x 24 new
tokens and the 3 prompts below x 16; ``pytest -s`` prints these figures for every case.) TOL is about
1.6-2x the largest logit difference. A flip needs the top-2 margin to move by more than the gap; it
moved by at most 3.1 eps*scale, and NEAR_TIE is about twice that. In absolute terms for SmolLM2
(scale ~20-40): TOL ~0.3-0.6 in fp16, 2.5-5 in bf16; NEAR_TIE ~0.12-0.24 in fp16, 0.9-1.9 in bf16.
``python -m hf_paged.demo --dtype bfloat16`` explains differing rows with SmolLM2's figures.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

import hf_paged
from tiny_models import EOS, make_batch, make_model, patched

DTYPES = [torch.float16, torch.bfloat16]
LENGTHS = [7, 1, 12, 4]          # a left-padded batch with a 1-token prompt
TINY_NEW_TOKENS = 16
SMOLLM2_PROMPTS = [0, 1, 6]      # the demo's prompts 0, 1, 6: 37, 32, 39 tokens with the chat template
SMOLLM2_NEW_TOKENS = 16

# In units of eps(dtype) * max|reference logit| at the step (measurements: see the docstring).
TINY_TOL, TINY_NEAR_TIE = 4.0, 5.0
SMOLLM2_TOL, SMOLLM2_NEAR_TIE = 16.0, 6.0
MIN_COMPARED = 0.5


@dataclass
class Report:
    failures: list[str] = field(default_factory=list)
    near_ties: list[str] = field(default_factory=list)
    compared: int = 0                 # (row, step) pairs whose tokens were compared
    reference_steps: int = 0          # (row, step) pairs the reference generated, up to EOS
    max_abs_diff: float = 0.0         # over every logit compared
    max_rel_diff: float = 0.0         # the same, in eps * max|reference logit| units
    max_margin_shift: float = 0.0     # change of the reference's top-2 margin, in the same units


def compare(ref, out, prompt_width: int, dtype: torch.dtype, tol: float, near_tie: float, eos: int) -> Report:
    """Compare two greedy ``generate`` outputs (``return_dict_in_generate`` with logits and scores) row by row.

    ``tol`` and ``near_tie`` are in units of eps(dtype) * max|reference logit| at the step.
    """
    eps = torch.finfo(dtype).eps
    report = Report()
    ref_new, out_new = ref.sequences[:, prompt_width:], out.sequences[:, prompt_width:]
    ref_logits, out_logits = torch.stack(ref.logits, 1).float(), torch.stack(out.logits, 1).float()  # [B, T, V]
    pairs = [("logits", ref_logits, out_logits),
             ("scores", torch.stack(ref.scores, 1).float(), torch.stack(out.scores, 1).float())]
    for row in range(ref_new.shape[0]):
        tokens = ref_new[row].tolist()
        report.reference_steps += tokens.index(eos) + 1 if eos in tokens else len(tokens)
        for step in range(ref_new.shape[1]):
            if step >= min(out_new.shape[1], out_logits.shape[1]):
                report.failures.append(f"row {row}: the paged run stopped after {step} steps, the reference did not")
                break
            unit = eps * float(ref_logits[row, step].abs().max())
            beyond = []
            for name, ref_values, out_values in pairs:
                diff = float((ref_values[row, step] - out_values[row, step]).abs().max())
                if name == "logits":
                    report.max_abs_diff = max(report.max_abs_diff, diff)
                    report.max_rel_diff = max(report.max_rel_diff, diff / unit)
                if diff > tol * unit:
                    beyond.append(f"row {row} step {step}: {name} differ by up to {diff:.3g} = {diff / unit:.1f} "
                                  f"eps*scale, beyond {tol:g} eps*scale ({tol * unit:.3g})")
            if beyond:
                report.failures.extend(beyond)
                break
            top2 = ref_logits[row, step].topk(2)
            gap = float(top2.values[0] - top2.values[1])
            first, second = top2.indices.tolist()
            margin = float(out_logits[row, step, first] - out_logits[row, step, second])
            report.max_margin_shift = max(report.max_margin_shift, abs(gap - margin) / unit)
            is_tie = gap < near_tie * unit
            want, got = int(ref_new[row, step]), int(out_new[row, step])
            where = f"row {row} step {step}: top-2 gap {gap:.3g} < {near_tie * unit:.3g} ({near_tie:g} eps*scale)"
            if want != got:
                if is_tie:
                    report.near_ties.append(f"{where}: token {got}, reference {want}; row not compared further")
                else:
                    report.failures.append(f"row {row} step {step}: token {got} != reference {want} although the "
                                           f"top-2 gap {gap:.3g} = {gap / unit:.1f} eps*scale is no near-tie "
                                           f"(< {near_tie:g} eps*scale)")
                break
            report.compared += 1
            if is_tie:
                report.near_ties.append(f"{where}: same token {got}")
            if want == eos:
                break
    return report


def check(report: Report, label: str) -> None:
    for line in report.near_ties:
        print(f"{label} near-tie: {line}")
    print(f"{label}: compared {report.compared}/{report.reference_steps} (row, step) pairs, "
          f"{len(report.near_ties)} near-ties; max |logit diff| {report.max_abs_diff:.3g} "
          f"= {report.max_rel_diff:.2f} eps*scale; max top-2 margin change {report.max_margin_shift:.2f} eps*scale")
    assert not report.failures, f"{label}:\n" + "\n".join(report.failures)
    assert report.compared >= MIN_COMPARED * report.reference_steps, \
        f"{label}: near-ties left only {report.compared}/{report.reference_steps} (row, step) pairs compared"


def test_compare_fails_on_a_divergence_that_is_no_near_tie():
    """The comparison itself: a flip at a clear argmax fails, one at a near-tie is reported, logits
    beyond TOL fail even when the tokens agree."""
    from types import SimpleNamespace

    def output(rows):                 # rows: per row, per step, a logit vector over a 4-token vocabulary
        logits = torch.tensor(rows, dtype=torch.float32)                               # [B, T, V]
        tokens = torch.cat([torch.full((len(rows), 1), 9), logits.argmax(-1)], dim=1)  # a 1-token prompt
        return SimpleNamespace(sequences=tokens, logits=tuple(logits.unbind(1)), scores=tuple(logits.unbind(1)))

    dtype, unit = torch.bfloat16, torch.finfo(torch.bfloat16).eps * 4.0               # max|logit| = 4
    ref = output([[[4.0, 1.0, 0.0, 0.0], [4.0, 3.0, 0.0, 0.0]]])
    clear_flip = output([[[1.0, 4.0, 0.0, 0.0], [4.0, 3.0, 0.0, 0.0]]])
    report = compare(ref, clear_flip, 1, dtype, tol=1e6, near_tie=5.0, eos=99)
    assert report.failures and "no near-tie" in report.failures[0] and report.compared == 0
    tie = output([[[4.0, 4.0 - 2 * unit, 0.0, 0.0], [4.0, 3.0, 0.0, 0.0]]])
    tie_flip = output([[[4.0 - 2 * unit, 4.0, 0.0, 0.0], [4.0, 3.0, 0.0, 0.0]]])
    report = compare(tie, tie_flip, 1, dtype, tol=5.0, near_tie=5.0, eos=99)
    assert not report.failures and len(report.near_ties) == 1 and report.compared == 0
    drift = output([[[4.0, 1.0, 0.5, 0.0], [4.0, 3.0, 0.0, 0.0]]])
    report = compare(ref, drift, 1, dtype, tol=5.0, near_tie=5.0, eos=99)
    assert len(report.failures) == 2 and "beyond" in report.failures[0]               # logits and scores
    assert not compare(ref, ref, 1, dtype, tol=5.0, near_tie=5.0, eos=99).failures


def _greedy(model, max_new_tokens, **kwargs):
    with torch.inference_mode():
        return model.generate(max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True,
                              output_logits=True, output_scores=True, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_tiny_greedy_half_precision(family, dtype):
    model = make_model(family, seed=28, dtype=dtype)
    ids, mask = make_batch(LENGTHS, seed=29)
    ref = _greedy(model, TINY_NEW_TOKENS, input_ids=ids, attention_mask=mask)
    with patched(model):
        out = _greedy(model, TINY_NEW_TOKENS, input_ids=ids, attention_mask=mask, cache_implementation="paged")
    assert isinstance(out.past_key_values, hf_paged.PagedCache) and model.dtype == dtype
    check(compare(ref, out, ids.shape[1], dtype, TINY_TOL, TINY_NEAR_TIE, EOS), f"{family} {dtype}")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_smollm2_greedy_half_precision(smollm2, dtype):
    from hf_paged.demo import DEFAULT_PROMPTS

    model, tokenizer = smollm2.load_smollm2(dtype=dtype, verbose=False)
    inputs = smollm2.chat_inputs(tokenizer, [DEFAULT_PROMPTS[i] for i in SMOLLM2_PROMPTS])
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    ref = _greedy(model, SMOLLM2_NEW_TOKENS, **inputs)
    with patched(model):
        out = _greedy(model, SMOLLM2_NEW_TOKENS, cache_implementation="paged", **inputs)
    assert isinstance(out.past_key_values, hf_paged.PagedCache) and model.dtype == dtype
    check(compare(ref, out, inputs["input_ids"].shape[1], dtype, SMOLLM2_TOL, SMOLLM2_NEAR_TIE, eos),
          f"SmolLM2 {dtype}")
