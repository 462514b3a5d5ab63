"""The GPU check's model sections (bench/gpu_sections.py lists them all): ``model.generate`` with
DynamicCache against the paged cache, and ``hf_paged.LLM`` against padded generate, on a random Llama of
real layer size. torch, transformers and hf_paged are imported inside functions only (see gpu_sections)."""
from __future__ import annotations

import functools
import time

from .gpu_timing import SectionContext, guarded

GPU_SHAPE = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=8,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096)
SMOKE_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=512)

def random_llama(smoke: bool, device):
    """A random-weights Llama of real layer size (8 layers, hidden 4096, 32/8 heads, d128, bf16); tiny with
    --cpu-smoke."""
    import torch

    from .models import random_llama as build
    shape, dtype = (SMOKE_SHAPE, torch.float32) if smoke else (GPU_SHAPE, torch.bfloat16)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)          # built on the device, in its dtype: no fp32 copy on the host
    try:
        with torch.device(device):
            model = build(shape, 0, dtype)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def section_generate(ctx: SectionContext) -> dict:
    import torch

    import hf_paged
    device = torch.device("cpu" if ctx.smoke else "cuda")
    model = random_llama(ctx.smoke, device)
    shapes = [(32, 512, 128), (1, 512, 64)] if not ctx.smoke else [(2, 8, 4)]
    summary = []
    for batch, prompt, new in shapes:
        if ctx.time_left() < 20 and not ctx.smoke:
            break
        case = {"case": "generate", "batch": batch, "prompt": prompt, "new_tokens": new}

        def run(case, batch=batch, prompt=prompt, new=new):
            ids = torch.randint(3, model.config.vocab_size, (batch, prompt), device=device)
            kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False)
            outs = {}
            for name, extra in (("DynamicCache", {}), ("paged", {"cache_implementation": "paged"})):
                if name == "paged":
                    hf_paged.patch(model)
                try:
                    with torch.inference_mode():
                        model.generate(**kw, max_new_tokens=4, min_new_tokens=4, **extra)     # warm-up
                        _sync(torch, device)
                        t0 = time.perf_counter()
                        outs[name] = model.generate(**kw, max_new_tokens=new, min_new_tokens=new, **extra)
                        _sync(torch, device)
                    case[f"{name}_tokens_per_s"] = batch * new / (time.perf_counter() - t0)
                finally:
                    if name == "paged":
                        hf_paged.unpatch(model)
            a, b = (outs[k][:, prompt:].cpu() for k in ("DynamicCache", "paged"))
            same = a == b
            case["greedy_equal"] = bool(same.all())
            case["tokens_agreeing"] = float(same.float().mean())
            diverged = (~same).any(0).nonzero()
            case["first_divergence_step"] = int(diverged[0]) if diverged.numel() else None
            case["speedup"] = case["paged_tokens_per_s"] / case["DynamicCache_tokens_per_s"]
        guarded(ctx, case, run)
        if "speedup" in case:
            summary.append(f"generate {batch}x({prompt}+{new}): DynamicCache {case['DynamicCache_tokens_per_s']:.0f} "
                           f"tok/s, paged {case['paged_tokens_per_s']:.0f} tok/s ({case['speedup']:.2f}x); greedy "
                           f"tokens equal: {case['greedy_equal']} ({case['tokens_agreeing']:.0%} agree)")
            print(summary[-1], flush=True)
    return {"summary": summary, "model": "random Llama, 8 layers, hidden 4096, 32/8 heads, vocab 32000, bf16"}


def _engine(case, model, prompts, new: int, padded_tokens, device) -> None:
    """hf_paged.LLM on the prompts, its KV pool sized by gpu_memory_utilization; token agreement with padded
    generate's."""
    import torch

    import hf_paged
    llm = hf_paged.LLM(model, gpu_memory_utilization=0.85, max_num_seqs=len(prompts), max_num_batched_tokens=4096,
                       enable_prefix_caching=False)
    llm.generate(prompts[:4], max_new_tokens=4, ignore_eos=True, do_sample=False, use_tqdm=False)   # warm-up
    _sync(torch, device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, max_new_tokens=new, ignore_eos=True, do_sample=False, use_tqdm=False)
    _sync(torch, device)
    case["seconds_timed"] = time.perf_counter() - t0
    case["tokens_per_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / case["seconds_timed"]
    try:
        stats = llm.stats()
        case.update(kv_blocks_total=stats["blocks_total"], block_size=stats["block_size"])
    except Exception as exc:  # noqa: BLE001 - the timing stands
        case["stats_error"] = repr(exc)[:300]
    if padded_tokens is not None:
        agree = [a == b for o, ref in zip(outs, padded_tokens) for a, b in zip(o.outputs[0].token_ids, ref)]
        case["tokens_agreeing_with_padded"] = sum(agree) / max(1, len(agree))


def section_engine(ctx: SectionContext) -> dict:
    import torch

    import hf_paged
    device = torch.device("cpu" if ctx.smoke else "cuda")
    model = random_llama(ctx.smoke, device)
    requests, new = (64, 128) if not ctx.smoke else (4, 4)
    gen = torch.Generator().manual_seed(0)
    low, high = (64, 512) if not ctx.smoke else (3, 9)
    lengths = torch.randint(low, high + 1, (requests,), generator=gen).tolist()
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    case = {"case": "padded_generate", "requests": requests, "new_tokens": new, "prompt_tokens": sum(lengths)}

    def padded(case):
        from .engines import padded_batch
        from .workloads import Request, Workload
        batch = padded_batch(Workload("padded", [Request(p, new) for p in prompts]), pad_id=0)
        width = batch["input_ids"].shape[1]
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        with torch.inference_mode():
            model.generate(input_ids=ids[:4], attention_mask=mask[:4], max_new_tokens=4, do_sample=False)
            _sync(torch, device)
            t0 = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False)
            _sync(torch, device)
        case["seconds_timed"] = time.perf_counter() - t0
        case["tokens_per_s"] = requests * new / case["seconds_timed"]
        case["_tokens"] = out[:, width:].cpu().tolist()
    guarded(ctx, case, padded)
    padded_tokens = case.pop("_tokens", None)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    engine_case = {"case": "engine", "requests": requests, "new_tokens": new, "gpu_memory_utilization": 0.85}
    engine = functools.partial(_engine, model=model, prompts=prompts, new=new, padded_tokens=padded_tokens,
                               device=device)
    guarded(ctx, engine_case, engine)
    summary = []
    if "tokens_per_s" in case and "tokens_per_s" in engine_case:
        summary.append(f"engine {requests} requests x {new} new: padded generate {case['tokens_per_s']:.0f} tok/s, "
                       f"hf_paged.LLM {engine_case['tokens_per_s']:.0f} tok/s "
                       f"({engine_case['tokens_per_s'] / case['tokens_per_s']:.2f}x), "
                       f"KV pool {engine_case.get('kv_blocks_total')} blocks")
    return {"summary": summary}
