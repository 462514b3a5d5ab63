"""The GPU check's engine sections (issue 26 item 5; bench/gpu_sections.py lists every section):

* ``engine_step``: the engine's decode step at batch 1 / 8 / 64 on a Llama-3-8B-shaped random model (8 of its
  32 layers, to fit the time budget: a step's time scales with the layers, the ratio does not), with CUDA
  graphs (``enforce_eager=False``, hf_paged/engine/graphs.py) and eagerly (``enforce_eager=True``), against
  transformers' own forward of one decode token over a StaticCache with SDPA attention, captured into a CUDA
  graph, on the same shapes (batch, context, layers). The engine's step includes its scheduling and
  greedy sampling; the baseline is the forward alone. Target: graphs within 1.15x of the baseline.
* ``generate_batch``: ``hf_paged.LLM`` against transformers' continuous batching (``model.generate_batch``)
  on the same 64 prompts (64..512 tokens) and new tokens, greedy. Target: >= 2x its tokens per second.

torch, transformers and hf_paged are imported inside functions only (see gpu_sections)."""
from __future__ import annotations

import time

from .gpu_timing import SectionContext, guarded

STEP_BATCHES = (1, 8, 64)
STEP_PROMPT = 512            # stored tokens per row before the timed decode steps
STEP_TIMED, STEP_WARM = 20, 3
STEP_TARGET = 1.15           # engine step with graphs / captured SDPA forward
BATCH_TARGET = 2.0           # engine tokens/s / generate_batch tokens/s


def step_plan(smoke: bool) -> dict:
    """Shapes of the engine_step section: batches, prompt tokens, warm-up and timed decode steps."""
    if smoke:
        return {"batches": (1, 3), "prompt": 12, "warm": 1, "timed": 2}
    return {"batches": STEP_BATCHES, "prompt": STEP_PROMPT, "warm": STEP_WARM, "timed": STEP_TIMED}


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def engine_step_ms(case: dict, model, batch: int, prompt: int, warm: int, timed: int, eager: bool, device) -> None:
    """ms per decode step of an Engine running ``batch`` rows of ``prompt`` tokens: every row prefilled
    first, ``warm`` decode steps (the first captures the bucket's graph), then ``timed`` steps."""
    import torch

    from hf_paged.engine import Engine
    length = prompt + warm + timed + 2
    engine = Engine(model, max_num_seqs=batch, max_num_batched_tokens=max(2048, prompt), max_model_len=length + 16,
                    enable_prefix_caching=False, enforce_eager=eager, kv_cache_memory_bytes=256 * 2**20
                    if device.type == "cpu" else 8 * 2**30)
    gen = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        ids = torch.randint(3, model.config.vocab_size, (prompt,), generator=gen).tolist()
        engine.add_request(ids, max_new_tokens=length - prompt, ignore_eos=True, do_sample=False)
    graphs = engine.runner.graphs
    with engine.session():
        started: set[int] = set()
        for _ in range(batch * prompt):                 # prefill (chunked by the token budget): until every
            started.update(e.request_id for e in engine.step())     # row has sampled its first token
            if len(started) == batch:
                break
        else:
            raise RuntimeError(f"only {len(started)} of {batch} rows started decoding")
        for _ in range(warm):
            engine.step()
        replayed = graphs.replayed_steps if graphs is not None else 0
        _sync(torch, device)
        t0 = time.perf_counter()
        for _ in range(timed):
            engine.step()
        _sync(torch, device)
        case["ms"] = (time.perf_counter() - t0) * 1e3 / timed
    case["graph_steps"] = (graphs.replayed_steps - replayed) if graphs is not None else 0
    case["graphs_enabled"] = bool(graphs is not None and graphs.enabled)
    if not eager and device.type == "cuda" and case["graph_steps"] != timed:
        case.update(ok=False, error=f"only {case['graph_steps']} of {timed} timed steps replayed a graph")


