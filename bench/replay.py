"""Allocator replay: hf_paged's KV memory at FULL ShareGPT lengths, without running the model.

KV memory is a function of lengths only, so the real ``hf_paged.PagedCache`` is driven through the
exact calls ``generate`` makes — ``plan_step`` with the 2D padding mask and the input ids of every
forward, ``reorder_cache`` with beam indices — with its pools on the ``meta`` device (no memory is
touched, no attention runs). ``tests/bench/test_bench_replay.py`` checks that a replay's per-step
``stats()`` equal those of a real ``generate`` on a tiny model for the same lengths.

Schedules replayed:
- padded static batch (greedy, lengths enforced as in ``bench.engines.ForceLengths``): prefill of
  the left-padded prompts, then one decode forward per generated token; a row's last token is EOS,
  fed once at the next forward (the cache releases the row's blocks), later inputs are pad; the run
  ends when the longest row has its last token (``max_new`` forwards in all).
- beam search (``num_beams`` rows of one prompt, ``early_stopping=True``, ``min_new_tokens`` =
  ``max_new_tokens``): the plan/reorder call sequence recorded from real SmolLM2-135M-Instruct beam
  searches on English text prompts (``bench/data/beam_idx_smollm2.json``, made by
  ``python -m bench record-beams``), and the fully diverged bound (beam i always continues
  beam i after the first step).

DynamicCache / StaticCache memory for the same batch is exact arithmetic: rows × columns × bytes/token
with columns = max prompt + max new − 1 (DynamicCache after the last forward) or max prompt + max new
(StaticCache's ``max_cache_len``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from hf_paged.cache.pools import kv_bytes_per_token

from .common import spread
from .models import SMOLLM2_SHAPE
from .workloads import sharegpt_lengths

DATA = Path(__file__).resolve().parent / "data"
BEAM_DATA = DATA / "beam_idx_smollm2.json"
PAD, EOS, PLAIN = 0, 2, 100  # token ids used by the replay (PLAIN + row: distinct prompt rows)
META = torch.device("meta")


def smollm2_config():
    """SmolLM2-135M's config, built offline (no weights)."""
    from transformers import LlamaConfig  # noqa: PLC0415
    return LlamaConfig(**SMOLLM2_SHAPE, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=1)


def _cache(config, block_size: int, dtype=torch.float32, **kwargs):
    import hf_paged  # noqa: PLC0415
    return hf_paged.PagedCache(config, block_size=block_size, dtype=dtype, device=META, **kwargs)


def _sample(cache) -> dict:
    s = cache.stats()
    return {"blocks_used": s["blocks_used"], "tokens_stored": s["tokens_stored"],
            "blocks_total": s["blocks_total"]}


