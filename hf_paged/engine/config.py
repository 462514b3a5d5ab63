"""Engine knobs, named as vLLM names them, and the sizing of the KV pool.

GPU: ``gpu_memory_utilization`` of the device's total memory is the ceiling for weights, the peak
activations of a profiled forward at ``max_num_batched_tokens`` tokens, and the KV pool; the pool
gets what is left (the arithmetic is logged). CPU: ``kv_cache_memory_bytes``, by default the smaller
of 512 MiB, 10% of available memory and what ``max_num_seqs`` full-length sequences need.
``num_blocks`` overrides both (vLLM's ``num_gpu_blocks_override``).
"""
from __future__ import annotations

import logging
import numbers
import os
from dataclasses import dataclass

import torch

from ..blocks import blocks_for_budget
from ..kv_formats import default_block_size, kv_format

log = logging.getLogger("hf_paged.engine")
_CPU_DEFAULT_CAP = 512 * 2**20


@dataclass
class EngineConfig:
    """block_size: tokens per KV block (None: 16, or 32 for kv_cache_dtype="kivi", the size it needs).
    max_num_seqs: sequences running at once. max_num_batched_tokens:
    tokens per forward (decode tokens + prefill chunks). max_model_len: longest prompt + output (default
    the model's ``max_position_embeddings``). enable_prefix_caching: reuse full blocks across requests.
    kv_cache_dtype: how blocks store K/V ("auto" = the model's dtype; "fp8", "fp8_e4m3", "fp8_e5m2", "int8",
    "int4", "nvfp4", "kivi" quantise them, see hf_paged.kv_formats): a quantised pool holds ~2x (8-bit),
    ~2.7x (int4) or ~3.4x (nvfp4) the tokens in the same memory. enforce_eager: run the model's forward as
    it is; by default the engine prepacks the linear weights of a CPU model for oneDNN
    (``hf_paged.engine.prepack``) and, on one CUDA device, replays decode steps as CUDA graphs per
    batch-size bucket (``hf_paged.engine.graphs``). fused_ops: on the CPU, run RMSNorm (with the residual
    add), rotary embedding and SiLU·mul as fused C++ ops inside the engine's steps (``hf_paged.engine.fused``;
    False, or enforce_eager, keeps the model's own module forwards). max_logprobs: the
    most top tokens a request may ask per log-probability entry (``logprobs``, ``prompt_logprobs``), as vLLM's."""
    block_size: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    fused_ops: bool = True
    max_logprobs: int = 20

    def validate(self) -> None:
        """Every knob's type and range (a ValueError naming the knob and the value; bools are not ints)."""
        fmt = kv_format(self.kv_cache_dtype)          # raises with the known values
        if self.block_size is None:
            self.block_size = default_block_size(self.kv_cache_dtype)
        for name in ("enforce_eager", "fused_ops", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        _check_int(self, "max_logprobs", least=0)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            _check_int(self, name)
        if self.block_size > 1024:                    # PagedCache's bound too
            raise ValueError(f"block_size must be an int in 1..1024, got {self.block_size!r}")
        if hasattr(fmt, "check_block_size"):          # kivi: its fixed block
            fmt.check_block_size(self.block_size)
        for name in ("max_model_len", "kv_cache_memory_bytes", "num_blocks"):
            _check_int(self, name, optional=True)
        value = self.gpu_memory_utilization
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1] (a number), got {value!r}")


def _check_int(config: EngineConfig, name: str, least: int = 1, optional: bool = False) -> None:
    value = getattr(config, name)
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{name} must be an int >= {least}{' or None' if optional else ''}, got {value!r}")


def available_bytes() -> int:
    """Memory the OS says is available (MemAvailable), in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def kv_pool_blocks(config: EngineConfig, bytes_per_token: int, max_model_len: int, device: torch.device,
                   profile=None) -> int:
    """Number of KV blocks for the pool. ``profile()`` runs the largest forward (GPU sizing only)."""
    if config.num_blocks is not None:
        blocks, how = config.num_blocks, "num_blocks"
    else:
        source = ""
        if device.type == "cuda" and config.kv_cache_memory_bytes is None:
            budget = _gpu_kv_budget(config, device, profile)
            how, knob = f"gpu_memory_utilization={config.gpu_memory_utilization}", "gpu_memory_utilization budget"
        elif config.kv_cache_memory_bytes is not None:
            budget, how = config.kv_cache_memory_bytes, "kv_cache_memory_bytes"
            knob = how
        else:
            need = config.max_num_seqs * (max_model_len + config.block_size) * bytes_per_token
            budget = min(_CPU_DEFAULT_CAP, available_bytes() // 10, need)
            how = "CPU default: min(512 MiB, 10% of available memory, max_num_seqs full-length sequences)"
            knob = "kv_cache_memory_bytes"
            source = "unset: the CPU default, the smallest of 512 MiB, 10% of the available memory and what " \
                     "max_num_seqs full-length sequences need"
        blocks = blocks_for_budget(budget, bytes_per_token, config.block_size, knob, source)
    log.info("KV pool: %d blocks x %d tokens x %d B/token = %.1f MiB (%s)", blocks, config.block_size,
             bytes_per_token, blocks * bytes_per_token * config.block_size / 2**20, how)
    return blocks


def _gpu_kv_budget(config: EngineConfig, device: torch.device, profile) -> int:
    """vLLM's arithmetic: total * utilisation - (memory in use after weights + peak extra of a profiled forward)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    if profile is not None:
        profile()
        torch.cuda.synchronize(device)
    peak_extra = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free                       # weights, CUDA context, other processes
    budget = int(total * config.gpu_memory_utilization) - in_use - peak_extra
    log.info("GPU KV budget: total %.2f GiB x %.2f = %.2f GiB - in use %.2f GiB (weights, context, others) "
             "- profiled forward peak %.2f GiB (%d tokens) = %.2f GiB", total / 2**30,
             config.gpu_memory_utilization, total * config.gpu_memory_utilization / 2**30, in_use / 2**30,
             peak_extra / 2**30, config.max_num_batched_tokens, budget / 2**30)
    if budget <= 0:
        raise ValueError(f"no GPU memory left for the KV pool: {budget / 2**30:.2f} GiB after weights and the "
                         f"profiled forward. Raise gpu_memory_utilization (now {config.gpu_memory_utilization}) "
                         "or lower max_num_batched_tokens.")
    return budget