def hf_captured_ms(case: dict, model, batch: int, prompt: int, timed: int, device, graphs: bool) -> None:
    """ms per decode forward of transformers itself (SDPA over a StaticCache of prompt + 16 slots): the
    prompt prefilled, then one token's forward captured into a CUDA graph and replayed ``timed`` times."""
    import torch
    from transformers import StaticCache
    model.set_attn_implementation("sdpa")
    cache = StaticCache(config=model.config, max_cache_len=prompt + 16)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), device=device)
    token = torch.randint(3, model.config.vocab_size, (batch, 1), device=device)
    position = torch.full((batch, 1), prompt, device=device)
    cache_position = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True)

        def forward():
            return model(input_ids=token, position_ids=position, cache_position=cache_position,
                         past_key_values=cache, use_cache=True).logits
        run, how = forward, "eager"
        if graphs and device.type == "cuda":
            from hf_paged.engine.graphs import cuda_capture     # the engine's own capture: warm-up, record
            run, how = cuda_capture(forward, device), "cuda graph"
        run()
        _sync(torch, device)
        t0 = time.perf_counter()
        for _ in range(timed):
            run()
        _sync(torch, device)
    case.update(ms=(time.perf_counter() - t0) * 1e3 / timed, how=how)


def section_engine_step(ctx: SectionContext) -> dict:
    import torch

    from .gpu_models import random_llama
    device = torch.device("cpu" if ctx.smoke else "cuda")
    model = random_llama(ctx.smoke, device)
    plan = step_plan(ctx.smoke)
    cases = []
    for batch in plan["batches"]:
        for name in ("engine_graphs", "engine_eager", "hf_sdpa_captured"):
            if ctx.time_left() < 10 and not ctx.smoke:
                ctx.record({"case": name, "batch": batch, "skipped": "section deadline near", "ok": None})
                continue
            case = {"case": name, "batch": batch, "prompt": plan["prompt"], "timed_steps": plan["timed"]}
            if name == "hf_sdpa_captured":
                guarded(ctx, case, lambda c, b=batch: hf_captured_ms(c, model, b, plan["prompt"], plan["timed"],
                                                                     device, ctx.graphs))
            else:
                guarded(ctx, case, lambda c, b=batch, e=name == "engine_eager": engine_step_ms(
                    c, model, b, plan["prompt"], plan["warm"], plan["timed"], e, device))
            cases.append(case)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    summary = step_summary(cases)
    print("\n".join(summary), flush=True)
    return {"summary": summary, "model": "random Llama-3-8B shape, 8 of 32 layers, bf16",
            "target": f"engine_graphs <= {STEP_TARGET}x hf_sdpa_captured"}


def step_summary(cases: list[dict]) -> list[str]:
    """One line per batch: each variant's ms per step and the engine's ratios to the captured SDPA forward."""
    by_batch: dict[int, dict] = {}
    for c in cases:
        if "ms" in c:
            by_batch.setdefault(c["batch"], {})[c["case"]] = c["ms"]
    lines = []
    for batch, ms in sorted(by_batch.items()):
        line = f"decode step, batch {batch}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
        base = ms.get("hf_sdpa_captured")
        for name in ("engine_graphs", "engine_eager"):
            if base and name in ms:
                line += f"; {name}/sdpa {ms[name] / base:.2f}x"
        lines.append(line)
    return lines


