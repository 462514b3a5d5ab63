"""``python -m hf_paged.demo``: SmolLM2-135M-Instruct, a batch of chat prompts, with and without hf_paged.

Generates greedily with transformers' default DynamicCache (left-padded batch) and with a
``hf_paged.PagedCache`` on the patched model, checks that the texts are identical, and prints the KV
memory each path held and its generated tokens/s.

Where a row's tokens differ it prints the first differing token and whether the default path's
logits were nearly tied there (top-2 gap below NEAR_TIE), as rounding can flip such an argmax without
anything being wrong, in half precision above all; it exits with status 1 when a difference is not
explained so (a divergence at a clear argmax, or logits apart by more than LOGIT_TOL before it).

KV accounting (bytes per token = 2 · layers · kv_heads · head_dim · dtype size):
- DynamicCache: the nbytes of its key/value tensors at the end of generate. It only grows, so that
  is also its peak; it includes pad columns (left padding, and rows that finished early).
- PagedCache: ``cache.stats()`` sampled after every decoding step (blocks in use, real tokens
  stored) and the nbytes of its pool tensors (allocated; the pool grows by half on demand).
- "real tokens": prompt and generated tokens (EOS included) that a sequence still needs, no pads.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

from hf_paged.cache import kv_bytes_per_token

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Hi!",
    "Write a haiku about autumn leaves falling on a quiet pond.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "I am planning a week-long trip to Japan in spring. I like food, old temples and walking. "
    "Suggest a rough itinerary that starts in Tokyo and ends in Osaka, with one day trip.",
    "What is 17 times 3?",
    "Summarise the plot of Romeo and Juliet for a ten-year-old, in a friendly tone, without spoilers "
    "about the ending, and say why people still read it today.",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hf_paged.demo", description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=Path, help="text file, one prompt per line (default: 8 built-in prompts)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--quiet", action="store_true", help="print the summary only, not the texts")
    args = p.parse_args(argv)
    for name, least, most in (("max_new_tokens", 1, None), ("block_size", 1, 1024), ("threads", 1, None)):
        value = getattr(args, name)
        if value is not None and (value < least or (most is not None and value > most)):
            bound = f"in {least}..{most}" if most else f">= {least}"
            p.error(f"--{name.replace('_', '-')} must be {bound}, got {value}")
    if args.prompts is not None:
        try:
            args.prompt_lines = [line.strip() for line in args.prompts.read_text().splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as exc:
            p.error(f"--prompts {args.prompts}: cannot read it ({exc})")
        if not args.prompt_lines:
            p.error(f"--prompts {args.prompts} has no prompt (one per non-empty line)")
    return args


# Rounding tolerances of the paged path against the default one, in units of eps(dtype) * max|logit| of
# the default path's logits at that step (eps: 2**-23 fp32, 2**-10 fp16, 2**-7 bf16). The paths round
# differently (another attention summation order), and an argmax can flip only where the top-2 gap is
# smaller than the change of that margin. Measured on SmolLM2 (tests/integrations/test_half_precision.py): max
# |logit diff| 8.0 (fp16) and 9.8 (bf16) eps*max|logit|, top-2 margin change <= 3.1; fp32 as in
# tests/integrations/test_smollm2.py (~1e-4 on logits up to 40).
LOGIT_TOL = {torch.float32: 128.0, torch.float16: 16.0, torch.bfloat16: 16.0}
NEAR_TIE = {torch.float32: 256.0, torch.float16: 6.0, torch.bfloat16: 6.0}


def explain_differences(ref, out, prompt_width: int, eos_id: int, dtype: torch.dtype) -> tuple[list[str], bool]:
    """Why rows of two greedy runs differ: lines to print, and whether every difference is explained.

    ``ref`` (default path) and ``out`` (paged): generate outputs with ``sequences`` and ``logits``
    (tuples over steps of [B, vocab]). Per row, up to its first differing token (and its EOS): every
    logit must be within LOGIT_TOL of the reference's, and that first differing token must be at a
    near-tie, a step where the reference's top-2 logit gap is below NEAR_TIE.
    """
    eps = torch.finfo(dtype).eps
    name = str(dtype).removeprefix("torch.")
    ref_new, out_new = ref.sequences[:, prompt_width:], out.sequences[:, prompt_width:]
    lines, explained = [], True
    for row in range(ref_new.shape[0]):
        worst = worst_tol = 0.0          # largest |logit diff| so far, and its tolerance at that step
        for step in range(ref_new.shape[1]):
            want = int(ref_new[row, step])
            got = int(out_new[row, step]) if step < out_new.shape[1] else None
            if step >= min(len(ref.logits), len(out.logits)):
                if got != want:
                    lines.append(f"row {row} differs from generated token {step} on: the paged run has no "
                                 f"logits there (it stopped after {len(out.logits)} steps)")
                    explained = False
                break
            a, b = ref.logits[step][row].float(), out.logits[step][row].float()
            unit = eps * float(a.abs().max())
            diff = float((a - b).abs().max())
            if diff > LOGIT_TOL[dtype] * unit:
                lines.append(f"row {row}: logits at generated token {step} differ by up to {diff:.3g}, beyond "
                             f"the tolerance {LOGIT_TOL[dtype] * unit:.3g} ({LOGIT_TOL[dtype]:g} eps x max|logit| "
                             f"{a.abs().max():.1f}, {name}), tokens {'equal' if got == want else 'differ'}")
                explained = False
                break
            if diff > worst:
                worst, worst_tol = diff, LOGIT_TOL[dtype] * unit
            if got != want:
                top2 = a.topk(2).values
                gap, tie = float(top2[0] - top2[1]), NEAR_TIE[dtype] * unit
                if gap < tie:
                    lines.append(f"row {row} differs from generated token {step} on: a near-tie (top-2 gap "
                                 f"{gap:.3g} < {tie:.3g} in {name}); earlier tokens equal, logits within "
                                 f"{worst:.3g} (tolerance {worst_tol:.3g})")
                else:
                    lines.append(f"row {row} differs from generated token {step} on: NOT a near-tie (top-2 gap "
                                 f"{gap:.3g} >= {tie:.3g} in {name}; token {got} vs {want}); earlier logits within "
                                 f"{worst:.3g}")
                    explained = False
                break
            if want == eos_id:
                break
    return lines, explained


def dynamic_cache_bytes(cache) -> int:
    """Sum of the nbytes of every key/value tensor a transformers cache holds."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.nbytes
    return total


