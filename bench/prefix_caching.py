"""Prefix caching across generate calls on the real SmolLM2-135M, on and off, interleaved in one run:

* ``fewshot``: lm-evaluation-harness's ``HFLM`` (``pip install lm-eval``) on a local 5-shot
  generate_until task built here from JSON (no hub): every request shares the same 5-shot prefix, as
  evaluation harnesses send them. Wall time, prompt tokens prefilled, and whether the generations
  are the same.
* ``chat``: a chat loop of 8 turns with one system prompt, each turn's history sent again.

``python -m bench prefix [--rounds 3] [--limit 96] [--threads 2]`` writes
bench/results/prefix-<stamp>.json and prints a markdown table (min/median/max over the rounds).
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from .common import RESULTS, fmt_spread, machine, md_table, spread, stamp, versions

SYSTEM = ("You are a careful assistant for a hardware store. Answer in one short sentence, name the aisle "
          "when you can, never invent prices, and ask a question back when the customer is unclear. "
          "Aisles: 1 paint and brushes, 2 screws, nails and anchors, 3 hand tools, 4 power tools, "
          "5 plumbing, 6 electrical, 7 garden, 8 lumber, 9 doors and locks, 10 seasonal.")
TURNS = ["Where are the wood screws?", "And wall anchors for drywall?", "Do you have cordless drills?",
         "Which aisle for garden hoses?", "I need a new door lock.", "Where is the paint tape?",
         "Do you sell light switches?", "Thanks, and where are the rakes?"]


def _task_dir(limit: int) -> Path:
    """A local lm-eval task: 'Question: what is a + b? Answer: c', 5 fixed shots (first_n), greedy."""
    rng = random.Random(0)
    folder = Path(tempfile.mkdtemp(prefix="hfp-fewshot-"))
    for split, n in (("train", 5), ("test", limit)):
        with open(folder / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                a, b = rng.randint(10, 99), rng.randint(10, 99)
                f.write(json.dumps({"question": f"What is {a} plus {b}?", "answer": str(a + b)}) + "\n")
    (folder / "hfp_fewshot.yaml").write_text(f"""task: hfp_fewshot
dataset_path: json
dataset_kwargs:
  data_files:
    train: {folder / 'train.jsonl'}
    test: {folder / 'test.jsonl'}
training_split: train
test_split: test
fewshot_split: train
num_fewshot: 5
fewshot_config:
  sampler: first_n
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: " {{{{answer}}}}"
target_delimiter: ""
fewshot_delimiter: "\\n\\n"
output_type: generate_until
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return folder


class PrefillCounter:
    """Sums, over the patched model's generate calls, the prompt tokens looked up and those not recomputed."""

    def __init__(self, model):
        import hf_paged
        self.model, self.calls, self.query, self.hit, self.seconds = model, 0, 0, 0, 0.0
        inner = model.generate

        def generate(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                stats = hf_paged.last_stats(model)
                self.calls += 1
                self.query += stats["prefix_query_tokens"]
                self.hit += stats["prefix_hit_tokens"]
        model.generate = generate

    def prefilled(self, real_prompt_tokens: int) -> int:
        return real_prompt_tokens - self.hit


def _fewshot_round(model, tokenizer, tasks, limit: int, batch: int, caching: bool) -> dict:
    """One lm-eval run of the task (``tasks``: an lm_eval TaskManager that knows it, built once)."""
    import hf_paged
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    hf_paged.patch(model, default=True, enable_prefix_caching=caching)
    try:
        counter = PrefillCounter(model)
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch)
        start = time.perf_counter()
        out = lm_eval.simple_evaluate(model=lm, tasks=["hfp_fewshot"], task_manager=tasks,
                                      limit=limit, log_samples=True, verbosity="ERROR")
        wall = time.perf_counter() - start
    finally:
        hf_paged.unpatch(model)
        model.__dict__.pop("generate", None)
    samples = out["samples"]["hfp_fewshot"]
    return {"wall_s": wall, "generate_s": counter.seconds, "generations": [s["resps"][0][0] for s in samples],
            "calls": counter.calls,
            "prompt_tokens": counter.query, "hit_tokens": counter.hit,
            "exact_match": out["results"]["hfp_fewshot"].get("exact_match,none")}


