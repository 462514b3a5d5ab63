"""Held-out quality of quantised KV, decoded token by token (``python -m bench kv-quant --sections held-out``).

Decoded as a server would: every passage is a 32-token prompt (one prefill) then 128 forced tokens, one
forward each, through a PagedCache of each format, against the same run with model-dtype KV ("auto"). (Every
format now reads the same by one forward: per-token formats store the same codes whatever the order of
writes, and kivi's reads depend only on positions since 2026-12-05; before, one forward read kivi's own
blocks from codes.)

Texts (``kv_quant_texts``): three kinds of real text from the running interpreter, 8 passages each. Per
kind and over all: the perplexity change and the mean KL divergence of the next-token distributions
against "auto". Read the KL first: the perplexity change of ~1,000 tokens is one draw of the rounding
noise, with a spread of about sqrt(2 * KL / tokens) (fp8_e4m3's KL of ~1e-2 gives +-0.5%).
"""
from __future__ import annotations

import time

import torch

import hf_paged

from .kv_quant_texts import FORCED, LONG_KINDS, PROMPT, held_out_passages


def decoded_log_probs(model, ids: torch.Tensor, name: str, prompt: int = PROMPT) -> torch.Tensor:
    """log-softmax [FORCED, V] of each forced position given the prompt, one forward per forced token."""
    cache = hf_paged.PagedCache(model.config, kv_cache_dtype=name, dtype=model.dtype)    # (kivi: 32-token blocks)
    with torch.no_grad(), hf_paged.use_paged_attention(model):
        logits = [model(input_ids=ids[None, :prompt], past_key_values=cache).logits[0, -1]]
        for t in range(prompt, len(ids) - 1):
            logits.append(model(input_ids=ids[None, t:t + 1], past_key_values=cache).logits[0, -1])
    return torch.stack(logits).float().log_softmax(-1)


def _summary(nll: list[torch.Tensor], kl: list[torch.Tensor], ref_nll: list[torch.Tensor]) -> dict:
    nll, kl, ref = torch.cat(nll), torch.cat(kl), torch.cat(ref_nll)
    return {"ppl": float(nll.mean().exp()), "ppl_delta_pct": 100 * float((nll.mean() - ref.mean()).exp() - 1),
            "kl_mean": float(kl.mean()), "tokens": int(nll.numel())}


def held_out(model, tokenizer, names: list[str], progress, prompt: int = PROMPT) -> dict:
    """Passages outer, formats inner: only one passage's reference distributions are held at a time.
    ``prompt``: tokens before the forced ones; other than the default, the long set (``LONG_KINDS``, 6 each)."""
    texts = held_out_passages(tokenizer) if prompt == PROMPT else held_out_passages(tokenizer, LONG_KINDS, 6, prompt)
    kinds = list(dict.fromkeys(kind for kind, _, _ in texts))
    names = ["auto", *[n for n in names if n != "auto"]]
    nll = {(n, k): [] for n in names for k in kinds}
    kl = {(n, k): [] for n in names for k in kinds}
    seconds = dict.fromkeys(names, 0.0)
    for kind, _, ids in texts:
        ref = None
        for name in names:
            t0 = time.perf_counter()
            got = decoded_log_probs(model, ids, name, prompt)
            seconds[name] += time.perf_counter() - t0
            ref = got if name == "auto" else ref
            nll[name, kind].append(-got.gather(-1, ids[prompt:, None])[:, 0])
            kl[name, kind].append((ref.exp() * (ref - got)).sum(-1))
    out = {"passages": [label for _, label, _ in texts], "kinds": kinds, "prompt": prompt, "forced": FORCED}
    for name in names:
        row = {"seconds": seconds[name]}
        for kind in [*kinds, "all"]:
            chosen = kinds if kind == "all" else [kind]
            row[kind] = _summary(*([x for k in chosen for x in table[n, k]]
                                   for table, n in ((nll, name), (kl, name), (nll, "auto"))))
        out[name] = row
        progress(f"  {name:9s} " + "  ".join(f"{k} {row[k]['ppl_delta_pct']:+.2f}% (KL {row[k]['kl_mean']:.1e})"
                                             for k in [*kinds, "all"]) + f"  ({seconds[name]:.0f} s)")
    return out


def held_out_table(section: dict) -> list[str]:
    """Per format and kind: perplexity change / mean KL against auto (auto's row: its perplexity)."""
    names = [n for n in section if isinstance(section[n], dict)]
    kinds = [*section["kinds"], "all"]

    def cell(name, kind):
        r = section[name][kind]
        return f"{r['ppl']:.3f}" if name == "auto" else f"{r['ppl_delta_pct']:+.2f}% / {r['kl_mean']:.1e}"

    title = (f"## Held-out text decoded token by token, fp32 model ({len(section['passages'])} passages: "
             f"{', '.join(section['kinds'])}; {section['prompt']}-token prompt + {section['forced']} forced tokens "
             "each; perplexity change / mean KL against auto)")
    return [title, "",
            "| kv_cache_dtype | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds),
            *(f"| {n} | " + " | ".join(cell(n, k) for k in kinds) + " |" for n in names), ""]
