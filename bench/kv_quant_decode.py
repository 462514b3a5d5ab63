"""Held-out quality of quantised KV, decoded token by token (``python -m bench kv-quant --sections held-out``).

Why not one forward: a format whose stored codes depend on the order of writes (kivi keeps each open block
in the model's dtype and quantises it when it fills) is read differently by a 512-token forward than by
decoding; here every passage is a 32-token prompt (one prefill) then 128 forced tokens, one forward each,
through a PagedCache of each format, against the same run with model-dtype KV ("auto").

Texts: not the pydoc topics the quality section reads (the fp8/int4 defaults were chosen on them), but
long module docstrings of CPython's standard library and the stdlib's own license text, read from the
running interpreter (no download). Passages are those with at least 160 tokens, in the order below.
"""
from __future__ import annotations

import importlib
import sysconfig
import time
from pathlib import Path

import torch

import hf_paged

MODULES = ("argparse", "doctest", "decimal", "pickletools", "subprocess", "optparse", "tarfile", "typing")
PROMPT, FORCED = 32, 128


def held_out_texts(tokenizer, count: int = 6) -> list[tuple[str, torch.Tensor]]:
    """(source, token ids [PROMPT + FORCED]) for up to ``count`` passages."""
    sources = []
    license_file = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if license_file.exists():
        sources.append(("LICENSE.txt", license_file.read_text(errors="replace")))
    for name in MODULES:
        doc = importlib.import_module(name).__doc__ or ""
        sources.append((f"{name}.__doc__", doc))
    out = []
    for label, text in sources:
        ids = tokenizer(text, return_tensors="pt").input_ids[0]
        if len(ids) >= PROMPT + FORCED:
            out.append((label, ids[:PROMPT + FORCED]))
        if len(out) == count:
            break
    return out


def decoded_nll(model, ids: torch.Tensor, name: str) -> torch.Tensor:
    """Negative log-likelihood of ids[PROMPT:] given the prompt, one forward per forced token."""
    block_size = 32 if name == "kivi" else 16
    cache = hf_paged.PagedCache(model.config, kv_cache_dtype=name, dtype=model.dtype, block_size=block_size)
    with torch.no_grad(), hf_paged.use_paged_attention(model):
        logits = [model(input_ids=ids[None, :PROMPT], past_key_values=cache).logits[0, -1]]
        for t in range(PROMPT, len(ids) - 1):
            logits.append(model(input_ids=ids[None, t:t + 1], past_key_values=cache).logits[0, -1])
    log_probs = torch.stack(logits).float().log_softmax(-1)
    return -log_probs.gather(-1, ids[PROMPT:, None])[:, 0]


def held_out(model, tokenizer, names: list[str], progress) -> dict:
    texts = held_out_texts(tokenizer)
    out = {"passages": [label for label, _ in texts], "prompt": PROMPT, "forced": FORCED}
    ref = None
    for name in ["auto", *[n for n in names if n != "auto"]]:
        t0 = time.perf_counter()
        nll = torch.cat([decoded_nll(model, ids, name) for _, ids in texts])
        ppl = float(nll.mean().exp())
        ref = ppl if name == "auto" else ref
        out[name] = {"ppl": ppl, "ppl_delta_pct": 100 * (ppl / ref - 1), "seconds": time.perf_counter() - t0}
        progress(f"  {name:9s} ppl {ppl:.4f} ({out[name]['ppl_delta_pct']:+.2f}%)  ({out[name]['seconds']:.0f} s)")
    return out


def held_out_table(section: dict) -> list[str]:
    names = [n for n in section if isinstance(section[n], dict)]
    return [f"## Held-out text decoded token by token, fp32 model ({len(section['passages'])} passages: "
            f"{', '.join(section['passages'])}; {section['prompt']}-token prompt + {section['forced']} forced tokens)",
            "", "| kv_cache_dtype | perplexity | change vs auto |", "|---|---|---|",
            *(f"| {n} | {section[n]['ppl']:.4f} | {section[n]['ppl_delta_pct']:+.2f}% |" for n in names), ""]