def _chat_round(model, tokenizer, caching: bool, max_new_tokens: int = 32) -> dict:
    import hf_paged
    hf_paged.patch(model, enable_prefix_caching=caching)
    messages, answers, query, hit = [{"role": "system", "content": SYSTEM}], [], 0, 0
    start = time.perf_counter()
    try:
        for turn in TURNS:
            messages.append({"role": "user", "content": turn})
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)
            out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, cache_implementation="paged")
            answer = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
            answers.append(answer)
            stats = hf_paged.last_stats(model)
            query, hit = query + stats["prefix_query_tokens"], hit + stats["prefix_hit_tokens"]
    finally:
        hf_paged.unpatch(model)
    return {"wall_s": time.perf_counter() - start, "generations": answers, "prompt_tokens": query, "hit_tokens": hit}


def _summary(rounds: dict) -> list:
    """Per workload and setting: wall time and prefilled tokens (min/median/max), same generations."""
    rows = []
    for workload, by_setting in rounds.items():
        off = by_setting["off"]
        for setting, runs in by_setting.items():
            same = all(r["generations"] == off[0]["generations"] for r in runs)
            prompt = runs[0]["prompt_tokens"] or sum(r["prompt_tokens"] for r in off) // max(len(off), 1)
            rows.append([workload, setting, fmt_spread(spread([r["wall_s"] for r in runs]), "{:.2f}"),
                         fmt_spread(spread([r.get("generate_s", r["wall_s"]) for r in runs]), "{:.2f}"),
                         f"{prompt - runs[0]['hit_tokens']} of {prompt}", "yes" if same else "NO"])
    return rows


def main(argv=None, prog: str = "python -m bench prefix") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limit", type=int, default=96, help="few-shot questions per round")
    parser.add_argument("--batch-size", type=int, default=8, help="HFLM's batch size")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", nargs="+", default=["fewshot", "chat"], choices=["fewshot", "chat"])
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for prefix-<timestamp>.json")
    args = parser.parse_args(argv)
    if min(args.rounds, args.limit, args.batch_size, args.threads) < 1:
        parser.error("--rounds, --limit, --batch-size and --threads must be >= 1")
    import torch

    from hf_paged.integrations.smollm2 import load_smollm2
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2(torch.float32)
    rounds = {w: {"off": [], "on": []} for w in args.only}
    tasks = None
    if "fewshot" in rounds:                    # lm-eval only for the few-shot workload
        from lm_eval.tasks import TaskManager
        tasks = TaskManager(include_path=str(_task_dir(args.limit)))
        _fewshot_round(model, tokenizer, tasks, min(args.limit, args.batch_size), args.batch_size, True)  # warm-up
    else:
        _chat_round(model, tokenizer, True)    # warm-up
    for r in range(args.rounds):               # interleaved: off, on, off, on, ...
        for setting in ("off", "on"):
            if "fewshot" in rounds:
                rounds["fewshot"][setting].append(_fewshot_round(model, tokenizer, tasks, args.limit,
                                                                 args.batch_size, setting == "on"))
            if "chat" in rounds:
                rounds["chat"][setting].append(_chat_round(model, tokenizer, setting == "on"))
            print(f"[bench prefix] round {r + 1}/{args.rounds} {setting}: " + ", ".join(
                f"{w} {runs[setting][-1]['wall_s']:.1f} s" for w, runs in rounds.items()), flush=True)
    # the off runs cache nothing: their prompt tokens are the real ones HFLM / the chat sent
    for by_setting in rounds.values():
        for runs in by_setting.values():
            for run in runs:
                run["prompt_tokens"] = run["prompt_tokens"] or by_setting["on"][0]["prompt_tokens"]
    table = md_table(["workload", "prefix caching", "wall s, median (min–max)", "in generate s", "prompt tokens prefilled",
                      "same generations as off"], _summary(rounds))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"prefix-{stamp()}.json"
    path.write_text(json.dumps({"machine": machine(), "versions": versions("torch", "transformers", "lm_eval"),
                                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                "rounds": rounds, "table": table}, indent=1))
    print("\n".join(table))
    print(f"[bench prefix] {path}")
