"""The GPU check's quantised-extend section (bench/gpu_sections.py lists every section): prefill over
quantised KV pools per format beside the model-dtype pools, each checked against the PyTorch path on the
same pools (hf_paged.backends.quantized_torch) before it is timed. Decode per format is
gpu_kernels.section_quantised. torch and hf_paged are imported inside functions only (see gpu_sections)."""
from __future__ import annotations

from .gpu_timing import SectionContext, _compare, _tolerance, device_and_backend, guarded, kernel_choice, measure, paged_kv

EXTEND_TOKENS, SMOKE_TOKENS = 2048, 48


def _extend_inputs(torch, device, tokens: int):
    """One causal sequence of ``tokens``, Llama-3-8B heads (32 / 8, d128), bf16, block 16."""
    hq, hkv, d, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    k_pool, v_pool, (table,), lens = paged_kv([tokens], bs, hkv, d, dtype, device)
    q = torch.randn(1, hq, tokens, d, device=device, dtype=dtype)
    pos = torch.arange(tokens, device=device, dtype=torch.int32).view(1, -1)
    return q, k_pool, v_pool, table, lens, pos, d ** -0.5


def extend_flops(tokens: int, q_heads: int = 32, head_dim: int = 128) -> float:
    """Causal attention FLOPs: QK^T and PV, 2 x 2 x D per visible (query, key) pair, L(L+1)/2 pairs."""
    return 4 * head_dim * q_heads * tokens * (tokens + 1) / 2


def section_quantised_extend(ctx: SectionContext) -> dict:
    """Extend (prefill) of one 2048-token sequence per kv_cache_dtype: correctness against the PyTorch
    path on the same quantised pools, then time and TFLOPS beside "auto" (bf16 pools)."""
    import torch

    from hf_paged.kv_formats import QuantizedPool, quantize

    from .gpu_kernels import kernel_formats
    device, backend, ref = device_and_backend(ctx)
    tokens = SMOKE_TOKENS if ctx.smoke else EXTEND_TOKENS
    q, k_pool, v_pool, table, lens, pos, scale = _extend_inputs(torch, device, tokens)
    flops = extend_flops(tokens)
    summary = f"quantised extend {tokens} tokens:"
    formats = kernel_formats()             # nvfp4 / kivi have no kernel: the PyTorch path serves them
    for name in ("auto", *formats):
        if ctx.time_left() < 8:
            break
        case = {"case": "quantised_extend", "format": name, "tokens": tokens}

        def run(case, name=name):
            kp, vp = (k_pool, v_pool) if name == "auto" else (
                QuantizedPool(*quantize(formats[name], p), formats[name], q.shape[-1]) for p in (k_pool, v_pool))

            def call(i):
                return backend.extend_attention(q, kp, vp, table, lens, pos, scale, max_context=tokens)
            _compare(case, call(0), ref.extend_attention(q, kp, vp, table, lens, pos, scale, max_context=tokens),
                     _tolerance(torch, q.dtype))
            m = measure(call, device, graphs=ctx.graphs)
            case.update(ms=m["ms"], timing=m, TFLOPS=flops / m["ms"] / 1e9)
        guarded(ctx, case, run)
        if "ms" in case:
            summary += f" {name} {case['ms']:.3f} ms {case['TFLOPS']:.1f} TFLOPS ({'ok' if case['ok'] else 'WRONG'})"
    print(summary, flush=True)
    return {"summary": [summary], "kernels": kernel_choice(backend)}