def padded_inputs(prompt_lens: list[int], pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids/mask; row r's prompt is PLAIN + r repeated, so no two rows are identical."""
    width = max(prompt_lens)
    ids = torch.full((len(prompt_lens), width), pad, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompt_lens):
        ids[r, width - p:] = PLAIN + r
        mask[r, width - p:] = 1
    return ids, mask


def replay_padded(config, prompt_lens: list[int], output_lens: list[int], block_size: int = 16,
                  dtype=torch.float32, eos: int = EOS, pad: int = PAD, sample: bool = True,
                  **cache_kwargs) -> dict:
    """Replay a padded greedy ``generate`` whose row r generates exactly output_lens[r] tokens (the
    last one EOS). Returns per-step samples (after every forward, as a stopping criterion sees them),
    the cache's final ``stats()`` and the DynamicCache/StaticCache bytes of the same batch.
    Raises PoolExhaustedError when a fixed pool (``num_blocks`` / ``max_memory_bytes``) is too small.
    ``sample=False`` skips the per-step ``stats()`` (O(blocks) each) when only the outcome matters."""
    ids, mask = padded_inputs(prompt_lens, pad)
    batch, width = ids.shape
    max_new = max(output_lens)
    cache = _cache(config, block_size, dtype, **cache_kwargs)
    cache.eos_token_ids = frozenset([eos])          # what the generate hook sets for greedy/sampling
    cache.plan_step(mask, ids, batch, width, dtype, META)
    cache.end_step()                                # the forward (not run here) is over
    samples = [_sample(cache)] if sample else []
    outs = torch.tensor(output_lens)
    # generate appends a column of ones per step; a view of one preallocated mask is the same tensor
    full = torch.cat([mask, torch.ones(batch, max_new, dtype=mask.dtype)], dim=1)
    for k in range(1, max_new):                     # forward k feeds generated token k-1
        fed = torch.where(outs - 1 == k - 1, eos, torch.where(outs - 1 < k - 1, pad, PLAIN))
        cache.note_generated(fed.tolist())          # the hook's stopping criterion reports the sampled tokens
        cache.plan_step(full[:, :width + k], fed.unsqueeze(1), batch, 1, dtype, META)
        cache.end_step()
        if sample:
            samples.append(_sample(cache))
    bpt = cache.bytes_per_token
    return {"samples": samples, "stats": cache.stats(), "columns": cache.get_seq_length(), "rows": batch,
            "bytes_per_token": bpt, "block_size": block_size,
            "dynamic_bytes": batch * (width + max_new - 1) * bpt, "static_bytes": batch * (width + max_new) * bpt}


def replay_events(config, events: list, block_size: int = 16, dtype=torch.float32) -> dict:
    """Replay a recorded beam search: events are ["plan", rows, q_len] and ["reorder", beam_idx]."""
    cache = _cache(config, block_size, dtype)
    cache.eos_token_ids = frozenset()               # beam search: the hook keeps EOS beams' blocks
    samples, mask, ids = [], None, None
    for ev in events:
        if ev[0] == "plan":
            rows, q_len = ev[1], ev[2]
            if mask is None:    # prefill: num_beams identical copies of one prompt (shared blocks)
                mask = torch.ones(rows, q_len, dtype=torch.int64)
                ids = torch.full((rows, q_len), PLAIN, dtype=torch.int64)
            else:
                mask = torch.cat([mask, torch.ones(rows, q_len, dtype=torch.int64)], dim=1)
                ids = torch.full((rows, q_len), PLAIN, dtype=torch.int64)
            cache.plan_step(mask, ids, rows, q_len, dtype, META)
            cache.end_step()
        else:
            cache.reorder_cache(torch.tensor(ev[1]))
        samples.append(_sample(cache))
    bpt = cache.bytes_per_token
    rows = cache.batch_size
    return {"samples": samples, "stats": cache.stats(), "columns": cache.get_seq_length(), "rows": rows,
            "bytes_per_token": bpt, "dynamic_bytes": rows * cache.get_seq_length() * bpt}


def diverged_events(num_beams: int, prompt_len: int, max_new: int) -> list:
    """Upper bound: after the first step (all beams from beam 0, as beam search starts) beam i always
    continues beam i, so no generated block is ever shared."""
    events = [["plan", num_beams, prompt_len], ["reorder", [0] * num_beams]]
    for _ in range(max_new - 1):
        events += [["plan", num_beams, 1], ["reorder", list(range(num_beams))]]
    return events


def summarise(run: dict) -> dict:
    """Peak blocks in use (bytes), real tokens at that step, utilisation at peak and over the run."""
    bs, bpt = run.get("block_size", run["stats"]["block_size"]), run["bytes_per_token"]
    samples = run["samples"]
    peak = max(samples, key=lambda s: (s["blocks_used"], s["tokens_stored"]))
    live = [s for s in samples if s["blocks_used"]]
    return {
        "paged_peak_bytes": run["stats"]["peak_kv_bytes_reserved"],
        "paged_peak_sampled_bytes": peak["blocks_used"] * bs * bpt,
        "real_at_peak_bytes": peak["tokens_stored"] * bpt,
        "real_peak_bytes": max(s["tokens_stored"] for s in samples) * bpt,
        "utilisation_at_peak": peak["tokens_stored"] / (peak["blocks_used"] * bs),
        "utilisation_mean": sum(s["tokens_stored"] for s in live) / sum(s["blocks_used"] * bs for s in live),
        "utilisation_min": min(s["tokens_stored"] / (s["blocks_used"] * bs) for s in live),
        "pool_allocated_bytes": run["stats"]["kv_bytes_allocated"],
        "dynamic_bytes": run["dynamic_bytes"], "static_bytes": run.get("static_bytes"),
        "steps": len(samples),
    }


# ------------------------------------------------------------------ sections
def sharegpt_batches(config, batch: int = 16, seeds: int = 10, block_size: int = 16, cb_page_size: int = 32) -> dict:
    """Padded batches of ``batch`` unscaled ShareGPT requests (seed s draws as ``sharegpt_mix(batch, 2048, seed=s)``)."""
    prompts, outputs = sharegpt_lengths()
    per_seed, keys = [], ("paged_peak_bytes", "dynamic_bytes", "static_bytes", "real_at_peak_bytes",
                          "pool_allocated_bytes", "utilisation_at_peak", "utilisation_mean", "utilisation_min",
                          "paged_over_dynamic", "paged_over_static", "gb_policy_bytes", "paged_over_gb_policy",
                          "pool_over_dynamic")
    for seed in range(seeds):
        idx = np.random.default_rng(seed).choice(len(prompts), size=batch, replace=False)
        p, o = prompts[idx].tolist(), outputs[idx].tolist()
        s = summarise(replay_padded(config, p, o, block_size))
        bpt = kv_bytes_per_token(config, torch.float32)
        s["gb_policy_bytes"] = sum(-(-(a + b) // cb_page_size) * cb_page_size for a, b in zip(p, o)) * bpt
        s["paged_over_dynamic"] = s["paged_peak_bytes"] / s["dynamic_bytes"]
        s["paged_over_static"] = s["paged_peak_bytes"] / s["static_bytes"]
        s["pool_over_dynamic"] = s["pool_allocated_bytes"] / s["dynamic_bytes"]
        s["paged_over_gb_policy"] = s["paged_peak_bytes"] / s["gb_policy_bytes"]
        s.update(seed=seed, max_prompt=max(p), max_output=max(o), sum_prompt=sum(p), sum_output=sum(o))
        per_seed.append(s)
    return {"batch": batch, "seeds": seeds, "block_size": block_size, "cb_page_size": cb_page_size,
            "summary": {k: spread([s[k] for s in per_seed]) for k in keys}, "per_seed": per_seed}


def concurrency(config, budget_bytes: int, draws: int = 10, block_size: int = 16, seed: int = 0,
                max_len: int = 2048, cb_page_size: int = 256) -> dict:
    """ShareGPT requests held at once in ``budget_bytes`` of KV, per allocation policy, over ``draws``
    arrival orders: the largest n such that
    the first n requests, as one batch, never need more than the budget.
    - dynamic: padded DynamicCache batch, n × (max prompt + max output − 1) columns at its last step;
    - static: StaticCache with max_cache_len = max prompt + max output (oracle; n × that);
    - static_2048: StaticCache sized for any ShareGPT request (2048 per row, output unknown);
    - generate_batch / paged_full: every request reserves its full length rounded up to a page/block at
      admission (a scheduler that never preempts);
    - paged: the real PagedCache with ``max_memory_bytes = budget`` replaying the padded generate of the
      n requests (prompts stored without pads, blocks grow as tokens come, rows release at EOS):
      n fits when no step raises PoolExhaustedError (found by block arithmetic, then checked: the real
      cache replays n requests without error and raises for n + 1).
    """
    from hf_paged import PoolExhaustedError  # noqa: PLC0415

    prompts, outputs = sharegpt_lengths()
    bpt = kv_bytes_per_token(config, torch.float32)
    tokens = budget_bytes / bpt
    rng = np.random.default_rng(seed)
    counts: dict[str, list[int]] = {k: [] for k in ("dynamic", "static", "static_2048", "generate_batch",
                                                    "paged_full", "paged")}
    def fits(p, o, n):
        try:
            replay_padded(config, p[:n].tolist(), o[:n].tolist(), block_size, sample=False,
                          max_memory_bytes=budget_bytes)
            return True
        except PoolExhaustedError:
            return False

    for _ in range(draws):
        order = rng.permutation(len(prompts))[:4096]
        p, o = prompts[order], outputs[order]
        width = np.maximum.accumulate(p) + np.maximum.accumulate(o)
        n_rows = np.arange(1, len(p) + 1)
        counts["dynamic"].append(int(np.sum(n_rows * (width - 1) <= tokens)))
        counts["static"].append(int(np.sum(n_rows * width <= tokens)))
        counts["static_2048"].append(int(tokens // max_len))
        for name, blk in (("generate_batch", cb_page_size), ("paged_full", block_size)):
            counts[name].append(int(np.searchsorted(np.cumsum(-(-(p + o) // blk) * blk), tokens, side="right")))

        # Blocks row r needs at forward k: ceil((p_r + k) / bs) while k <= o_r (its EOS input, forward o_r,
        # is still stored), 0 after it; the largest prefix whose peak fits is then checked with the real
        # PagedCache (fits, one more fails).
        rows = min(len(p), 8 * counts["paged_full"][-1] + 16)
        k = np.arange(int(o[:rows].max()) + 1)
        held = np.where(k[None, :] <= o[:rows, None], -(-(p[:rows, None] + k[None, :]) // block_size), 0)
        peaks = np.cumsum(held, axis=0).max(axis=1)
        n = int(np.sum(peaks <= budget_bytes // (block_size * bpt)))
        if n < rows and fits(p, o, n) and not fits(p, o, n + 1):
            counts["paged"].append(n)
        else:
            raise AssertionError(f"allocator replay disagrees with block arithmetic at {n} requests")
    out = {k: spread(v) | {"all": v} for k, v in counts.items()}
    return out | {"_budget_bytes": budget_bytes, "_bytes_per_token": bpt, "_draws": draws, "_block_size": block_size,
                  "_cb_page_size": cb_page_size}


def with_prompt_len(events: list, prompt_len: int) -> list:
    """The same beam_idx sequence behind a prompt of another length (beam choices do not change what
    the cache stores per step; only the shared prompt's size changes)."""
    first = next(i for i, ev in enumerate(events) if ev[0] == "plan")
    return events[:first] + [["plan", events[first][1], prompt_len]] + events[first + 1:]


def _beam_row(config, events, block_size, nb, plen, new, source: str, real_blocks=None) -> dict:
    r = replay_events(config, events, block_size)
    d = replay_events(config, diverged_events(nb, plen, new), block_size)
    # Allocated pool bytes (what the growable pool's tensors take, its peak since it only grows), as the
    # memory tests measure; blocks in use at the peak are kept beside it.
    peak, dpeak = r["stats"]["peak_kv_bytes_reserved"], d["stats"]["peak_kv_bytes_reserved"]
    alloc, dalloc = r["stats"]["kv_bytes_allocated"], d["stats"]["kv_bytes_allocated"]
    return {"num_beams": nb, "prompt_len": plen, "max_new_tokens": new, "source": source,
            "paged_peak_bytes": peak, "paged_allocated_bytes": alloc, "dynamic_bytes": r["dynamic_bytes"],
            "paged_over_dynamic": alloc / r["dynamic_bytes"],
            "diverged_peak_bytes": dpeak, "diverged_allocated_bytes": dalloc,
            "diverged_over_dynamic": dalloc / d["dynamic_bytes"],
            "matches_real_run": None if real_blocks is None else real_blocks == r["stats"]["peak_blocks_used"],
            "forwards": sum(ev[0] == "plan" for ev in events), "reorders": sum(ev[0] == "reorder" for ev in events)}


def beams(config, block_size: int = 16, path: Path = BEAM_DATA, prompt_lens=(200, 400, 600)) -> dict:
    """Beam 4/8 at realistic lengths: recorded SmolLM2 beam_idx sequences (as recorded, and behind
    prompts of 200/400/600 tokens), and the fully diverged bound for each."""
    if not path.exists():
        return {"error": f"{path.name} missing: run python -m bench record-beams"}
    data = json.loads(path.read_text())
    runs = []
    for rec in data["runs"]:
        nb, plen, new = rec["num_beams"], rec["prompt_len"], rec["max_new_tokens"]
        runs.append(_beam_row(config, rec["events"], block_size, nb, plen, new, "recorded",
                              rec.get("real_peak_blocks_used")))
        for other in prompt_lens:
            if other != plen:
                runs.append(_beam_row(config, with_prompt_len(rec["events"], other), block_size, nb, other, new,
                                      f"recorded at prompt {plen}, replayed at {other}"))
    summary = {}
    for nb in sorted({r["num_beams"] for r in runs}):
        sel = [r for r in runs if r["num_beams"] == nb]
        summary[f"beam{nb}"] = {k: spread([r[k] for r in sel]) for k in ("paged_over_dynamic", "diverged_over_dynamic")}
        summary[f"beam{nb}"]["runs"] = len(sel)
    return {"source": data.get("source", ""), "runs": runs, "summary": summary}


def measure(budget_mib: int = 256, block_size: int = 16, seeds: int = 10, draws: int = 10, cb_page_size: int = 32,
            batch: int = 16) -> dict:
    """The whole section (what ``python -m bench quick --only replay`` stores under ``replay``)."""
    config = smollm2_config()
    start = time.perf_counter()
    out = {"model_shape": "SmolLM2-135M (30 layers, 3 KV heads, head_dim 64, fp32; LlamaConfig, no weights)",
           "bytes_per_token": kv_bytes_per_token(config, torch.float32), "block_size": block_size}
    out["sharegpt"] = sharegpt_batches(config, batch, seeds, block_size, cb_page_size)
    out["concurrency"] = concurrency(config, budget_mib * 2**20, draws, block_size)
    out["beams"] = beams(config, block_size)
    out["seconds"] = time.perf_counter() - start
    return out


# ------------------------------------------------------------------ recording beam indices
def record_events(cache) -> list:
    """Wrap ``cache.plan_step`` / ``cache.reorder_cache`` so every call generate makes is logged as
    ["plan", rows, q_len] / ["reorder", beam_idx]; returns the (growing) event list."""
    events: list = []
    plan, reorder = cache.plan_step, cache.reorder_cache

    def rec_plan(mask, input_ids, batch, q_len, *a, **k):
        events.append(["plan", batch, q_len])
        return plan(mask, input_ids, batch, q_len, *a, **k)

    def rec_reorder(beam_idx):
        events.append(["reorder", beam_idx.tolist()])
        return reorder(beam_idx)
    cache.plan_step, cache.reorder_cache = rec_plan, rec_reorder
    return events


def record_beams(path: Path = BEAM_DATA, configs=((4, 200, 64), (8, 200, 64), (4, 600, 128), (8, 600, 128)),
                 threads: int | None = None) -> None:
    """Run real SmolLM2-135M-Instruct beam searches through hf_paged (English prompts cut from this
    repository's README files) and store every plan/reorder call and the real peak stats."""
    import warnings  # noqa: PLC0415

    import hf_paged  # noqa: PLC0415
    from hf_paged.integrations.smollm2 import load_smollm2  # noqa: PLC0415

    if threads:
        torch.set_num_threads(threads)
    model, tok = load_smollm2()
    root = Path(__file__).resolve().parent.parent
    text = (root / "README.md").read_text() + "\n" + (root / "bench" / "README.md").read_text()
    all_ids = tok(text)["input_ids"]
    runs = json.loads(path.read_text())["runs"] if path.exists() else []
    done = {(r["num_beams"], r["prompt_len"], r["max_new_tokens"]) for r in runs}
    for i, (nb, plen, new) in enumerate(configs):
        if (nb, plen, new) in done:
            continue
        offset = (i * 331) % max(1, len(all_ids) - plen)
        ids = torch.tensor([all_ids[offset:offset + plen]])
        cache = hf_paged.PagedCache(model.config, block_size=16)
        events = record_events(cache)
        hf_paged.patch(model)
        t0 = time.perf_counter()
        try:
            with torch.inference_mode(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=FutureWarning)
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                               num_beams=nb, max_new_tokens=new, min_new_tokens=new, early_stopping=True,
                               do_sample=False, pad_token_id=2, eos_token_id=2)
        finally:
            hf_paged.unpatch(model)
        s = cache.stats()
        runs.append({"num_beams": nb, "prompt_len": plen, "max_new_tokens": new, "prompt_id": f"README offset {offset}",
                     "events": events, "real_peak_blocks_used": s["peak_blocks_used"],
                     "real_peak_kv_bytes_reserved": s["peak_kv_bytes_reserved"], "seconds": time.perf_counter() - t0})
        print(f"[replay] beam {nb}, prompt {plen}, {new} new: {len(events)} events, "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        path.write_text(json.dumps({"source": "SmolLM2-135M-Instruct beam search through hf_paged, fp32, CPU; "
                                    "prompts: token windows of README.md + bench/README.md; "
                                    "min_new_tokens = max_new_tokens, early_stopping=True",
                                    "runs": runs}) + "\n")


def main(argv=None, prog: str = "python -m bench record-beams") -> None:
    """``python -m bench record-beams``: remake the recorded beam searches (the replay itself runs as the
    ``replay`` section of ``python -m bench quick``)."""
    p = argparse.ArgumentParser(prog=prog, description=record_beams.__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=None, help="BEAMS:PROMPT:NEW triples (default: the four recorded)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    kw = {"configs": [tuple(int(x) for x in c.split(":")) for c in args.configs]} if args.configs else {}
    record_beams(threads=args.threads, **kw)
