"""One prepared check for a GPU machine (about 4-6 minutes on an H100/H200):

    python -m bench gpu [--out gpu_check.json] [--quick]     (or: python bench/gpu_check.py ...)

(a) every kernel against the PyTorch path on the GPU over a covering grid (head dims, block sizes,
    dtypes, GQA ratios, context lengths 0/1/block+-1/long, sliding window, split-K);
(b) decode bandwidth = KV bytes read / time (CUDA events, median; pools rotated so the bytes touched
    per measurement are several times the L2) for batch x context {1x4k, 8x2k, 64x4k, 256x1k} with
    Llama-3-8B (32q/8kv), Qwen2.5-7B (28q/4kv), GLM-4-9B (32q/2kv) head shapes (d128, bf16, block 16),
    as a fraction of a device-to-device copy measured in the same run, beside torch SDPA on contiguous
    KV, and beside the naive "one pass per query head" variant (our kernel at GQA 1 on repeated KV);
(c) prefill (extend) time against torch SDPA (causal, contiguous);
(d) generate tokens/s of hf_paged against DynamicCache on a small random Llama;
(e) quantised KV: write kernel vs the PyTorch codec, decode correctness and time per kv_cache_dtype.
Prints a table last and writes JSON. Needs CuPy and the CUDA headers (pip install hf-paged[cuda]).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

# hf_paged's kernel modules: imported by main() once a GPU is there, so that --help needs no CUDA stack
reg = ta = None


def _kernel_backend():
    global reg, ta
    from hf_paged.backends import kernel_registry as reg_  # noqa: PLC0415
    from hf_paged.backends import torch_backend as ta_  # noqa: PLC0415
    from hf_paged.backends.cuda_backend import CupyLauncher, KernelBackend  # noqa: PLC0415
    reg, ta = reg_, ta_
    return KernelBackend(CupyLauncher())

DEV = torch.device("cuda")
MODELS = {"Llama-3-8B": (32, 8), "Qwen2.5-7B": (28, 4), "GLM-4-9B": (32, 2)}
DECODE_SHAPES = [(1, 4096), (8, 2048), (64, 4096), (256, 1024)]
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4}


def median_ms(fn, iters=20, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def make_cache(lengths, block_size, num_kv_heads, head_dim, dtype, seed=0, copies=1):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    blocks = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks) + 1
    pools = [(torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen, device=DEV, dtype=dtype),
              torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen, device=DEV, dtype=dtype))
             for _ in range(copies)]
    order = torch.randperm(num_blocks, generator=gen, device=DEV).int()
    tables = torch.zeros(len(lengths), max(1, max(blocks)), dtype=torch.int32, device=DEV)
    used = 0
    for b, nb in enumerate(blocks):
        tables[b, :nb] = order[used:used + nb]
        used += nb
    return pools, tables, torch.tensor(lengths, dtype=torch.int32, device=DEV)


def check(name, out, ref, dtype, results):
    err = (out.float() - ref.float()).abs().max().item() if out.numel() else 0.0
    scale = max(1.0, ref.float().abs().max().item()) if ref.numel() else 1.0
    ok = math.isfinite(err) and err <= TOL[dtype] * scale
    results.append({"case": name, "max_abs_err": err, "ok": ok})
    if not ok:
        print(f"FAIL {name}: max abs err {err:.3g}", flush=True)


def correctness(backend, quick):
    results = []
    combos = [(d, 16) for d in reg.HEAD_DIMS] + [(128, 8), (128, 32), (64, 8), (256, 32)]
    if quick:
        combos = [(128, 16), (64, 8)]
    heads = [(8, 8), (32, 8), (28, 4), (32, 2), (16, 1)]
    # Build the modules in parallel first (NVRTC, then CuPy's disk cache on later runs).
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda d: backend.launcher.prepare(reg.decode_kernel("f16", d), DEV), reg.HEAD_DIMS))
    for i, (d, bs) in enumerate(combos):
        for dtype in (torch.float16, torch.bfloat16):
            hq, hkv = heads[i % len(heads)]
            lengths = [0, 1, bs - 1, bs, bs + 1, 777, 3000]
            pools, tables, lens = make_cache(lengths, bs, hkv, d, dtype, seed=i)
            kp, vp = pools[0]
            q = torch.randn(len(lengths), hq, d, device=DEV, dtype=dtype)
            tag = f"d{d} b{bs} {reg.DTYPE_TAGS[dtype]} {hq}/{hkv}"
            for window in (0, 100):
                ref = ta.decode_attention(q, kp, vp, tables, lens, d ** -0.5, sliding_window=window)
                for part in (None, 128):
                    backend.partition_size = part
                    out = backend.decode_attention(q, kp, vp, tables, lens, d ** -0.5, sliding_window=window)
                    check(f"decode {tag} w{window} p{part}", out, ref, dtype, results)
            backend.partition_size = None
            q_len = 40
            pos = torch.full((len(lengths), q_len), -1, dtype=torch.int32, device=DEV)
            for b, n in enumerate(lengths):
                new = min(n, q_len)
                pos[b, q_len - new:] = torch.arange(n - new, n, device=DEV, dtype=torch.int32)
            qe = torch.randn(len(lengths), hq, q_len, d, device=DEV, dtype=dtype)
            for window in (0, 17):
                ref = ta.extend_attention(qe, kp, vp, tables, lens, pos, d ** -0.5, sliding_window=window)
                out = backend.extend_attention(qe, kp, vp, tables, lens, pos, d ** -0.5, sliding_window=window)
                check(f"extend {tag} w{window}", out, ref, dtype, results)
            key = torch.randn(20, hkv, d, device=DEV, dtype=dtype)
            slots = torch.randperm(kp.shape[1] * bs, device=DEV)[:20]
            slots[3] = -1
            want = [kp.clone(), vp.clone()]
            ta.write_kv(*want, key, key, slots)
            backend.write_kv(kp, vp, key, key, slots)
            torch.cuda.synchronize()
            results.append({"case": f"write_kv {tag}", "ok": torch.equal(kp, want[0]) and torch.equal(vp, want[1])})
            pairs = torch.tensor([[0, 1], [2, 3]], device=DEV)
            want = [kp.clone(), vp.clone()]
            ta.copy_blocks(want, pairs)
            backend.copy_blocks([kp, vp], pairs)
            torch.cuda.synchronize()
            results.append({"case": f"copy_blocks {tag}", "ok": torch.equal(kp, want[0]) and torch.equal(vp, want[1])})
    return results


def copy_bandwidth():
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters=10)
    return 2 * src.numel() / ms / 1e6  # GB/s, bytes read + written


def decode_bandwidth(backend, quick):
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    rows = []
    shapes = DECODE_SHAPES[:2] if quick else DECODE_SHAPES
    for model, (hq, hkv) in MODELS.items():
        for batch, ctx in shapes:
            d, bs, dtype = 128, 16, torch.bfloat16
            kv_bytes = batch * ctx * hkv * d * 2 * 2
            copies = max(1, math.ceil(4 * l2 / kv_bytes))   # rotate pools: >= 4x L2 touched per round
            pools, tables, lens = make_cache([ctx] * batch, bs, hkv, d, dtype, copies=copies)
            q = torch.randn(batch, hq, d, device=DEV, dtype=dtype)
            it = iter(range(1 << 30))

            def ours():
                kp, vp = pools[next(it) % copies]
                backend.decode_attention(q, kp, vp, tables, lens, d ** -0.5, max_context=ctx)
            ms = median_ms(ours)
            # torch SDPA on contiguous KV [B, Hkv, ctx, D]
            kc = [torch.randn(batch, hkv, ctx, d, device=DEV, dtype=dtype) for _ in range(min(copies, 4))]

            def sdpa():
                k = kc[next(it) % len(kc)]
                F.scaled_dot_product_attention(q.unsqueeze(2), k, k, enable_gqa=True)
            ms_sdpa = median_ms(sdpa)
            # naive: one pass over the KV per query head = our kernel at GQA 1 on KV repeated per head
            group = hq // hkv
            kr = pools[0][0].repeat_interleave(group, dim=0)
            ms_naive = median_ms(lambda: backend.decode_attention(q, kr, kr, tables, lens, d ** -0.5, max_context=ctx))
            del kr, kc, pools
            torch.cuda.empty_cache()
            rows.append({"model": model, "batch": batch, "context": ctx, "kv_MB": kv_bytes / 1e6,
                         "ours_ms": ms, "ours_GBps": kv_bytes / ms / 1e6,
                         "sdpa_ms": ms_sdpa, "sdpa_GBps": kv_bytes / ms_sdpa / 1e6,
                         "naive_ms": ms_naive, "naive_GBps": kv_bytes / ms_naive / 1e6})
            print(f"decode {model} {batch}x{ctx}: {ms:.3f} ms", flush=True)
    return rows


def prefill(backend, quick):
    rows = []
    hq, hkv, d, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    for batch, length in ([(1, 512)] if quick else [(1, 512), (1, 2048), (4, 1024)]):
        pools, tables, lens = make_cache([length] * batch, bs, hkv, d, dtype)
        kp, vp = pools[0]
        q = torch.randn(batch, hq, length, d, device=DEV, dtype=dtype)
        pos = torch.arange(length, device=DEV, dtype=torch.int32).expand(batch, length).contiguous()
        ms = median_ms(lambda: backend.extend_attention(q, kp, vp, tables, lens, pos, d ** -0.5), iters=5)
        k = torch.randn(batch, hkv, length, d, device=DEV, dtype=dtype)
        ms_sdpa = median_ms(lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True), iters=5)
        rows.append({"batch": batch, "length": length, "ours_ms": ms, "sdpa_ms": ms_sdpa})
    return rows


def generate_throughput(quick):
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_paged
    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(DEV, torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    batch, prompt, new = (8, 128, 32) if quick else (32, 256, 128)
    ids = torch.randint(3, 32000, (batch, prompt), device=DEV)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
              do_sample=False)
    out = {}
    for name, extra in (("DynamicCache", {}), ("hf_paged", {"cache_implementation": "paged"})):
        if name == "hf_paged":
            hf_paged.patch(model)
        model.generate(**{**kw, "max_new_tokens": 4, "min_new_tokens": 4}, **extra)   # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(**kw, **extra)
        torch.cuda.synchronize()
        out[name] = batch * new / (time.perf_counter() - start)
    hf_paged.unpatch(model)
    return {"batch": batch, "prompt": prompt, "new_tokens": new, "tokens_per_s": out}


def quantised_decode(backend, shapes=((1, 4096), (64, 4096))):
    """Quantised KV (kv_cache_dtype): the write kernel against kv_formats.quantize (codes equal), decode
    against the PyTorch path on the dequantised pools, and decode time per format at Llama-3-8B's head
    shape (32q/8kv, d128, bf16 queries, block 16) — it should fall with the bytes read."""
    from hf_paged.kv_formats import FORMATS, QuantizedPool, dequantize, quantize  # noqa: PLC0415
    hq, hkv, d, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    rows = []
    for batch, ctx in shapes:
        (pools,), tables, lens = make_cache([ctx] * batch, bs, hkv, d, dtype)
        q = torch.randn(batch, hq, d, device=DEV, dtype=dtype)
        base_ms = median_ms(lambda: backend.decode_attention(q, *pools, tables, lens, d ** -0.5, max_context=ctx))
        row = {"batch": batch, "context": ctx, "auto_ms": base_ms, "auto_MB": pools[0].nbytes * 2 / 1e6}
        for name, fmt in FORMATS.items():
            quantised = [QuantizedPool(*quantize(fmt, p), fmt, d) for p in pools]
            ms = median_ms(lambda: backend.decode_attention(q, *quantised, tables, lens, d ** -0.5, max_context=ctx))
            out = backend.decode_attention(q, *quantised, tables, lens, d ** -0.5, max_context=ctx)
            ref = ta.decode_attention(q, *[dequantize(fmt, p.data, p.scales, dtype) for p in quantised], tables, lens,
                                      d ** -0.5, max_context=ctx)
            err = (out.float() - ref.float()).abs().max().item()
            # the write kernel: one token per slot of block 1, against the PyTorch codec
            new = torch.randn(bs, hkv, d, device=DEV, dtype=dtype)
            slots = torch.arange(bs, 2 * bs, device=DEV)
            backend.write_kv(*quantised, new, new, slots)
            codes, scales = quantize(fmt, new)
            write_ok = bool(torch.equal(quantised[0].data[:, 1], codes.transpose(0, 1)) and
                            torch.equal(quantised[0].scales[:, 1], scales.transpose(0, 1)))
            row[name] = {"ms": ms, "MB": sum(p.nbytes for p in quantised) / 1e6, "max_err": err,
                         "ok": math.isfinite(err) and err <= TOL[dtype], "write_equal": write_ok}
            del quantised
        rows.append(row)
        print(f"quantised decode {batch}x{ctx}: auto {base_ms:.3f} ms, " +
              ", ".join(f"{n} {row[n]['ms']:.3f} ms ({'ok' if row[n]['ok'] and row[n]['write_equal'] else 'WRONG'})"
                        for n in FORMATS), flush=True)
        del pools
        torch.cuda.empty_cache()
    return rows


def device_map_split():
    """Layers split between the GPU and the CPU (a device_map): each layer's pools on its own device; paged
    generate (greedy, beams) and the engine must give the default path's tokens."""
    import tempfile

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import hf_paged
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(tmp)
        device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                      "model.layers.2": "cpu", "model.layers.3": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
        model = AutoModelForCausalLM.from_pretrained(tmp, device_map=device_map).eval()
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, 1024, (3, 12), device=DEV)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    result = {"layer_devices": [str(d) for d in hf_paged.model_geometry(model).layer_devices]}
    for name, kw in (("greedy", dict(do_sample=False)), ("beams", dict(do_sample=False, num_beams=3))):
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, **kw)
        hf_paged.patch(model)
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, cache_implementation="paged", **kw)
        hf_paged.unpatch(model)
        result[name] = bool(torch.equal(want.cpu(), got.cpu()))
    outs = hf_paged.generate_many(model, [[5, 6, 7], [9] * 30], max_new_tokens=6, ignore_eos=True)
    result["engine"] = [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    return result


def main(argv=None, prog: str = "python -m bench gpu"):
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--quick", action="store_true", help="a smaller grid, for a first try")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("gpu_check needs a CUDA GPU")
    t0 = time.time()
    backend = _kernel_backend()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    report["correctness"] = correctness(backend, args.quick)
    print(f"correctness done ({time.time() - t0:.0f} s)", flush=True)
    report["copy_GBps"] = copy_bandwidth()
    report["decode"] = decode_bandwidth(backend, args.quick)
    report["prefill"] = prefill(backend, args.quick)
    report["generate"] = generate_throughput(args.quick)
    try:        # on its own: a failure here must not lose the sections above
        report["quantised_decode"] = quantised_decode(backend)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        report["quantised_decode"] = {"error": repr(e)}
    try:        # last, and on its own: a failure here must not lose the sections above
        report["device_map"] = device_map_split()
    except Exception as e:  # noqa: BLE001 - reported, not raised
        report["device_map"] = {"error": repr(e)}
    print(f"device_map (GPU + CPU layers): {report['device_map']}", flush=True)
    report["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)

    bad = [r for r in report["correctness"] if not r["ok"]]
    copy = report["copy_GBps"]
    print(f"\n{report['device']}  copy {copy:.0f} GB/s (read+write)  correctness: "
          f"{len(report['correctness']) - len(bad)}/{len(report['correctness'])} ok")
    print(f"{'model':<11} {'BxCtx':>9} {'KV MB':>7} {'ours ms':>8} {'GB/s':>6} {'%copy':>6} "
          f"{'sdpa ms':>8} {'GB/s':>6} {'naive ms':>8} {'GB/s':>6}")
    for r in report["decode"]:
        print(f"{r['model']:<11} {r['batch']:>4}x{r['context']:<4} {r['kv_MB']:>7.0f} {r['ours_ms']:>8.3f} "
              f"{r['ours_GBps']:>6.0f} {100 * r['ours_GBps'] / copy:>5.0f}% {r['sdpa_ms']:>8.3f} "
              f"{r['sdpa_GBps']:>6.0f} {r['naive_ms']:>8.3f} {r['naive_GBps']:>6.0f}")
    for r in report["prefill"]:
        print(f"prefill {r['batch']}x{r['length']}: ours {r['ours_ms']:.2f} ms, sdpa {r['sdpa_ms']:.2f} ms")
    g = report["generate"]
    print(f"generate {g['batch']}x({g['prompt']}+{g['new_tokens']}): " +
          ", ".join(f"{k} {v:.0f} tok/s" for k, v in g["tokens_per_s"].items()))
    print(f"total {report['seconds']:.0f} s; wrote {args.out}")
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main(prog="python bench/gpu_check.py")
