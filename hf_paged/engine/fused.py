"""Fused per-layer ops for the engine's CPU steps: fewer eager ops per decoder layer.

transformers' modules run RMSNorm as 6-8 small ops, rotary embedding as ~12 (q and k), SiLU·mul as 2 and
the residual adds as more; at the engine's short steps on a CPU that per-op overhead is a fifth of a run.
``cuda/fused_ops_cpu.cpp`` (``torch.ops.hf_paged_fused``, built on first use by
``cpp_build.build_extension``, cached by torch) does each in one pass: ``rms_norm``, ``add_rms_norm``
(the layer's residual add and the next norm), ``rotary_`` (q and k in place; half-split or GLM's
interleaved, partial rotary) and ``silu_mul``.

``FusedOps(model)`` finds the modules of the families' known classes (``_specs``, ``FAMILY_CLASSES``); ``with
fused.installed():`` gives each an instance ``forward`` that uses the ops and removes it on exit, so the
model is untouched outside the block (as ``prepack.PrepackedLinears``). Modules of another class, with
hooks (checked at every install) or whose sub-modules that a fused forward would bypass have hooks, keep
their own forward. A fused forward runs the class's own forward when it cannot apply: grad enabled,
training, not on the CPU, a dtype other than float32 / bfloat16, a norm weight of another dtype. The
results equal the modules' own within float rounding (tests/engine/test_fused_ops.py: engine-step
logits within 1e-5 relative on every family). The attention forwards restate transformers 5.24's
(projections, Qwen3's q/k norms, rotary, ``cache.update``, the attention interface, ``o_proj``).
``EngineConfig(fused_ops=False)`` (or ``enforce_eager=True``) keeps the model's own forwards.
"""
from __future__ import annotations

import logging

import torch

from .cpu_ops import load_fused_ops
from .fused_base import FAMILY_CLASSES, _Fused, _known_norms, _Mlp, _modeling, _Norm, _silu
from .fused_layers import DecoderLayer
from .prepack import SharedForwards

log = logging.getLogger("hf_paged.engine")


def _specs() -> dict[type, tuple[type, dict]]:
    """Known class -> (its fused forward, the spec that forward needs)."""
    from .fused_layers import Attention, DecoderLayer
    specs = {norm: (_Norm, {}) for norm in _known_norms()}
    for f in FAMILY_CLASSES:
        mod = _modeling(f.family)
        if f.module_class("MLP") is not None:            # (Mixtral has none: its MoE blocks keep their forward)
            specs[f.module_class("MLP")] = (_Mlp, {"split": f.split})
        specs[f.module_class("Attention")] = (Attention, {
            "qk_norm": f.qk_norm, "interleaved": f.interleaved, "window": f.window,
            "eager": mod.eager_attention_forward})
        specs[f.module_class("DecoderLayer")] = (DecoderLayer, {"sandwich": f.sandwich})
    return specs


class FusedOps:
    """The fused forwards of a model's known modules (see the module doc)."""

    def __init__(self, model: torch.nn.Module, lean: bool = True):
        self.forwards: list[_Fused] = []
        self.lean = lean                # decoder layers as direct op calls where they may (fused_lean)
        self.direct = True              # ... in their direct form where the step allows (LeanLayer._direct)
        self.one_call = True            # ... that form as one C++ call per layer where it may (lean_layer)
        self._forwards = SharedForwards()
        try:
            ops = load_fused_ops()
        except RuntimeError as err:
            log.warning("fused CPU ops unavailable, the engine runs the model's own forwards: %s "
                        "(fused_ops=False skips the build)", err)
            return
        specs = _specs()
        for module in model.modules():
            kind, spec = specs.get(type(module), (None, None))
            if kind is _Mlp and not _silu(getattr(module, "activation_fn" if spec["split"] else "act_fn")):
                continue        # another activation: the MLP keeps its forward
            if kind is not None:
                self.forwards.append(kind(module, ops, **spec))
        log.info("fused CPU ops for %d modules (fused_ops=False keeps the model's own forwards)", len(self.forwards))

    def installed(self):
        """The fused forwards for the block (nested and concurrent blocks share one installation). Each
        installation checks hooks anew and gives decoder layers their lean forward where it holds
        (``fused_lean``), so hooks or weights changed between steps are seen at the next step."""
        return self._forwards.installed(self._pick)

    def running(self):
        """The block is an engine step's forward in this thread (``prepack.SharedForwards.running``)."""
        return self._forwards.running()

    def _pick(self) -> list[_Fused]:
        chosen = [f for f in self.forwards if f.installable()]
        specs = {f.module: f.spec for f in self.forwards}
        for forward in chosen:
            if isinstance(forward, DecoderLayer):
                attention = specs.get(getattr(forward.module, "self_attn", None))
                forward.prepare(attention if self.lean else None, self.direct, self.one_call)
        return chosen