def generated_lengths(sequences: torch.Tensor, prompt_width: int, eos_id: int) -> list[int]:
    """Generated tokens per row up to and including its first EOS (pads after EOS are not counted)."""
    lengths = []
    for row in sequences[:, prompt_width:].tolist():
        lengths.append(row.index(eos_id) + 1 if eos_id in row else len(row))
    return lengths


class _StatsProbe:
    """A StoppingCriteria that never stops: it samples ``cache.stats()`` after every step."""

    def __init__(self, cache):
        self.cache, self.samples = cache, []

    def __call__(self, input_ids, scores, **kwargs):
        self.samples.append(self.cache.stats())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _generate(model, inputs, cache, max_new_tokens, stopping=None, logits=False):
    """(sequences, or with ``logits`` generate's output with ``.sequences`` and ``.logits``; seconds)."""
    from transformers import StoppingCriteriaList  # noqa: PLC0415
    start = time.perf_counter()
    extra = dict(return_dict_in_generate=True, output_logits=True) if logits else {}
    # transformers 5.24 renamed generate's past_key_values to cache; the old name works through 5.x.
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=max_new_tokens, do_sample=False,
                             stopping_criteria=StoppingCriteriaList(stopping or []), **extra)
    return out, time.perf_counter() - start


def _best_times(model, inputs, args, rounds: int = 2) -> tuple[float, float]:
    """Seconds of the fastest of ``rounds`` alternating runs of each path (a noisy machine slows single runs)."""
    import hf_paged  # noqa: PLC0415
    from transformers import DynamicCache  # noqa: PLC0415

    dyn, paged = [], []
    for _ in range(rounds):
        dyn.append(_generate(model, inputs, DynamicCache(config=model.config), args.max_new_tokens)[1])
        hf_paged.patch(model)
        try:
            cache = hf_paged.PagedCache(model.config, block_size=args.block_size)
            paged.append(_generate(model, inputs, cache, args.max_new_tokens)[1])
        finally:
            hf_paged.unpatch(model)
    return min(dyn), min(paged)


