"""The throughput cost of structured output on the real SmolLM2-135M: one engine, the same 32 chat
requests, greedy, run with 0, half or all of them constrained to a JSON schema (llguidance's token
masks inside the engine's batched sampling), interleaved rounds.

Constrained requests end when their JSON is complete; an unconstrained request of a run is given the
length its constrained twin had (``max_new_tokens`` = that length, EOS ignored), so every run makes
the same tokens in the same steps and the difference is the cost of the masks and of the per-row
sampling path. Reported: wall time per output token, output tokens/s, and the share of wall time in
the masks.

``python -m bench structured [--rounds 3] [--requests 32] [--threads 2]`` writes
bench/results/structured-<stamp>.json and prints a markdown table (min/median/max over the rounds).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .common import RESULTS, fmt_spread, machine, md_table, spread, stamp, versions

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
    "required": ["name", "age", "hobbies"], "additionalProperties": False}
TOPICS = ["a chef", "a pilot", "a child", "a painter", "a runner", "a farmer", "a nurse", "a poet"]
MIXES = {"none": 0.0, "half": 0.5, "all": 1.0}


def _round(llm, prompts, share: float, spec, lengths: list[int]) -> dict:
    """One run: the first ``share`` of the requests constrained, the others ``lengths[i]`` tokens long."""
    from hf_paged.engine import structured
    constrained = int(len(prompts) * share)
    settings = [dict(structured_output=spec, max_new_tokens=max(lengths)) if i < constrained else
                dict(max_new_tokens=lengths[i], ignore_eos=True) for i in range(len(prompts))]
    masked = [0.0]
    apply = structured.apply_masks

    def timed(*args, **kwargs):             # counts the mask time without changing what runs
        start = time.perf_counter()
        try:
            return apply(*args, **kwargs)
        finally:
            masked[0] += time.perf_counter() - start
    structured.apply_masks = timed
    try:
        start = time.perf_counter()
        outs = llm.generate(prompts, settings, do_sample=False, use_tqdm=False)
        wall = time.perf_counter() - start
    finally:
        structured.apply_masks = apply
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    valid = sum(_valid(o.outputs[0].text) for o in outs[:constrained])
    return {"lengths": [len(o.outputs[0].token_ids) for o in outs], "wall_s": wall, "output_tokens": tokens, "ms_per_token": 1000 * wall / tokens,
            "tokens_per_s": tokens / wall, "mask_s": masked[0], "constrained": constrained, "valid": valid}


def _valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == {"name", "age", "hobbies"}


def main(argv=None, prog: str = "python -m bench structured") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for structured-<timestamp>.json")
    args = parser.parse_args(argv)
    if min(args.rounds, args.requests, args.max_new_tokens, args.threads) < 1:
        parser.error("--rounds, --requests, --max-new-tokens and --threads must be >= 1")
    import torch

    from hf_paged.engine import LLM
    from hf_paged.engine.structured import StructuredOutput
    from hf_paged.integrations.smollm2 import load_smollm2
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2(torch.float32)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} "
                                               f"number {i} as JSON with name, age and hobbies."}],
                                             tokenize=False, add_generation_prompt=True)
               for i in range(args.requests)]
    llm = LLM(model, tokenizer, max_num_seqs=args.requests, enable_prefix_caching=False)
    spec = StructuredOutput(json=SCHEMA)
    first = _round(llm, prompts, 1.0, spec, [args.max_new_tokens] * len(prompts))   # warm-up, and the lengths
    lengths = first["lengths"]
    rounds = {mix: [] for mix in MIXES}
    for r in range(args.rounds):
        for mix, share in (list(MIXES.items()) if r % 2 == 0 else list(MIXES.items())[::-1]):
            rounds[mix].append(_round(llm, prompts, share, spec, lengths))
            run = rounds[mix][-1]
            print(f"[bench structured] round {r + 1}/{args.rounds} {mix}: {run['ms_per_token']:.1f} ms/token, "
                  f"{run['valid']}/{run['constrained']} valid, same lengths: {run['lengths'] == lengths}", flush=True)
    rows = []
    base = spread([x["ms_per_token"] for x in rounds["none"]])["median"]
    for mix, runs in rounds.items():
        per_token = spread([x["ms_per_token"] for x in runs])
        rows.append([mix, f"{runs[0]['constrained']}/{args.requests}", fmt_spread(per_token),
                     f"{per_token['median'] / base:.2f}×", fmt_spread(spread([x["tokens_per_s"] for x in runs])),
                     fmt_spread(spread([100 * x["mask_s"] / x["wall_s"] for x in runs])),
                     f"{sum(x['valid'] for x in runs)}/{sum(x['constrained'] for x in runs)}"])
    table = md_table(["constrained", "requests", "ms per output token", "vs none", "output tokens/s",
                      "% of wall in masks", "valid JSON"], rows)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"structured-{stamp()}.json"
    path.write_text(json.dumps({"machine": machine(), "versions": versions("torch", "transformers", "llguidance"),
                                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                "rounds": rounds, "table": table}, indent=1))
    print("\n".join(table))
    print(f"[bench structured] {path}")
