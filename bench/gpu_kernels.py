"""The GPU check's speed sections (bench/gpu_sections.py lists them all): decode bandwidth against a
device-to-device copy and SDPA, extend (prefill) TFLOPS against SDPA flash, and the quantised KV formats.
torch and hf_paged are imported inside functions only (see gpu_sections)."""
from __future__ import annotations

import math

from .gpu_quant import per_token, per_token_line, predicted_ns_per_token
from .gpu_timing import (SectionContext, _compare, _tolerance, contiguous_kv, device_and_backend, guarded, heat_up,
                         kernel_choice, l2_bytes, measure, paged_kv, sdpa_runner)

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
    from hf_paged.backends import Workspace, torch_backend
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
    workspaces = [Workspace() for _ in range(copies)]       # one per "step": layers of a step share one

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


def kernel_formats() -> dict:
    """The quantised formats the CUDA kernels read (kernel_registry.KV_FORMAT_TAGS), name -> KVFormat."""
    from hf_paged.backends.kernel_registry import KV_FORMAT_TAGS
    from hf_paged.kv_formats import FORMATS
    return {name: FORMATS[name] for name in KV_FORMAT_TAGS}


def section_quantised(ctx: SectionContext) -> dict:
    """Quantised KV (kv_cache_dtype) at 64x4k, Llama-3-8B heads (32/8, d128, bf16 queries, block 16; 1 GB of
    bf16 K+V, far beyond the L2): decode against the PyTorch path on the same quantised pools, the write
    kernel's codes against kv_formats.quantize, and decode time per format beside the unquantised pools.
    Formats without CUDA kernels (nvfp4, kivi: the PyTorch path serves them) are not timed here."""
    import torch

    from hf_paged.kv_formats import QuantizedPool, quantize
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
        per_token(case, batch, context, predicted.get("bf16"))     # inside: the case is recorded on return
    predicted = predicted_ns_per_token(batch, context, hq // hkv)
    guarded(ctx, auto, time_auto)
    timed = [auto]
    summary = [f"quantised decode {batch}x{context}: auto {auto.get('ms', float('nan')):.3f} ms"]
    for name, fmt in kernel_formats().items():
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
            case["fast_decode"] = bool(getattr(backend, "uses_fast_quantised", lambda *a: False)(q, pools[0]))
            per_token(case, batch, context, predicted.get(case["format"]))
        guarded(ctx, case, run)
        timed.append(case)
        if "ms" in case:
            summary[0] += f", {name} {case['ms']:.3f} ms ({'ok' if case['ok'] else 'WRONG'})"
    summary.append(per_token_line(timed))
    print("\n".join(summary), flush=True)
    return {"summary": summary, "kernels": kernel_choice(backend), "predicted_ns_per_token": predicted}