def _mib(n: float) -> str:
    return f"{n / 2**20:8.2f} MiB"


def _load(args):
    """(model, tokenizer, prompts, chat inputs) for the demo's settings."""
    from hf_paged.integrations.smollm2 import chat_inputs, load_smollm2  # noqa: PLC0415

    prompts = DEFAULT_PROMPTS
    if args.prompts:
        prompts = args.prompt_lines
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, tokenizer = load_smollm2(dtype=getattr(torch, args.dtype))
    print(f"SmolLM2-135M-Instruct loaded in {time.perf_counter() - t0:.1f} s; {len(prompts)} prompts, "
          f"max_new_tokens={args.max_new_tokens}, greedy, {args.dtype}, {torch.get_num_threads()} threads")
    return model, tokenizer, prompts, chat_inputs(tokenizer, prompts)


def _run_both(model, inputs, args):
    """Greedy generate with DynamicCache, then with PagedCache (after a warm-up of each, so first-call
    costs do not count). Returns (DynamicCache output, its cache, PagedCache output, its cache, the
    PagedCache's stats at every step)."""
    import hf_paged  # noqa: PLC0415
    from transformers import DynamicCache  # noqa: PLC0415

    _generate(model, inputs, DynamicCache(config=model.config), 2)
    dyn_cache = DynamicCache(config=model.config)
    ref_out, _ = _generate(model, inputs, dyn_cache, args.max_new_tokens, logits=True)
    hf_paged.patch(model)
    try:
        _generate(model, inputs, hf_paged.PagedCache(model.config, block_size=args.block_size), 2)
        cache = hf_paged.PagedCache(model.config, block_size=args.block_size)
        probe = _StatsProbe(cache)
        paged_out, _ = _generate(model, inputs, cache, args.max_new_tokens, [probe], logits=True)
    finally:
        hf_paged.unpatch(model)
    return ref_out, dyn_cache, paged_out, cache, probe.samples or [cache.stats()]


def _print_texts(prompts, prompt_lens, gen, texts_ref, texts_paged, identical: bool, quiet: bool) -> None:
    if not quiet:
        for i, (prompt, a, b) in enumerate(zip(prompts, texts_ref, texts_paged)):
            print(f"\n[{i}] ({prompt_lens[i]} prompt tokens, {gen[i]} generated) {prompt}")
            print(f"  DynamicCache: {a.strip()!r}")
            print(f"  PagedCache  : {'(same)' if a == b else repr(b.strip())}")
    print(f"\nAll {len(prompts)} outputs identical: {'YES' if identical else 'NO'}"
          + ("" if identical else f" ({sum(a != b for a, b in zip(texts_ref, texts_paged))} texts differ)"))


