"""The sections of bench/gpu_check.py (env, correctness, decode_bandwidth, extend, generate, engine,
quantised) and their cases; ``SECTIONS`` names them, in run order. Each runs in its own process, started by
gpu_check.py; hf_paged, torch and transformers are imported inside functions only, after that process set up
hf_paged's import path (gpu_check.import_package: the installed package, else the checkout's folders)."""
from __future__ import annotations

import functools
import importlib
import math
import subprocess
import sys
import time

from .gpu_timing import (SKIP_NO_CUDA, SectionContext, _compare, _tolerance, contiguous_kv, device_and_backend,
                         guarded, heat_up, kernel_choice, l2_bytes, measure, paged_kv, sdpa_runner, split_backend)

GROUPS = (1, 4, 8, 16, 32)


def section_env(ctx: SectionContext) -> dict:
    import torch
    figures = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
               "cuda_available": torch.cuda.is_available(), "package": ctx.package}
    for name in ("transformers", "numpy"):
        figures[name] = _version_of(name)
    try:
        from hf_paged.backends import cupy_loader
        figures["driver_cuda_version"] = cupy_loader.driver_version()
        figures["cupy_distributions"] = cupy_loader.installed_cupy()
        try:
            cupy = cupy_loader.import_cupy()
            figures["cupy"] = cupy.__version__
            figures["cupy_cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
            figures["nvrtc"] = ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
            figures["cuda_include_dirs"] = cupy_loader.cuda_include_dirs(cupy_loader.cupy_cuda_major(cupy))
        except Exception as exc:  # noqa: BLE001 - the loader's message is the finding
            figures["cupy_error"] = f"{type(exc).__name__}: {exc}"
    except ImportError as exc:
        figures["cupy_loader_error"] = repr(exc)
    figures["nvidia_smi"] = _nvidia_smi()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        figures.update(device=props.name, capability=f"{props.major}.{props.minor}",
                       sms=props.multi_processor_count, memory_GiB=round(props.total_memory / 2**30, 1),
                       l2_MB=round(getattr(props, "L2_cache_size", 0) / 1e6, 1))
        if hasattr(torch.cuda, "get_device_capability"):
            figures["flash_sdp_enabled"] = torch.backends.cuda.flash_sdp_enabled()
    print("versions: " + ", ".join(f"{k}={figures.get(k)}" for k in (
        "driver_cuda_version", "torch_cuda", "cupy", "nvrtc", "torch", "transformers", "device")), flush=True)
    if not torch.cuda.is_available() and not ctx.smoke:
        figures["status"] = SKIP_NO_CUDA
    cupy_note = f"; cupy: {figures['cupy_error'][:200]}" if "cupy_error" in figures else ""
    figures["summary"] = [f"{figures.get('device', 'no CUDA device')}: driver CUDA "
                          f"{figures.get('driver_cuda_version')}, "
                          f"torch {figures['torch']} (CUDA {figures['torch_cuda']}), cupy {figures.get('cupy')}, "
                          f"NVRTC {figures.get('nvrtc')}; package {figures['package']}{cupy_note}"]
    return figures


def _version_of(name: str):
    try:
        return importlib.import_module(name).__version__
    except Exception:  # noqa: BLE001
        return None


def _nvidia_smi():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or out.stderr.strip()[:200]
    except (OSError, subprocess.SubprocessError) as exc:
        return repr(exc)


def _extend_positions(torch, lengths, q_len: int, device):
    """query_pos [B, q_len]: each row's last min(n, q_len) stored tokens are its new ones, right-aligned."""
    pos = torch.full((len(lengths), q_len), -1, dtype=torch.int32, device=device)
    for b, n in enumerate(lengths):
        new = min(n, q_len)
        pos[b, q_len - new:] = torch.arange(n - new, n, device=device, dtype=torch.int32)
    return pos


def _precompile(backend, torch, dims, device) -> dict:
    """Build the attention modules of these head dims in parallel (NVRTC; CuPy's disk cache keeps them for
    the later sections). Only a warm-up: any failure shows again, per case, in the grid."""
    if not hasattr(backend, "launcher"):
        return {"precompile": "skipped (no launcher)"}
    from concurrent.futures import ThreadPoolExecutor
    t0 = time.perf_counter()
    try:
        from hf_paged.backends import kernel_registry as reg
        modules = {}
        for spec in reg.all_kernels():     # one entry point per compiled unit: these head dims, the cache ops
            if not spec.kv_format and (spec.head_dim in dims or spec.source == reg.CACHE_SOURCE):
                modules.setdefault(spec.module, spec)
        with ThreadPoolExecutor(len(modules)) as pool:
            list(pool.map(lambda s: backend.launcher.prepare(s, device), modules.values()))
        return {"precompile_s": round(time.perf_counter() - t0, 2)}
    except Exception as exc:  # noqa: BLE001 - see the docstring
        return {"precompile_error": f"{type(exc).__name__}: {exc}"[:500]}


def section_correctness(ctx: SectionContext) -> dict:
    import torch
    device, backend, ref = device_and_backend(ctx)
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    dims, blocks = (128, 64, 256), (16, 8, 32)
    figures = _precompile(backend, torch, dims, device)
    splits = [("auto", backend)]
    for partition in (128, 512):
        try:
            splits.append((f"split{partition}", split_backend(backend, partition)))
        except Exception as exc:  # noqa: BLE001 - the other cases still run
            ctx.record({"case": f"split{partition} backend", "ok": False, "error": repr(exc)[:500]})
    grid = [(dt, d, bs) for dt in dtypes for d in dims for bs in blocks]    # bf16 d128 block 16 first
    if ctx.smoke:
        grid = grid[:2]
    alive, done = True, 0
    for i, (dtype, d, bs) in enumerate(grid):
        if not alive or ctx.time_left() < 25:
            figures["grid_truncated_at"] = f"{i}/{len(grid)}"
            break
        group = GROUPS[i % len(GROUPS)]         # every group meets every dtype, head dim and block size
        alive = _grid_config(ctx, torch, device, backend, ref, splits, i, dtype, d, bs, group)
        done += 1
        print(f"config {done}/{len(grid)} {dtype} d{d} block {bs} group {group}: "
              f"{time.monotonic() - ctx.started:.0f} s", flush=True)
    if alive:
        alive = _long_cases(ctx, torch, device, backend, ref)
    figures["configs_done"] = f"{done}/{len(grid)}"
    figures["context_lost"] = not alive
    figures["kernels"] = kernel_choice(backend)
    return figures


def _grid_config(ctx, torch, device, backend, ref, splits, seed, dtype, d, bs, group) -> bool:
    """One (dtype, head dim, block size, group) of the grid: decode (windows 0/100, every split setting),
    extend (windows 0/17, q_len 40 over rows of 0..3000 tokens), write_kv + copy_blocks (exact)."""
    hkv = 2
    hq, tol, scale = group * hkv, _tolerance(torch, dtype), d ** -0.5
    lengths = [0, 1, bs - 1, bs, bs + 1, 777, 3000] if not ctx.smoke else [0, 1, bs - 1, bs + 1, 40]
    k_pool, v_pool, (table,), lens = paged_kv(lengths, bs, hkv, d, dtype, device, seed=seed)
    q = torch.randn(len(lengths), hq, d, device=device, dtype=dtype)
    base = {"dtype": str(dtype).replace("torch.", ""), "head_dim": d, "block": bs, "group": group,
            "q_heads": hq, "kv_heads": hkv}
    args = (k_pool, v_pool, table, lens)

    def decode(case, be, window, want):
        _compare(case, be.decode_attention(q, *args, scale, sliding_window=window), want, tol)

    q_len = 40 if not ctx.smoke else 8
    pos = _extend_positions(torch, lengths, q_len, device)
    qe = torch.randn(len(lengths), hq, q_len, d, device=device, dtype=dtype)

    def extend(case, window):
        want = ref.extend_attention(qe, *args, pos, scale, sliding_window=window)
        _compare(case, backend.extend_attention(qe, *args, pos, scale, sliding_window=window), want, tol)

    def cache_ops(case):
        key, value = (torch.randn(20, hkv, d, device=device, dtype=dtype) for _ in range(2))
        slots = torch.randperm(k_pool.shape[1] * bs, device=device)[:20]
        slots[3] = -1
        want = [k_pool.clone(), v_pool.clone()]
        ref.write_kv(*want, key, value, slots)
        backend.write_kv(k_pool, v_pool, key, value, slots)
        pairs = torch.tensor([[1, 2], [3, 4]], device=device)
        ref.copy_blocks(want, pairs)
        backend.copy_blocks([k_pool, v_pool], pairs)
        case["ok"] = bool(torch.equal(k_pool, want[0]) and torch.equal(v_pool, want[1]))

    for window in (0, 100):
        want = ref.decode_attention(q, *args, scale, sliding_window=window)
        for label, be in splits:
            case = {"case": "decode", **base, "window": window, "splits": label}
            if not guarded(ctx, case, functools.partial(decode, be=be, window=window, want=want)):
                return False
    for window in (0, 17):
        case = {"case": "extend", **base, "window": window, "q_len": q_len}
        if not guarded(ctx, case, functools.partial(extend, window=window)):
            return False
    return guarded(ctx, {"case": "write_kv+copy_blocks", **base}, cache_ops)


def _long_cases(ctx, torch, device, backend, ref) -> bool:
    """Long prompts and contexts: 8k-token prefill (full comparison), a 70k-token prefill at group 32 (past
    the old 65,535 grid-z limit; sampled query rows compared), a 128k-token decode (many splits)."""
    small = ctx.smoke
    cases = [   # name, tokens, KV heads, query heads, head dim, query rows compared (None: all)
        ("extend_prefill", 8192 if not small else 64, 8, 32, 128, None),
        ("extend_prefill_group32", 70000 if not small else 96, 1, 32, 64, 384 if not small else 15),
        ("decode_long", 131072 if not small else 512, 4, 32, 128, None),
    ]
    for name, length, hkv, hq, d, sample in cases:
        case = {"case": name, "dtype": "bfloat16", "tokens": length, "q_heads": hq, "kv_heads": hkv, "head_dim": d,
                "rows_compared": sample}
        if ctx.time_left() < (30 if not small else 0):
            ctx.record({**case, "skipped": "section deadline near", "ok": None})
            continue
        if not guarded(ctx, case, functools.partial(_long_case, torch=torch, device=device, backend=backend, ref=ref)):
            return False
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return True


def _long_case(case, torch, device, backend, ref) -> None:
    bf16, bs = torch.bfloat16, 16
    length, hkv, hq, d, sample = (case[k] for k in ("tokens", "kv_heads", "q_heads", "head_dim", "rows_compared"))
    scale = d ** -0.5
    rows = [length, length // 3] if case["case"] == "decode_long" else [length]
    k_pool, v_pool, (table,), lens = paged_kv(rows, bs, hkv, d, bf16, device, seed=7)
    args = (k_pool, v_pool, table, lens)
    if case["case"] == "decode_long":
        q = torch.randn(len(rows), hq, d, device=device, dtype=bf16)
        _compare(case, backend.decode_attention(q, *args, scale), ref.decode_attention(q, *args, scale),
                 _tolerance(torch, bf16))
        return
    q = torch.randn(1, hq, length, d, device=device, dtype=bf16)
    pos = torch.arange(length, device=device, dtype=torch.int32).view(1, -1)
    got = backend.extend_attention(q, *args, pos, scale)
    if sample is None:
        want = ref.extend_attention(q, *args, pos, scale)
    else:           # the reference for some query rows only (query_pos may name any rows): first, middle, last
        third = sample // 3
        idx = torch.cat([torch.arange(third), torch.arange(length // 2, length // 2 + third),
                         torch.arange(length - third, length)]).to(device)
        want = ref.extend_attention(q[:, :, idx], *args, pos[:, idx], scale)
        got = got[:, :, idx]
    _compare(case, got, want, _tolerance(torch, bf16))


DECODE_PRIORITY = [(64, 4096, 4), (64, 4096, 16), (1, 4096, 4), (1, 4096, 16)]
DECODE_SHAPES = [(1, 4096), (16, 4096), (64, 4096), (256, 2048)]
DECODE_GQA = (1, 4, 8, 16)


def section_decode_bandwidth(ctx: SectionContext) -> dict:
    import torch
    device, backend, _ = device_and_backend(ctx)
    heat_up(device)
    l2 = l2_bytes(device)
    figures = {"l2_bytes": l2, "q_heads": 32, "head_dim": 128, "dtype": "bfloat16", "block": 16}
    if device.type == "cuda":
        figures["copy_1GiB_GBps"] = 2 * 2**30 / _copy_ms(torch, device, 2**30, 1) / 1e6     # read + written
    order = DECODE_PRIORITY + [(b, c, g) for b, c in DECODE_SHAPES for g in DECODE_GQA
                               if (b, c, g) not in DECODE_PRIORITY]
    if ctx.smoke:
        order = [(2, 64, 4), (1, 48, 1)]
    alive, summary = True, []
    for batch, context, group in order:
        if not alive or ctx.time_left() < 8:
            figures["truncated"] = True
            break
        case = {"case": "decode", "batch": batch, "context": context, "gqa": group}
        alive = guarded(ctx, case, lambda c: _decode_case(ctx, c, torch, device, backend, l2))
        if "ours_GBps" in case:
            summary.append(_decode_line(case))
            print(summary[-1], flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    figures["summary"] = summary
    figures["kernels"] = kernel_choice(backend)
    return figures


def _decode_case(ctx, case, torch, device, backend, l2):
    from hf_paged.backends import torch_backend
    hq, d, bs, dtype = 32, 128, 16, torch.bfloat16
    batch, context, group = case["batch"], case["context"], case["gqa"]
    hkv, elem = hq // group, 2
    kv_bytes = batch * context * hkv * d * elem * 2
    traffic = kv_bytes + 2 * batch * hq * d * elem            # K+V read, q read, out written
    copies = max(1, math.ceil(3 * l2 / kv_bytes))
    case.update(q_heads=hq, kv_heads=hkv, kv_MB=kv_bytes / 1e6, copies=copies)
    k_pool, v_pool, tables, lens = paged_kv([context] * batch, bs, hkv, d, dtype, device, copies=copies)
    qs = [torch.randn(batch, hq, d, device=device, dtype=dtype) for _ in range(copies)]
    scale = d ** -0.5
    workspaces = [{} for _ in range(copies)]       # one per "step": layers of a step share one

    def ours(i):
        c = i % copies
        return backend.decode_attention(qs[c], k_pool, v_pool, tables[c], lens, scale, max_context=context,
                                        workspace=workspaces[c])
    want = torch_backend.decode_attention(qs[0], k_pool, v_pool, tables[0], lens, scale, max_context=context)
    _compare(case, ours(0), want, _tolerance(torch, dtype))
    m = measure(ours, device, graphs=ctx.graphs)
    case.update(ours_ms=m["ms"], ours_timing=m, ours_GBps=traffic / m["ms"] / 1e6)
    copy_ms = _copy_ms(torch, device, kv_bytes, copies)
    case.update(copy_ms=copy_ms, copy_GBps=2 * kv_bytes / copy_ms / 1e6)
    case["fraction_of_copy"] = case["ours_GBps"] / case["copy_GBps"]
    # SDPA on K/V gathered into contiguous [B, Hkv, L, D] beforehand: distinct K and V for every copy
    runners = []
    for c in range(copies):
        k, v = contiguous_kv(k_pool, tables[c], context), contiguous_kv(v_pool, tables[c], context)
        run, case["sdpa_backend"] = sdpa_runner(qs[c].unsqueeze(2), k, v, causal=False)
        runners.append(run)
    m = measure(lambda i: runners[i % copies](), device, graphs=ctx.graphs)
    case.update(sdpa_ms=m["ms"], sdpa_timing=m, sdpa_GBps=traffic / m["ms"] / 1e6)
    case["latency_vs_sdpa"] = case["ours_ms"] / case["sdpa_ms"]


def _copy_ms(torch, device, nbytes: int, copies: int) -> float:
    """ms of a device-to-device copy of ``nbytes``, rotated over ``copies`` source/destination pairs."""
    src = torch.empty(copies * nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def copy(i):
        c = i % copies
        dst[c * nbytes:(c + 1) * nbytes].copy_(src[c * nbytes:(c + 1) * nbytes])
    return measure(copy, device, graphs=False)["ms"]


def _decode_line(c: dict) -> str:
    target = {(64, 4096, 4): 0.8, (64, 4096, 16): 0.6}.get((c["batch"], c["context"], c["gqa"]))
    note = ""
    if target is not None:
        note = f"  target {target:.0%} of copy: {'met' if c.get('fraction_of_copy', 0) >= target else 'missed'}"
    elif (c["batch"], c["context"]) == (1, 4096):
        note = f"  target <= 1.5x SDPA latency: {'met' if c.get('latency_vs_sdpa', 9) <= 1.5 else 'missed'}"
    sdpa = f"sdpa {c['sdpa_ms'] * 1e3:8.1f} us ({c['sdpa_GBps']:5.0f} GB/s)" if "sdpa_ms" in c else "sdpa -"
    return (f"decode {c['batch']:>3}x{c['context']:<5} GQA{c['gqa']:<2} {c['ours_ms'] * 1e3:8.1f} us "
            f"{c['ours_GBps']:6.0f} GB/s = {c.get('fraction_of_copy', 0):4.0%} of copy | {sdpa}{note}")


def section_extend(ctx: SectionContext) -> dict:
    import torch
    device, backend, _ = device_and_backend(ctx)
    heat_up(device)
    l2 = l2_bytes(device)
    lengths = (512, 2048, 4096, 8192) if not ctx.smoke else (32, 64)
    alive, summary = True, []
    for length in lengths:
        if not alive or ctx.time_left() < 8:
            break
        case = {"case": "extend", "tokens": length, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}
        alive = guarded(ctx, case, lambda c: _extend_case(ctx, c, torch, device, backend, l2))
        if "ours_TFLOPS" in case:
            target = "" if length < 2048 else (
                f"  target 50% of SDPA: {'met' if case.get('of_sdpa', 0) >= 0.5 else 'missed'}")
            nan = float("nan")
            summary.append(f"extend {length:>5} tokens: {case['ours_ms']:8.3f} ms {case['ours_TFLOPS']:7.1f} TFLOPS | "
                           f"sdpa {case.get('sdpa_ms', nan):8.3f} ms {case.get('sdpa_TFLOPS', nan):7.1f} "
                           f"TFLOPS = {case.get('of_sdpa', nan):4.0%}{target}")
            print(summary[-1], flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"summary": summary, "flops": "causal: 2*2*L^2*D*H/2", "kernels": kernel_choice(backend)}


def _extend_case(ctx, case, torch, device, backend, l2):
    length, hq, hkv, d, bs, dtype = case["tokens"], 32, 8, 128, 16, torch.bfloat16
    per_copy = (2 * hq + 2 * hkv) * length * d * 2            # q, out, K, V
    copies = max(1, math.ceil(3 * l2 / per_copy))
    flops = 2 * 2 * length * length * d * hq / 2
    case["copies"] = copies
    k_pool, v_pool, tables, lens = paged_kv([length], bs, hkv, d, dtype, device, copies=copies)
    qs = [torch.randn(1, hq, length, d, device=device, dtype=dtype) for _ in range(copies)]
    pos = torch.arange(length, device=device, dtype=torch.int32).view(1, -1)
    scale = d ** -0.5

    def ours(i):
        c = i % copies
        return backend.extend_attention(qs[c], k_pool, v_pool, tables[c], lens, pos, scale, max_context=length)
    kc = [contiguous_kv(k_pool, t, length) for t in tables]
    vc = [contiguous_kv(v_pool, t, length) for t in tables]
    runners = []
    for c in range(copies):
        run, how = sdpa_runner(qs[c], kc[c], vc[c], causal=True)
        runners.append(run)
    case["sdpa_backend"] = how
    _compare(case, ours(0), runners[0](), _tolerance(torch, dtype))
    m = measure(ours, device, graphs=ctx.graphs)
    case.update(ours_ms=m["ms"], ours_timing=m, ours_TFLOPS=flops / m["ms"] / 1e9)
    m = measure(lambda i: runners[i % copies](), device, graphs=ctx.graphs)
    case.update(sdpa_ms=m["ms"], sdpa_timing=m, sdpa_TFLOPS=flops / m["ms"] / 1e9)
    case["of_sdpa"] = case["ours_TFLOPS"] / case["sdpa_TFLOPS"]


def random_llama(smoke: bool, device):
    """A random-weights Llama of real layer size (8 layers, hidden 4096, 32/8 heads, d128, bf16); tiny with
    --cpu-smoke."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    if smoke:
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
        dtype = torch.float32
    else:
        config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=8,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096)
        dtype = torch.bfloat16
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
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
        width = max(lengths)
        ids = torch.zeros(requests, width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(device), mask.to(device)
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

    def engine(case):
        llm = hf_paged.LLM(model, gpu_memory_utilization=0.85, max_num_seqs=requests, max_num_batched_tokens=4096,
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
            case.update(kv_blocks_total=stats.blocks_total, block_size=stats.block_size)
        except Exception as exc:  # noqa: BLE001 - the timing stands
            case["stats_error"] = repr(exc)[:300]
        if padded_tokens is not None:
            agree = [a == b for o, ref in zip(outs, padded_tokens) for a, b in zip(o.outputs[0].token_ids, ref)]
            case["tokens_agreeing_with_padded"] = sum(agree) / max(1, len(agree))
    guarded(ctx, engine_case, engine)
    summary = []
    if "tokens_per_s" in case and "tokens_per_s" in engine_case:
        summary.append(f"engine {requests} requests x {new} new: padded generate {case['tokens_per_s']:.0f} tok/s, "
                       f"hf_paged.LLM {engine_case['tokens_per_s']:.0f} tok/s "
                       f"({engine_case['tokens_per_s'] / case['tokens_per_s']:.2f}x), "
                       f"KV pool {engine_case.get('kv_blocks_total')} blocks")
    return {"summary": summary}


def section_quantised(ctx: SectionContext) -> dict:
    """Quantised KV (kv_cache_dtype) at 64x4k, Llama-3-8B heads (32/8, d128, bf16 queries, block 16; 1 GB of
    bf16 K+V, far beyond the L2): decode against the PyTorch path on the same quantised pools, the write
    kernel's codes against kv_formats.quantize, and decode time per format beside the unquantised pools."""
    import torch

    from hf_paged.kv_formats import FORMATS, QuantizedPool, quantize
    device, backend, ref = device_and_backend(ctx)
    batch, context = (64, 4096) if not ctx.smoke else (2, 64)
    hq, hkv, d, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    k_pool, v_pool, (table,), lens = paged_kv([context] * batch, bs, hkv, d, dtype, device)
    q = torch.randn(batch, hq, d, device=device, dtype=dtype)
    scale = d ** -0.5
    auto = {"case": "quantised_decode", "format": "auto", "batch": batch, "context": context}

    def time_auto(case):
        m = measure(lambda i: backend.decode_attention(q, k_pool, v_pool, table, lens, scale, max_context=context),
                    device, graphs=ctx.graphs)
        case.update(ms=m["ms"], MB=2 * k_pool.nbytes / 1e6)
    guarded(ctx, auto, time_auto)
    summary = [f"quantised decode {batch}x{context}: auto {auto.get('ms', float('nan')):.3f} ms"]
    for name, fmt in FORMATS.items():
        if ctx.time_left() < 8:
            break
        case = {"case": "quantised_decode", "format": name, "batch": batch, "context": context}

        def run(case, fmt=fmt):
            pools = [QuantizedPool(*quantize(fmt, p), fmt, d) for p in (k_pool, v_pool)]
            got = backend.decode_attention(q, *pools, table, lens, scale, max_context=context)
            _compare(case, got, ref.decode_attention(q, *pools, table, lens, scale, max_context=context),
                     _tolerance(torch, dtype))
            m = measure(lambda i: backend.decode_attention(q, *pools, table, lens, scale, max_context=context),
                        device, graphs=ctx.graphs)
            case.update(ms=m["ms"], MB=sum(p.data.nbytes + p.scales.nbytes for p in pools) / 1e6)
            new = torch.randn(bs, hkv, d, device=device, dtype=dtype)          # one token per slot of block 1
            backend.write_kv(*pools, new, new, torch.arange(bs, 2 * bs, device=device))
            codes, scales = quantize(fmt, new)
            case["write_equal"] = bool(torch.equal(pools[0].data[:, 1], codes.transpose(0, 1))
                                       and torch.equal(pools[0].scales[:, 1], scales.transpose(0, 1)))
            case["ok"] = case["ok"] and case["write_equal"]
        guarded(ctx, case, run)
        if "ms" in case:
            summary[0] += f", {name} {case['ms']:.3f} ms ({'ok' if case['ok'] else 'WRONG'})"
    print(summary[0], flush=True)
    return {"summary": summary}




# name -> (deadline s, needs CUDA, function, one line). Order = run order: the most wanted first.
SECTIONS = {
    "env": (20, False, section_env, "versions (driver, CUDA, cupy, NVRTC, torch), device, CuPy loader verdict"),
    "correctness": (90, True, section_correctness, "kernels vs torch_backend: dtypes, head dims, blocks, groups, "
                                                   "windows, split-K, long prompts"),
    "decode_bandwidth": (90, True, section_decode_bandwidth, "decode GB/s vs copy and SDPA, 1x4k..256x2k, GQA 1-16"),
    "extend": (60, True, section_extend, "prefill TFLOPS vs SDPA flash (causal), 512..8k tokens"),
    "generate": (90, True, section_generate, "model.generate DynamicCache vs paged, random 8-layer Llama"),
    "engine": (90, True, section_engine, "hf_paged.LLM vs padded generate, 64 requests"),
    "quantised": (45, True, section_quantised, "quantised KV: decode vs PyTorch, write codes, time per format "
                                               "(runs only if the budget has room left)"),
}