def batch_prompts(smoke: bool, vocab: int) -> tuple[list[list[int]], int]:
    """(prompts, new tokens) of the generate_batch section: 64 prompts of 64..512 tokens, 64 new."""
    import torch
    requests, new, low, high = (64, 64, 64, 512) if not smoke else (3, 3, 3, 9)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(low, high + 1, (requests,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths], new


def _hf_generate_batch(case, model, prompts, new, device) -> None:
    """generate_batch's second call on the same prompts, its manager (KV cache, threads, CUDA graphs) kept from
    the first (``persistent_manager``), as the engine is built and warmed up outside its timing: each call of its
    own makes a new manager, sized for that call, and allocates its cache inside the call."""
    import inspect

    import torch
    from transformers import GenerationConfig
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    keep = "persistent_manager" in inspect.signature(model.generate_batch).parameters
    case["setup"] = "outside the timing (persistent manager)" if keep else "inside the timing (no persistent_manager)"
    kwargs = {"persistent_manager": True} if keep else {}
    if device.type == "cpu":        # the CPU smoke: a small cache (sized from free memory it took minutes and GiBs)
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=256)
    try:
        t0 = time.perf_counter()
        model.generate_batch(inputs=prompts if keep else prompts[:4], generation_config=config, **kwargs)   # warm-up
        _sync(torch, device)
        case["seconds_first_call"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=config, **kwargs)
        _sync(torch, device)
        case["seconds_timed"] = time.perf_counter() - t0
    finally:
        if keep:
            model.destroy_cached_continuous_batching_manager()
    tokens = sum(len(o.generated_tokens) for o in out.values())
    case.update(tokens=tokens, tokens_per_s=tokens / case["seconds_timed"], requests_returned=len(out))
    if len(out) != len(prompts):
        case.update(ok=False, error=f"generate_batch returned {len(out)} of {len(prompts)} requests")


def _engine_batch(case, model, prompts, new, device) -> None:
    import torch

    import hf_paged
    llm = hf_paged.LLM(model, max_num_seqs=len(prompts), max_num_batched_tokens=4096, enable_prefix_caching=False,
                       kv_cache_memory_bytes=256 * 2**20 if device.type == "cpu" else 8 * 2**30)
    llm.generate(prompts[:4], max_new_tokens=new, ignore_eos=True, do_sample=False, use_tqdm=False)   # warm-up
    _sync(torch, device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, max_new_tokens=new, ignore_eos=True, do_sample=False, use_tqdm=False)
    _sync(torch, device)
    case["seconds_timed"] = time.perf_counter() - t0
    case["tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
    case["tokens_per_s"] = case["tokens"] / case["seconds_timed"]


def within(seconds: float, fn, *args) -> None:
    """fn(*args) in a daemon thread, given ``seconds``: a library call that blocks (generate_batch waits on
    its manager thread) then fails its case instead of taking the section past its deadline."""
    import threading
    failure: list[BaseException] = []

    def target():
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(exc)
    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(max(seconds, 1.0))
    if worker.is_alive():
        raise TimeoutError(f"did not finish in {max(seconds, 1.0):.0f} s (the section's deadline; --sections "
                           "generate_batch alone gives it the whole deadline)")
    if failure:
        raise failure[0]


def section_generate_batch(ctx: SectionContext) -> dict:
    import torch

    from .gpu_models import random_llama
    device = torch.device("cpu" if ctx.smoke else "cuda")
    model = random_llama(ctx.smoke, device)
    prompts, new = batch_prompts(ctx.smoke, model.config.vocab_size)
    base = {"requests": len(prompts), "new_tokens": new, "prompt_tokens": sum(map(len, prompts))}
    engine = {"case": "engine", **base}
    guarded(ctx, engine, lambda c: _engine_batch(c, model, prompts, new, device))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    hf = {"case": "generate_batch", **base}
    guarded(ctx, hf, lambda c: within(ctx.time_left() - 5, _hf_generate_batch, c, model, prompts, new, device))
    summary = [batch_summary(engine, hf)]
    print(summary[0], flush=True)
    return {"summary": summary, "target": f"engine >= {BATCH_TARGET}x generate_batch tokens/s"}


def batch_summary(engine: dict, hf: dict) -> str:
    line = f"{engine['requests']} requests x {engine['new_tokens']} new:"
    for name, c in (("hf_paged.LLM", engine), ("generate_batch", hf)):
        line += f" {name} " + (f"{c['tokens_per_s']:.0f} tok/s," if "tokens_per_s" in c else
                               f"failed ({str(c.get('error', '?'))[:80]}),")
    if "tokens_per_s" in engine and "tokens_per_s" in hf:
        line += f" ratio {engine['tokens_per_s'] / hf['tokens_per_s']:.2f}x (target >= {BATCH_TARGET}x)"
    return line.rstrip(",")
