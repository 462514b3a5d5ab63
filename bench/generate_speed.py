"""CPU tokens/s of hf_paged against padded DynamicCache: one left-padded batch of mixed-length prompts.

    python -m bench generate-speed [--model smollm2|tiny] [--batch 16] [--new 48] [--repeats 5] [--threads N]

Prompt lengths are ShareGPT prompt lengths (capped at --max-prompt), prompt tokens random ids; every
row generates exactly --new tokens (min_new_tokens = max_new_tokens) so both sides do the same work; tokens/s counts useful tokens.
With --mixed-outputs, row i instead stops at a ShareGPT output length (capped at --new) by a logits
processor that forces EOS there — the case where a static batch keeps computing finished rows.
Runs alternate (dynamic, paged, dynamic, ...) in one process; prints per-run tokens/s, the median,
min and max of each and of the per-pair ratio, and checks that the tokens are identical.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import hf_paged

from .models import load

DATA = Path(__file__).parent / "data" / "sharegpt_lengths.npz"


def make_batch(batch: int, max_prompt: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = np.load(DATA)["prompt"]
    picked = [int(min(n, max_prompt)) for n in rng.choice(lengths, size=batch, replace=False)]
    width = max(picked)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(picked):
        ids[row, width - n:] = torch.from_numpy(rng.integers(3, vocab, size=n))
        mask[row, width - n:] = 1
    return ids, mask, picked


class ForceEOSAt:
    """Logits processor: row i must emit ``eos`` when it has generated ``stops[i]`` tokens."""

    def __init__(self, prompt_width: int, stops: list[int], eos: int):
        self.prompt_width, self.stops, self.eos = prompt_width, torch.tensor(stops), eos

    def __call__(self, input_ids, scores):
        due = (input_ids.shape[1] - self.prompt_width + 1) >= self.stops.to(scores.device)
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.eos] = 0.0
        return torch.where(due.unsqueeze(1), forced, scores)


def main(argv=None, prog: str = "python -m bench generate-speed") -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--mixed-outputs", action="store_true", help="ShareGPT output lengths, EOS forced there")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load(args.model)
    ids, mask, lengths = make_batch(args.batch, args.max_prompt, model.config.vocab_size)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
    useful = args.batch * args.new
    if args.mixed_outputs:
        from transformers import LogitsProcessorList  # noqa: PLC0415
        rng = np.random.default_rng(1)
        stops = [int(min(max(n, 1), args.new)) for n in rng.choice(np.load(DATA)["output"], size=args.batch)]
        eos = model.generation_config.eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos
        kw.update(min_new_tokens=0, eos_token_id=eos,
                  logits_processor=LogitsProcessorList([ForceEOSAt(ids.shape[1], stops, eos)]))
        useful = sum(stops)
        print(f"output lengths (EOS forced): {stops}")
    hf_paged.patch(model)
    print(f"{args.model}: batch {args.batch}, prompt lengths {lengths}, {args.new} new tokens each, "
          f"torch threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}")
    model.generate(**{**kw, "max_new_tokens": 2})           # warm-up both paths
    model.generate(**{**kw, "max_new_tokens": 2}, cache_implementation="paged")
    speeds = {"dynamic": [], "paged": []}
    outputs = {}
    for rep in range(args.repeats):
        for name in (("dynamic", "paged") if rep % 2 == 0 else ("paged", "dynamic")):
            extra = {"cache_implementation": "paged"} if name == "paged" else {}
            start = time.perf_counter()
            outputs[name] = model.generate(**kw, **extra)
            seconds = time.perf_counter() - start
            speeds[name].append(useful / seconds)
            print(f"  run {rep} {name:8s} {speeds[name][-1]:7.1f} tokens/s ({seconds:.1f} s)", flush=True)
    same = torch.equal(outputs["dynamic"], outputs["paged"])
    ratios = [p / d for p, d in zip(speeds["paged"], speeds["dynamic"])]
    for name, values in speeds.items():
        print(f"{name:8s} tokens/s median {statistics.median(values):.1f} (min {min(values):.1f}, max {max(values):.1f})")
    print(f"paged/dynamic ratio median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})"
          f"; identical tokens: {same}; paged KV stats: {hf_paged.last_stats(model)}")
