"""The engine's compiled CPU ops, ``torch.ops.hf_paged_fused``: one extension built on first use by
``cpp_build.build_extension`` (cached by torch per source, flags and CPU) from

- ``cuda/fused_ops_cpu.cpp``: ``rms_norm``, ``add_rms_norm``, ``rotary_``, ``silu_mul`` (``engine.fused``);
- ``cuda/linear_cpu.cpp``: ``pack_linear`` and ``linear``, the float32 (and, built for AVX-512 BF16, bfloat16)
  linear layers (``engine.prepack``; ``linear_bf16_available``); its float32 micro-kernel per ISA (AVX-512, AVX2,
  NEON, portable) is ``cuda/linear_cpu_micro.h``;
- ``cuda/lean_layer_cpu.cpp``: ``lean_layer``, ``lean_layer_quant`` and ``lean_layer_kivi``, a decoder layer's direct
  form in one call on model-dtype, quantised-row and KIVI pools (``engine.fused_lean``).
"""
from __future__ import annotations

import torch

SOURCES = ("fused_ops_cpu.cpp", "linear_cpu.cpp", "lean_layer_cpu.cpp")
HEADERS = ("linear_cpu_micro.h",)       # part of the build's cache key


def _like_rows(x, *args):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


FAKES = {                   # shape propagation for torch.compile: each op is one opaque node
    "rms_norm": _like_rows,
    "add_rms_norm": lambda x, r, w, eps: (_like_rows(x), _like_rows(x)),
    "rotary_": lambda q, k, c, s, interleaved: None,
    "silu_mul": _like_rows,
    "pack_linear": lambda w: w.new_empty(((w.shape[0] + 31) // 32, w.shape[1], 32) if w.dtype == torch.float32
                                         else ((w.shape[0] + 31) // 32, (w.shape[1] + 1) // 2, 64)),
    "linear": lambda x, packed, bias, n: x.new_empty((x.shape[0], n)),
    "lean_layer": lambda hidden, *args: _like_rows(hidden),
    "lean_layer_quant": lambda hidden, *args: _like_rows(hidden),
    # (out, each pool's rows sealed by the write: [Hkv, sealed blocks, BS, D] of its open rows)
    "lean_layer_kivi": lambda hidden, *args: (_like_rows(hidden), *(
        s[0].new_empty((s[0].shape[0], args[16][2].shape[0], *s[0].shape[2:])) for s in (args[17], args[18]))),
}


def load_fused_ops():
    """``torch.ops.hf_paged_fused``, building the extension if this process has not loaded it. Raises
    RuntimeError with the compiler's complaint when it cannot be built."""
    try:
        torch.ops.hf_paged_fused.linear  # noqa: B018  (raises when not loaded)
        return torch.ops.hf_paged_fused
    except (AttributeError, RuntimeError):
        pass
    from ..backends.cpp_build import build_extension, cflags
    # -ffp-contract=off: a*b + c stays two roundings, as eager PyTorch computes it (the linear kernel's
    # fused multiply-adds are explicit intrinsics / std::fma, which this flag does not touch)
    build_extension("hf_paged_fused_", SOURCES, HEADERS, flags=[*cflags(), "-ffp-contract=off"],
                    what="the fused CPU ops")
    for name, fake in FAKES.items():
        try:
            torch.library.register_fake(f"hf_paged_fused::{name}")(fake)
        except RuntimeError:        # registered already (another thread loading at the same time)
            pass
    return torch.ops.hf_paged_fused
