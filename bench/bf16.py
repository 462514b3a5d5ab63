"""bf16 against fp32 on the real SmolLM2-135M, on the CPU: quality and engine speed.

    python -m bench bf16 [--rounds 3] [--threads 1] [--tokens 32] [--per-kind 3]

Three figures (README, "bf16 on the CPU"): perplexity of held-out passages (``bench/kv_quant_texts.py``,
``--per-kind`` per kind, default path, teacher-forced after the 32-token prompt) in both dtypes; greedy
agreement of the engine in bf16 with the engine in fp32 (the demo's 8 chat prompts, ``--tokens`` tokens,
EOS ignored: rows equal, first differing token per row, position-wise agreement); engine tokens/s in both
dtypes over ``--rounds`` rounds run in one process, the order alternating per round, ratio per round. On a
CPU without ``avx512_bf16`` / ``amx_bf16`` bf16 is emulated through float32 and the engine says so.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from .common import machine


def perplexity(model, passages, prompt: int) -> tuple[float, int]:
    """exp(mean NLL) of each passage's tokens after its first ``prompt`` ones, and how many were scored."""
    nll, scored = 0.0, 0
    with torch.inference_mode():
        for _, _, ids in passages:
            logits = model(ids[None]).logits[0, prompt - 1:-1].float()
            nll += torch.nn.functional.cross_entropy(logits, ids[prompt:], reduction="sum").item()
            scored += len(ids) - prompt
    return float(torch.exp(torch.tensor(nll / scored))), scored


def agreement(ref: list[list[int]], other: list[list[int]]) -> dict:
    """Rows equal, the first differing position per row (its length where equal), position-wise agreement."""
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ref, other)]
    same = sum(x == y for a, b in zip(ref, other) for x, y in zip(a, b))
    return {"rows_equal": sum(a == b for a, b in zip(ref, other)), "rows": len(ref), "first_difference": first,
            "positionwise": same / max(1, sum(len(a) for a in ref))}


def main(argv=None, prog: str = "python -m bench bf16") -> dict:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt in the engine runs")
    ap.add_argument("--per-kind", type=int, default=3, help="held-out passages per kind for perplexity")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    from hf_paged.demo import DEFAULT_PROMPTS
    from hf_paged.engine import LLM
    from hf_paged.integrations.smollm2 import chat_inputs, load_smollm2

    from .kv_quant_texts import PROMPT, held_out_passages
    torch.set_num_threads(args.threads)
    models = {"fp32": load_smollm2(torch.float32, verbose=False), "bf16": load_smollm2(torch.bfloat16, verbose=False)}
    tok = models["fp32"][1]
    passages = held_out_passages(tok, per_kind=args.per_kind)
    result = {"machine": machine(), "threads": args.threads, "perplexity": {}}
    for name, (model, _) in models.items():
        result["perplexity"][name], result["scored_tokens"] = perplexity(model, passages, PROMPT)
    ppl = result["perplexity"]
    print(f"perplexity, {len(passages)} passages, {result['scored_tokens']} scored tokens: fp32 {ppl['fp32']:.4f}, "
          f"bf16 {ppl['bf16']:.4f} ({(ppl['bf16'] / ppl['fp32'] - 1) * 100:+.2f}%)", flush=True)
    inputs = chat_inputs(tok, DEFAULT_PROMPTS)
    prompts = [row[mask.bool()].tolist() for row, mask in zip(inputs["input_ids"], inputs["attention_mask"])]
    # Prefix caching off: the same prompts every round, so a cache would skip most of the timed prefill.
    llms = {name: LLM(model, tok, enable_prefix_caching=False) for name, (model, _) in models.items()}
    params = dict(max_new_tokens=args.tokens, do_sample=False, ignore_eos=True, use_tqdm=False)
    rates, ratios, tokens = {"fp32": [], "bf16": []}, [], {}
    for r in range(args.rounds + 1):            # round 0 warms both up (kernel builds) and gives the tokens
        order = ("fp32", "bf16") if r % 2 == 0 else ("bf16", "fp32")
        for name in order:
            start = time.perf_counter()
            outs = llms[name].generate(prompts, **params)
            rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
            tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
            if r:
                rates[name].append(rate)
        if r:
            ratios.append(rates["bf16"][-1] / rates["fp32"][-1])
            print(f"round {r}: fp32 {rates['fp32'][-1]:.1f} tok/s, bf16 {rates['bf16'][-1]:.1f} tok/s, "
                  f"bf16/fp32 {ratios[-1]:.3f}", flush=True)
    result["greedy"] = agreement(tokens["fp32"], tokens["bf16"])
    result["tokens_per_s"] = {k: (min(v), statistics.median(v), max(v)) for k, v in rates.items() if v}
    result["ratio"] = (min(ratios), statistics.median(ratios), max(ratios)) if ratios else None
    print(f"greedy, engine bf16 vs fp32: {result['greedy']}")
    if ratios:
        print("bf16/fp32 per round min/median/max " + "/".join(f"{x:.3f}" for x in result["ratio"]))
    print(f"machine: {result['machine']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result
