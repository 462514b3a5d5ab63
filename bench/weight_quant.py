"""Weight-quantised SmolLM2-135M on the paged path: weight bytes, engine speed, perplexity, exactness.

``python -m bench weight-quant [--schemes none,torchao-int8,...] [--threads 1] [--rounds 3] [--out DIR]``

Schemes: ``none`` (fp32), the ``hf_paged.integrations.weight_quant`` schemes applied to the loaded fp32
model (``torchao-int8``, ``bnb-int8``, ``bnb-nf4``, ``bnb-fp4``), and pre-quantised compressed-tensors
checkpoints written from it by ``save_compressed_tensors`` and loaded back by ``from_pretrained``
(``ct-w4a16``: 4-bit groups of 64, since 128 does not divide SmolLM2's 576; ``ct-w8a8``).
Per scheme:
weights     bytes of the model's tensors in memory (tied embeddings once; quantised tensors by their
            storage: packed codes, scales, zero points), and a checkpoint's safetensors bytes on disk.
perplexity  teacher-forced, the default path, one forward per passage: ``--per-kind`` held-out passages of each kind of
            ``kv_quant_texts`` (32-token prompt + 128 scored tokens each; 8 per kind: 3,072 tokens).
exactness   the demo's 8 chat prompts x ``--tokens`` greedy tokens: patched paged generate against the same model's
            default path as one left-padded batch (rows equal, first-step logits' largest difference), and the
            engine's tokens against each prompt alone through the default path (rows equal).
speed       the engine (``hf_paged.LLM``, prefix caching off) on the 8 prompts x ``--tokens`` tokens (ignore_eos),
            every scheme once per round, order alternating, ``--rounds`` rounds: useful tokens/s
            min/median/max. Figures taken on a shared machine are under load (the load average is recorded).
Writes ``weight-quant-<stamp>.json`` and ``.md`` under bench/results.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import tempfile
import time
from pathlib import Path

import torch

import hf_paged
from hf_paged.demo import DEFAULT_PROMPTS

from .common import RESULTS, load_avg, machine, md_table, spread, stamp, versions
from .kv_quant_texts import PROMPT, held_out_passages

SCHEMES = ["none", "torchao-int8", "bnb-int8", "bnb-nf4", "bnb-fp4", "ct-w4a16", "ct-w8a8"]
CT_PRESETS = {"ct-w4a16": ("W4A16", 64), "ct-w8a8": ("W8A8", None)}     # preset, group size


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds: a tensor subclass (torchao's) by its inner tensors, recursively."""
    if hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def weight_bytes(model) -> int:
    """The model's state in memory (parameters, buffers, bnb's quant_state entries), each tensor once."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        key = (t.data_ptr(), t.numel(), t.dtype) if type(t) in (torch.Tensor, torch.nn.Parameter) else id(t)
        if key not in seen:
            seen.add(key)
            total += tensor_bytes(t)
    return total


@contextlib.contextmanager
def quantised(base, scheme: str):
    """(model, checkpoint bytes on disk or None) for ``scheme``, built from the fp32 ``base``."""
    from hf_paged.integrations.weight_quant import copy_model, quantize_model, save_compressed_tensors

    if scheme == "none":
        yield base, None
    elif scheme in CT_PRESETS:
        from transformers import AutoModelForCausalLM
        preset, group = CT_PRESETS[scheme]
        with tempfile.TemporaryDirectory() as directory:
            save_compressed_tensors(base, directory, preset, group_size=group)
            disk = sum(p.stat().st_size for p in Path(directory).glob("*.safetensors"))
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True)
            model.generation_config = base.generation_config
            yield model.eval(), disk
    else:
        model = copy_model(base) if scheme.startswith("torchao") else base     # torchao quantises in place
        yield quantize_model(model, scheme), None


def perplexity(model, passages) -> dict:
    """Teacher-forced perplexity of the passages' scored tokens, the default path."""
    nll = []
    with torch.no_grad():
        for _, _, ids in passages:
            logits = model(input_ids=ids[None], use_cache=False).logits[0, PROMPT - 1:-1].float()
            nll.append(torch.nn.functional.cross_entropy(logits, ids[PROMPT:], reduction="none"))
    nll = torch.cat(nll)
    return {"ppl": float(nll.mean().exp()), "tokens": int(nll.numel())}


def exactness(model, tokenizer, inputs, prompts, new_tokens: int) -> dict:
    """Paged generate against the default path (one batch), the engine against each prompt alone."""
    kw = dict(**inputs, max_new_tokens=new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = model.generate(**kw)
    hf_paged.patch(model)
    try:
        out = model.generate(cache_implementation="paged", **kw)
    finally:
        hf_paged.unpatch(model)
    batch_rows = sum(torch.equal(a, b) for a, b in zip(out.sequences, ref.sequences))
    engine = hf_paged.LLM(model, tokenizer, enable_prefix_caching=False)
    outs = engine.generate(prompts, [{"max_new_tokens": new_tokens, "do_sample": False}] * len(prompts),
                           use_tqdm=False)
    alone_rows = 0
    for prompt, o in zip(prompts, outs):
        alone = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)[0]
        n = min(len(o.sequences[0]), len(alone))
        alone_rows += int(torch.equal(o.sequences[0][:n], alone[:n]))
    return {"rows": len(prompts), "paged_batch_rows_equal": batch_rows,
            "first_step_logits_max_diff": float((out.logits[0] - ref.logits[0]).abs().max()),
            "engine_rows_equal_alone": alone_rows}


