"""The sections of the GPU check (bench/gpu_check.py): ``SECTIONS`` names them, in run order; env and
correctness are here, the speed sections in gpu_kernels.py, generate and engine in gpu_models.py. Each runs
in its own process, started by gpu_check.py; hf_paged, torch and transformers are imported inside functions
only, after that process set up hf_paged's import path (gpu_check.import_package: the installed package,
else the checkout's folders)."""
from __future__ import annotations

import functools
import importlib
import subprocess
import sys
import time

from .gpu_engine_step import section_engine_step, section_generate_batch
from .gpu_kernels import section_decode_bandwidth, section_extend, section_quantised
from .gpu_models import section_engine, section_generate
from .gpu_quant import section_quantised_extend
from .gpu_timing import (SKIP_NO_CUDA, SectionContext, _compare, _tolerance, device_and_backend, guarded, kernel_choice,
                         paged_kv, split_backend)

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




# name -> (deadline s, needs CUDA, function, one line). Order = run order: the most wanted first. The default
# run (gpu_check.TOTAL_BUDGET_S) reaches the sections after generate_batch only when the earlier ones finish
# before their deadlines; a section out of budget is reported as skipped (run it with --sections).
SECTIONS = {
    "env": (20, False, section_env, "versions (driver, CUDA, cupy, NVRTC, torch), device, CuPy loader verdict"),
    "correctness": (90, True, section_correctness, "kernels vs torch_backend: dtypes, head dims, blocks, groups, "
                                                   "windows, split-K, long prompts"),
    "quantised": (45, True, section_quantised, "quantised KV: decode vs PyTorch, write codes, ns per token of "
                                               "context per format vs bf16 beside the static roofline"),
    "engine_step": (75, True, section_engine_step, "engine decode step at batch 1/8/64 (graphs, eager) vs a "
                                                   "captured SDPA forward of transformers"),
    "generate_batch": (60, True, section_generate_batch, "hf_paged.LLM vs transformers' generate_batch, "
                                                         "64 requests"),
    "decode_bandwidth": (90, True, section_decode_bandwidth, "decode GB/s vs copy and SDPA, 1x4k..256x2k, GQA 1-16"),
    "extend": (60, True, section_extend, "prefill TFLOPS vs SDPA flash (causal), 512..8k tokens"),
    "generate": (90, True, section_generate, "model.generate DynamicCache vs paged, random 8-layer Llama"),
    "engine": (90, True, section_engine, "hf_paged.LLM vs padded generate, 64 requests"),
    "quantised_extend": (40, True, section_quantised_extend, "quantised KV: prefill vs PyTorch, time and TFLOPS "
                                                             "per format beside bf16 (if the budget has room left)"),
}
