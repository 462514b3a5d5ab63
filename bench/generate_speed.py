"""CPU tokens/s of hf_paged against padded DynamicCache: one left-padded batch of mixed-length prompts.

    python -m bench generate-speed [--model smollm2|random|tiny] [--batch 16] [--new 48] [--repeats 5] [--threads N]

Prompt lengths are ShareGPT prompt lengths (<= --max-prompt), prompt tokens random ids; every row
generates exactly --new tokens so both sides do the same work; tokens/s counts useful tokens. With
--mixed-outputs, row i instead generates its ShareGPT output length (<= --new), EOS forced there — the case
where a static batch keeps computing finished rows. Runs alternate (dynamic, paged, paged, dynamic, ...)
in one process, after one warm-up of each; prints per-run tokens/s, min / median / max of each and of the
per-pair ratio, the threads and CPU flags, and whether the tokens are identical.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from . import models
from .common import fmt_spread, machine, spread
from .engines import run_generate
from .workloads import FIRST_PLAIN_TOKEN, Request, Workload, sharegpt_pick


def workload(batch: int, max_prompt: int, new: int, mixed: bool, vocab: int, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    prompts, outputs = sharegpt_pick(rng, batch, max_prompt)
    reqs = [Request(rng.integers(FIRST_PLAIN_TOKEN, vocab, size=int(p)).tolist(), min(int(o), new) if mixed else new)
            for p, o in zip(prompts, outputs)]
    return Workload("generate-speed", reqs, note=f"{batch} ShareGPT prompts <= {max_prompt} tokens, "
                    + ("ShareGPT output lengths" if mixed else "exactly") + f" <= {new} new tokens each")


def main(argv=None, prog: str = "python -m bench generate-speed") -> dict:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", choices=models.MODELS)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--mixed-outputs", action="store_true", help="ShareGPT output lengths, EOS forced there")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = models.load(args.model)
    wl = workload(args.batch, args.max_prompt, args.new, args.mixed_outputs, model.config.vocab_size)
    print(f"{models.label(args.model, model)}; {wl.note}: prompts {wl.prompt_lens}, outputs {wl.output_lens}\n"
          f"machine: {machine()}")
    warm = Workload("warm", [Request(r.prompt, 2) for r in wl.requests])
    for name in ("dynamic", "paged"):
        run_generate(model, warm, name, probe=False)
    speeds, outputs = {"dynamic": [], "paged": []}, {}
    for rep in range(args.repeats):
        for name in (("dynamic", "paged") if rep % 2 == 0 else ("paged", "dynamic")):
            run = run_generate(model, wl, name, probe=False)
            speeds[name].append(run.tokens_per_s)
            outputs[name] = run.sequences
            print(f"  run {rep} {name:8s} {run.tokens_per_s:7.1f} tokens/s ({run.seconds:.1f} s)", flush=True)
    ratios = [a / b for a, b in zip(speeds["paged"], speeds["dynamic"])]
    for name, values in speeds.items():
        print(f"{name:8s} tokens/s median (min–max) {fmt_spread(spread(values))}")
    print(f"paged/dynamic ratio median (min–max) {fmt_spread(spread(ratios), '{:.2f}')}; "
          f"identical tokens: {outputs['dynamic'] == outputs['paged']}")
    return {"tokens_per_s": {k: spread(v) for k, v in speeds.items()}, "ratio": spread(ratios),
            "identical": outputs["dynamic"] == outputs["paged"]}