def speed(engines: dict, prompts, rounds: int, tokens: int, progress) -> dict:
    """Useful tokens/s of each engine, interleaved rounds (alternating order)."""
    settings = [{"max_new_tokens": tokens, "ignore_eos": True, "do_sample": False}] * len(prompts)
    useful = tokens * len(prompts)
    for llm in engines.values():                                # warm-up, not timed
        llm.generate(prompts[:2], settings[:2], use_tqdm=False)
    rates = {name: [] for name in engines}
    names = list(engines)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            engines[name].generate(prompts, settings, use_tqdm=False)
            rates[name].append(useful / (time.perf_counter() - t0))
        progress(f"  round {r + 1}: " + ", ".join(f"{n} {rates[n][-1]:.1f}" for n in names))
    return {"useful_tokens": useful, "requests": len(prompts), **{n: spread(v) for n, v in rates.items()}}


def measure(schemes: list[str], args, progress) -> dict:
    """Every figure for every scheme; the models stay loaded so that the speed rounds interleave."""
    from hf_paged.integrations.smollm2 import chat_inputs, load_smollm2

    base, tokenizer = load_smollm2(dtype=torch.float32, verbose=False)
    inputs = chat_inputs(tokenizer, DEFAULT_PROMPTS)
    prompts = [row[mask.bool()].tolist() for row, mask in zip(inputs["input_ids"], inputs["attention_mask"])]
    passages = held_out_passages(tokenizer, per_kind=args.per_kind)
    result, engines = {}, {}
    with contextlib.ExitStack() as stack:
        for scheme in schemes:
            t0 = time.perf_counter()
            model, disk = stack.enter_context(quantised(base, scheme))
            row = {"weight_bytes": weight_bytes(model), "checkpoint_bytes": disk, **perplexity(model, passages),
                   **exactness(model, tokenizer, inputs, prompts, args.tokens)}
            row["weight_bytes_after_forward"] = weight_bytes(model)     # compressed-tensors unpacks on the first
            engines[scheme] = hf_paged.LLM(model, tokenizer, enable_prefix_caching=False)
            result[scheme] = row
            progress(f"{scheme}: {row} ({time.perf_counter() - t0:.0f} s)")
        speeds = speed(engines, prompts, args.rounds, args.tokens, progress)
    for scheme in schemes:
        result[scheme]["tokens_per_s"] = speeds[scheme]
    return {"schemes": result, "speed": {k: v for k, v in speeds.items() if k not in schemes}}


def report(result: dict) -> str:
    """The markdown table of a result."""
    rows, none = [], result["schemes"].get("none")
    for scheme, r in result["schemes"].items():
        s = r["tokens_per_s"]
        ppl = f"{r['ppl']:.2f}" + (f" ({100 * (r['ppl'] / none['ppl'] - 1):+.2f}%)" if none and scheme != "none" else "")
        disk = f"{r['checkpoint_bytes'] / 2**20:.0f}" if r["checkpoint_bytes"] else "–"
        rows.append([scheme, f"{r['weight_bytes'] / 2**20:.0f} / {r['weight_bytes_after_forward'] / 2**20:.0f}", disk,
                     f"{s['median']:.1f} ({s['min']:.1f}–{s['max']:.1f})" if s else "–", ppl,
                     f"{r['paged_batch_rows_equal']}/{r['rows']}", f"{r['first_step_logits_max_diff']:.1e}",
                     f"{r['engine_rows_equal_alone']}/{r['rows']}"])
    header = ["scheme", "weights MiB (loaded / after 1st forward)", "checkpoint MiB", "engine tokens/s (min–max)",
              "perplexity (vs none)", "paged = default, batch rows", "first-step logits max diff",
              "engine = each prompt alone"]
    h = result["host"]
    return "\n".join([f"# Weight-quantised SmolLM2-135M ({result['date']}, {result['threads']} thread(s), "
                      f"{h['cpu']}, flags {' '.join(h['cpu_flags'])}, load {h['load_avg_start']} -> "
                      f"{result['load_avg_end']}; speed under load)", "", *md_table(header, rows), ""])


def main(argv=None, prog: str = "python -m bench weight-quant") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated, of {','.join(SCHEMES)}")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (recorded)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved speed rounds")
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens per prompt (exactness and speed)")
    parser.add_argument("--per-kind", type=int, default=8, help="held-out passages per text kind (3 kinds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    schemes = args.schemes.split(",")
    unknown = sorted(set(schemes) - set(SCHEMES))
    if unknown:
        parser.error(f"unknown schemes {unknown}; known: {', '.join(SCHEMES)}")
    torch.set_num_threads(args.threads)
    progress = functools.partial(print, flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "threads": torch.get_num_threads(), "host": machine(),
              "versions": versions("torch", "transformers", "bitsandbytes", "torchao", "compressed_tensors"),
              "command": f"{prog} --schemes {args.schemes} --threads {args.threads} --rounds {args.rounds} --tokens {args.tokens} "
                          f"--per-kind {args.per_kind}"}
    result.update(measure(schemes, args, progress))
    result["load_avg_end"] = load_avg()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"weight-quant-{stamp()}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(report(result))
    print(report(result))
    print(f"wrote {stem}.json, .md")
