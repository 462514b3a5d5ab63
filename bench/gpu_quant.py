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


def predicted_extend_tflops(tokens: int) -> dict:
    """The static roofline's extend TFLOPS for one causal sequence of ``tokens`` (group 4, d128): "auto"
    (hfp_ragged, bf16) and each format's quantised tensor-core extend (bench/roofline_quant.py, H200
    assumed). A model, not a measurement."""
    from .roofline import Machine, Ragged, extend_row
    from .roofline_quant import quant_extend_designs
    m = Machine()
    out = {"auto": extend_row(Ragged(), tokens, m).tflops}
    for design in quant_extend_designs():
        out[design.fmt] = extend_row(design, tokens, m).tflops
    return out


def section_quantised_extend(ctx: SectionContext) -> dict:
    """Extend (prefill) of one 2048-token sequence per kv_cache_dtype: correctness against the PyTorch
    path on the same quantised pools, then time and TFLOPS beside "auto" (bf16 pools), with the kernel
    that served it (``tensor_cores``: fast_attention.cu's ragged kernels, model-dtype or quantised, after
    their first-use self-check; False: attention.cu) and the roofline's predicted TFLOPS."""
    import torch

    from hf_paged.kv_formats import QuantizedPool, quantize

    from .gpu_kernels import kernel_formats
    device, backend, ref = device_and_backend(ctx)
    tokens = SMOKE_TOKENS if ctx.smoke else EXTEND_TOKENS
    q, k_pool, v_pool, table, lens, pos, scale = _extend_inputs(torch, device, tokens)
    flops = extend_flops(tokens)
    predicted = predicted_extend_tflops(tokens)
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
            chooser = "uses_fast_kernels" if name == "auto" else "uses_fast_quantised_extend"
            case["tensor_cores"] = bool(getattr(backend, chooser, lambda *a: False)(q, kp))   # smoke: the PyTorch path
            m = measure(call, device, graphs=ctx.graphs)
            case.update(ms=m["ms"], timing=m, TFLOPS=flops / m["ms"] / 1e9,
                        predicted_TFLOPS=predicted.get(name) if tokens == EXTEND_TOKENS else None)
        guarded(ctx, case, run)
        if "ms" in case:
            summary += (f" {name} {case['ms']:.3f} ms {case['TFLOPS']:.1f} TFLOPS"
                        f" ({'ok' if case['ok'] else 'WRONG'}{', tensor cores' if case['tensor_cores'] else ''})")
    print(summary, flush=True)
    return {"summary": [summary], "kernels": kernel_choice(backend)}


def predicted_ns_per_token(batch: int, context: int, group: int) -> dict:
    """The static roofline's decode time per token of context (ns) at this shape: "bf16" (hfp_decode_fast)
    and each quantised format (bench/roofline_quant.py; H200 assumed). A model, not a measurement."""
    from .roofline import DecodeFast, Machine, decode_row
    from .roofline_quant import quant_designs, time_per_token
    m = Machine()
    out = {"bf16": time_per_token(decode_row(DecodeFast(), batch, context, group, m))}
    for design in quant_designs():
        out[design.fmt] = time_per_token(decode_row(design, batch, context, group, m))
    return out


def per_token(case: dict, batch: int, context: int, predicted: float | None) -> None:
    """Add the measured ns per token of context (the whole batch's) and the roofline's prediction."""
    if "ms" in case:
        case["ns_per_token"] = case["ms"] * 1e6 / (batch * context)
    if predicted is not None:
        case["predicted_ns_per_token"] = predicted


def per_token_line(cases: list[dict]) -> str:
    """"ns per token of context, measured (predicted)": auto (bf16) first, then each format with its ratio."""
    base = next((c.get("ns_per_token") for c in cases if c.get("format") == "auto"), None)
    parts = []
    for c in cases:
        if "ns_per_token" not in c:
            continue
        part = f"{c['format']} {c['ns_per_token']:.3f}"
        if "predicted_ns_per_token" in c:
            part += f" ({c['predicted_ns_per_token']:.3f} predicted)"
        if base and c.get("format") != "auto":
            part += f" = {c['ns_per_token'] / base:.2f}x bf16"
        parts.append(part)
    return "decode ns per token of context, measured (roofline): " + (", ".join(parts) or "none measured")
