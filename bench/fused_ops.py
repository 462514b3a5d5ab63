"""Op-level timing of one SmolLM2-shaped decoder layer with and without the engine's fused CPU ops.

    python -m bench fused-ops [--tokens 1,8,32,128,512] [--repeats 200] [--threads 1]

For each token count, one LlamaDecoderLayer of SmolLM2-135M's shape (random weights, SDPA attention, no
cache: the attention is the same on both sides) runs as the engine runs it — prepacked linears installed
(``hf_paged.engine.prepack``) — with the model's own module forwards and with the fused ones
(``hf_paged.engine.fused``), interleaved call by call; then the pieces alone: RMSNorm, the residual add
+ RMSNorm, rotary on q and k, SiLU·mul, each module formula against its op. Figures are microseconds per
call, min / median / max over ``--repeats`` batches of 10 calls (times under a shared machine's load
skew both sides alike; the ratio is the figure to read).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from .common import machine
from .models import SMOLLM2_SHAPE


def _timed(fns: dict, repeats: int, inner: int = 10) -> dict:
    """Per name: (min, median, max) µs per call, the names interleaved batch by batch."""
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - start) / inner * 1e6)
    return {name: (min(t), statistics.median(t), max(t)) for name, t in times.items()}


def layer_and_inputs(tokens: int):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    config = LlamaConfig(**SMOLLM2_SHAPE, attn_implementation="sdpa")
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, 0).eval()
    x = torch.randn(1, tokens, config.hidden_size)
    pos = torch.arange(tokens).view(1, -1)
    cos_sin = LlamaRotaryEmbedding(config)(x, pos)
    return config, layer, x, pos, cos_sin


def pieces(config, x, cos_sin, ops) -> dict:
    """The module formulas against their ops, on the layer's shapes."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb
    norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
    tokens, d = x.shape[1], config.head_dim
    q = torch.randn(1, tokens, config.num_attention_heads, d)
    k = torch.randn(1, tokens, config.num_key_value_heads, d)
    gate, up = torch.randn(1, tokens, config.intermediate_size), torch.randn(1, tokens, config.intermediate_size)
    cos, sin = cos_sin
    flat, res = x.view(tokens, -1), torch.randn_like(x)
    return {
        "rms_norm": {"module": lambda: norm(x), "fused": lambda: ops.rms_norm(flat, norm.weight, norm.variance_epsilon)},
        "add_rms_norm": {"module": lambda: norm(res + x),
                         "fused": lambda: ops.add_rms_norm(flat, res.view(tokens, -1), norm.weight, norm.variance_epsilon)},
        "rotary_q_k": {"module": lambda: apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin),
                       "fused": lambda: ops.rotary_(q.view(tokens, -1, d), k.view(tokens, -1, d), cos.view(tokens, -1),
                                                    sin.view(tokens, -1), False)},
        "silu_mul": {"module": lambda: F.silu(gate) * up,
                     "fused": lambda: ops.silu_mul(gate.view(tokens, -1), up.view(tokens, -1))},
    }


def main(argv=None, prog: str = "python -m bench fused-ops") -> dict:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,8,32,128,512", help="comma list of token counts per call")
    ap.add_argument("--repeats", type=int, default=200, help="interleaved batches of 10 calls per figure")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    from hf_paged.engine.cpu_ops import load_fused_ops
    from hf_paged.engine.fused import FusedOps
    from hf_paged.engine.prepack import PrepackedLinears
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    ops = load_fused_ops()
    out = {"machine": machine(), "threads": torch.get_num_threads(), "repeats": args.repeats, "tokens": {}}
    for tokens in map(int, args.tokens.split(",")):
        config, layer, x, pos, cos_sin = layer_and_inputs(tokens)
        packed, fused = PrepackedLinears(layer), FusedOps(layer)

        def own():
            with packed.installed(), packed.running():
                return layer(x, position_ids=pos, position_embeddings=cos_sin)

        def with_fused():
            with packed.installed(), fused.installed(), packed.running(), fused.running():
                return layer(x, position_ids=pos, position_embeddings=cos_sin)

        diff = (own() - with_fused()).abs().max().item()
        figures = {"layer": _timed({"module": own, "fused": with_fused}, args.repeats), "max_abs_diff": diff}
        for name, fns in pieces(config, x, cos_sin, ops).items():
            figures[name] = _timed(fns, args.repeats)
        out["tokens"][tokens] = figures
        print(f"{tokens:4d} tokens (threads {out['threads']}), µs per call median (min-max):")
        for name, t in figures.items():
            if name != "max_abs_diff":
                m, f = t["module"], t["fused"]
                print(f"  {name:13s} module {m[1]:8.1f} ({m[0]:.1f}-{m[2]:.1f})  fused {f[1]:8.1f} ({f[0]:.1f}-{f[2]:.1f})"
                      f"  {m[1] / f[1]:.2f}x")
        print(f"  layer outputs differ by at most {diff:.2e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out