def _print_memory(args, bpt: int, width: int, batch: int, tokens: int, dyn: tuple, paged: tuple, samples) -> None:
    """The KV table: dyn = (bytes reserved, real-token bytes, seconds); paged = (pool bytes, bytes of
    blocks in use at the peak, real-token bytes at the peak, seconds)."""
    dyn_reserved, dyn_real, dyn_s = dyn
    pool_bytes, paged_in_use, paged_real, paged_s = paged
    print(f"\nKV cache, {bpt} bytes/token; batch {batch}, padded width {width}, "
          f"{tokens} generated tokens (EOS included)")
    header = f"{'':13}|{'KV reserved (peak)':>20} |{'KV in use (peak)':>18} |{'real tokens':>14} |{'util.':>7} |{'tokens/s':>9}"
    print(header + "\n" + "-" * len(header))
    print(f"{'DynamicCache':13}|{_mib(dyn_reserved):>20} |{_mib(dyn_reserved):>18} |{_mib(dyn_real):>14} |"
          f"{dyn_real / dyn_reserved:7.1%} |{tokens / dyn_s:9.1f}")
    print(f"{'PagedCache':13}|{_mib(pool_bytes):>20} |{_mib(paged_in_use):>18} |{_mib(paged_real):>14} |"
          f"{paged_real / max(paged_in_use, 1):7.1%} |{tokens / paged_s:9.1f}")
    print(f"\nPagedCache: block_size {args.block_size}, pool {samples[-1]['blocks_total']} blocks, "
          f"peak {max(s['peak_blocks_used'] for s in samples)} blocks in use; reserved = the pool's tensors (it "
          f"grows on demand), utilisation = real-token bytes / bytes of blocks in use at the peak.\n"
          f"DynamicCache holds pad columns and finished rows until generate returns.")
    print(f"Peak KV in use: PagedCache {paged_in_use / dyn_reserved:.0%} of DynamicCache's; "
          f"speed {dyn_s / paged_s:.2f}x DynamicCache's tokens/s (best of 2 alternating runs each).")


def main(argv=None) -> int:
    """Run the demo; returns the exit status (1: a difference that a near-tie does not explain)."""
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    model, tokenizer, prompts, inputs = _load(args)
    width = inputs["input_ids"].shape[1]
    prompt_lens = inputs["attention_mask"].sum(1).tolist()
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    bpt = kv_bytes_per_token(model.config, dtype)
    ref_out, dyn_cache, paged_out, cache, samples = _run_both(model, inputs, args)
    ref, out = ref_out.sequences, paged_out.sequences
    gen = generated_lengths(ref, width, eos)
    dyn_s, paged_s = _best_times(model, inputs, args)
    # stats(): kv_bytes_reserved = blocks in use, kv_bytes_used = real tokens stored (shared blocks once);
    # the pool tensors themselves (blocks_total) may be larger: the pool grows on demand.
    peak = max(samples, key=lambda s: s["kv_bytes_reserved"])
    texts_ref = tokenizer.batch_decode(ref[:, width:], skip_special_tokens=True)
    texts_paged = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    identical = out.shape == ref.shape and torch.equal(out, ref)
    _print_texts(prompts, prompt_lens, gen, texts_ref, texts_paged, identical, args.quiet)
    why, explained = explain_differences(ref_out, paged_out, width, eos, dtype)
    for line in why:
        print(f"  {line}")
    if not identical or why:
        print(f"  {'Explained' if explained else 'NOT explained'}: near-tie = top-2 gap of DynamicCache's logits "
              f"below {NEAR_TIE[dtype]:g} eps x max|logit| at that step, logit tolerance {LOGIT_TOL[dtype]:g} eps "
              f"x max|logit| (eps of {args.dtype}: {torch.finfo(dtype).eps:.3g}); rounding differs between the "
              f"paths, so a near-tied argmax may flip" + ("." if explained else "; a difference elsewhere is a bug."))
    dyn_reserved = dynamic_cache_bytes(dyn_cache)
    pool_bytes = cache.pool_bytes
    _print_memory(args, bpt, width, len(prompts), sum(gen), (dyn_reserved, (sum(prompt_lens) + sum(gen)) * bpt, dyn_s),
                  (pool_bytes, peak["kv_bytes_reserved"], peak["kv_bytes_used"], paged_s), samples)
    return 0 if explained else 1


if __name__ == "__main__":
    sys.exit(main())
