"""The control for compressed-tensors W8A8 on SmolLM2: how far transformers' own default path moves with
nothing but the attention implementation changed, beside how far the paged path moves.

    python -m bench w8a8-control [--tokens 16] [--threads 1]

W8A8 rounds every linear's input to int8 per token, so a float-rounding difference in attention's output
can flip a code and grow from there. This writes a W8A8 checkpoint of SmolLM2 (round to nearest,
``weight_quant.save_compressed_tensors``), loads it with ``attn_implementation="eager"`` and ``"sdpa"``,
and greedy-decodes the demo's 8 chat prompts as one batch and each alone: rows equal and the first step's
largest logit difference for eager vs sdpa (no hf_paged), paged vs sdpa, and the engine against patched
generate on each prompt alone (both paged) and against the default path alone. Figures: README, W8A8.
"""
from __future__ import annotations

import argparse
import json
import tempfile

import torch


def _compare(a: list, b: list) -> tuple[int, float]:
    """Rows (sequences) equal and the first step's max |logit difference| over pairs of generate outputs."""
    rows = sum(torch.equal(x.sequences, y.sequences) for x, y in zip(a, b))
    return rows, max(float((x.logits[0] - y.logits[0]).abs().max()) for x, y in zip(a, b))


def _rows(out) -> list:
    """A batched generate output as one single-row output per row, for :func:`_compare`."""
    class Row:
        def __init__(self, i):
            self.sequences, self.logits = out.sequences[i:i + 1], [out.logits[0][i:i + 1]]
    return [Row(i) for i in range(out.sequences.shape[0])]


def _generate(model, paged: bool, **inputs):
    import hf_paged
    if not paged:
        return model.generate(**inputs)
    hf_paged.patch(model)
    try:
        return model.generate(cache_implementation="paged", **inputs)
    finally:
        hf_paged.unpatch(model)


def main(argv=None, prog: str = "python -m bench w8a8-control") -> dict:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    import hf_paged
    from hf_paged.demo import DEFAULT_PROMPTS
    from hf_paged.integrations.smollm2 import chat_inputs, load_smollm2
    from hf_paged.integrations.weight_quant import save_compressed_tensors
    torch.set_num_threads(args.threads)
    base, tok = load_smollm2(dtype=torch.float32, verbose=False)
    inputs = chat_inputs(tok, DEFAULT_PROMPTS)
    prompts = [row[mask.bool()].tolist() for row, mask in zip(inputs["input_ids"], inputs["attention_mask"])]
    kw = dict(max_new_tokens=args.tokens, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with tempfile.TemporaryDirectory() as directory:
        save_compressed_tensors(base, directory, "W8A8")
        models = {}
        for attn in ("eager", "sdpa"):
            models[attn] = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True,
                                                                attn_implementation=attn).eval()
            models[attn].generation_config = base.generation_config
        batch = {name: _rows(_generate(models[attn], name == "paged", **inputs, **kw))
                 for name, attn in (("eager", "eager"), ("sdpa", "sdpa"), ("paged", "sdpa"))}
        alone = {name: [_generate(models[attn], name == "paged", input_ids=torch.tensor([p]), **kw) for p in prompts]
                 for name, attn in (("eager", "eager"), ("sdpa", "sdpa"), ("paged", "sdpa"))}
        engine = hf_paged.LLM(models["sdpa"], tok, enable_prefix_caching=False)
        outs = engine.generate(prompts, [{"max_new_tokens": args.tokens, "do_sample": False}] * len(prompts),
                               use_tqdm=False)
    result = {}
    for label, a, b in (("eager vs sdpa, batch", batch["eager"], batch["sdpa"]),
                        ("eager vs sdpa, alone", alone["eager"], alone["sdpa"]),
                        ("paged vs sdpa, batch", batch["paged"], batch["sdpa"]),
                        ("paged vs sdpa, alone", alone["paged"], alone["sdpa"])):
        result[label] = _compare(a, b)
        print(f"{label}: rows equal {result[label][0]}/{len(prompts)}, first-step logits max diff "
              f"{result[label][1]:.3g}", flush=True)
    for name in ("paged", "sdpa", "eager"):
        generated = [a.sequences[0][len(p):].tolist() for a, p in zip(alone[name], prompts)]
        equal = sum(list(o.outputs[0].token_ids)[:len(g)] == g for o, g in zip(outs, generated))
        result[f"engine vs {name} alone"] = equal
        print(f"engine vs {name} alone: rows equal {equal}/{len(prompts)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result
