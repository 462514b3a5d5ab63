"""Fused per-layer ops for the engine's CPU steps: fewer eager ops per decoder layer.

transformers' modules run RMSNorm as 6-8 small ops, rotary embedding as ~12 (q and k), SiLU·mul as 2 and
the residual adds as more; at the engine's short steps on a CPU that per-op overhead is a fifth of a run.
``cuda/fused_ops_cpu.cpp`` (``torch.ops.hf_paged_fused``, built on first use by
``cpu_backend.build_extension``, cached by torch) does each in one pass: ``rms_norm``, ``add_rms_norm``
(the layer's residual add and the next norm), ``rotary_`` (q and k in place; half-split or GLM's
interleaved, partial rotary) and ``silu_mul``.

``FusedOps(model)`` finds the modules of the five families' known classes (``_specs``); ``with
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

import contextlib
import importlib
import logging
import threading

import torch

log = logging.getLogger("hf_paged.engine")
SOURCES = ("fused_ops_cpu.cpp",)
_DTYPES = (torch.float32, torch.bfloat16)


def load_fused_ops():
    """``torch.ops.hf_paged_fused``, building the extension if this process has not loaded it. Raises
    RuntimeError with the compiler's complaint when it cannot be built."""
    try:
        torch.ops.hf_paged_fused.silu_mul  # noqa: B018  (raises when not loaded)
        return torch.ops.hf_paged_fused
    except (AttributeError, RuntimeError):
        pass
    from ..backends.cpu_backend import CFLAGS, build_extension
    # -ffp-contract=off: a*b + c stays two roundings, as eager PyTorch computes it
    build_extension("hf_paged_fused_", SOURCES, cflags=[*CFLAGS, "-ffp-contract=off"], what="the fused CPU ops")
    for name, fake in (("rms_norm", lambda x, w, eps: torch.empty_like(x, memory_format=torch.contiguous_format)),
                       ("add_rms_norm", lambda x, r, w, eps: (torch.empty_like(x, memory_format=torch.contiguous_format),
                                                              torch.empty_like(x, memory_format=torch.contiguous_format))),
                       ("rotary_", lambda q, k, c, s, interleaved: None),
                       ("silu_mul", lambda g, u: torch.empty_like(g, memory_format=torch.contiguous_format))):
        try:
            torch.library.register_fake(f"hf_paged_fused::{name}")(fake)
        except RuntimeError:        # registered already (another thread loading at the same time)
            pass
    return torch.ops.hf_paged_fused


def _has_hooks(module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or getattr(module, "_hf_hook", None) is not None)


def _usable(x: torch.Tensor, module) -> bool:
    """Whether a fused forward may run: inference (no grad), eval, a CPU tensor of a dtype the ops know."""
    return (not torch.is_grad_enabled() and not module.training and x.device.type == "cpu" and x.dtype in _DTYPES)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with a contiguous last dimension (a view when x allows it)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


class _Fused:
    """An instance forward for ``module``. ``bypassed``: its sub-modules this forward does not call, or whose
    outputs it changes in place; a hook on any of them keeps the module's own forward."""
    bypassed: tuple[str, ...] = ()

    def __init__(self, module, ops, **spec):
        self.module, self.ops, self.spec = module, ops, spec

    def installable(self) -> bool:
        return not _has_hooks(self.module) and not any(_has_hooks(getattr(self.module, n)) for n in self.bypassed)

    def own(self, *args, **kwargs):
        return type(self.module).forward(self.module, *args, **kwargs)


class _Norm(_Fused):
    def __call__(self, x):
        m = self.module
        if not (_usable(x, m) and m.weight.dtype == x.dtype and m.weight.is_contiguous()):
            return self.own(x)
        return self.ops.rms_norm(_rows(x), m.weight, m.variance_epsilon).view(x.shape)


def norm_fusible(norm, x: torch.Tensor) -> bool:
    """Whether ``add_rms_norm`` may stand for the norm module ``norm`` on ``x``."""
    return type(norm) in _known_norms() and not _has_hooks(norm) and norm.weight.dtype == x.dtype \
        and norm.weight.is_contiguous()


class _Mlp(_Fused):
    """SiLU(gate) * up in one op; the linears are called as modules (prepacked, hooks kept)."""

    def __init__(self, module, ops, split: bool):
        super().__init__(module, ops)
        self.split = split
        self.bypassed = ("activation_fn",) if split else ("act_fn",)

    def __call__(self, x):
        m = self.module
        if not _usable(x, m):
            return self.own(x)
        if self.split:              # GLM: gate_up_proj, gate = first half, up = second (chunk(2))
            gate_up = m.gate_up_proj(x)
            half = gate_up.shape[-1] // 2
            rows = _rows(gate_up)
            gate, up = rows[:, :half], rows[:, half:]
        else:
            gate, up = _rows(m.gate_proj(x)), _rows(m.up_proj(x))
            half = gate.shape[-1]
        if gate.dtype not in _DTYPES or gate.dtype != up.dtype:
            return self.own(x)
        return m.down_proj(self.ops.silu_mul(gate, up).view(*x.shape[:-1], half))


def _known_norms() -> tuple[type, ...]:
    return tuple(getattr(_modeling(f), cls) for f, cls in (("llama", "LlamaRMSNorm"), ("qwen2", "Qwen2RMSNorm"),
                                                          ("qwen3", "Qwen3RMSNorm"), ("glm", "GlmRMSNorm"),
                                                          ("glm4", "Glm4RMSNorm")))


def _modeling(family: str):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def _specs() -> dict[type, tuple[type, dict]]:
    """Known class -> (its fused forward, the spec that forward needs)."""
    from .fused_layers import Attention, DecoderLayer
    specs = {norm: (_Norm, {}) for norm in _known_norms()}
    for family, prefix in (("llama", "Llama"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3"), ("glm", "Glm"), ("glm4", "Glm4")):
        mod = _modeling(family)
        glm = family.startswith("glm")
        specs[getattr(mod, f"{prefix}MLP")] = (_Mlp, {"split": glm})
        specs[getattr(mod, f"{prefix}Attention")] = (Attention, {
            "qk_norm": family == "qwen3", "interleaved": glm, "window": family in ("qwen2", "qwen3"),
            "eager": mod.eager_attention_forward})
        specs[getattr(mod, f"{prefix}DecoderLayer")] = (DecoderLayer, {"sandwich": family == "glm4"})
    return specs


def _silu(act) -> bool:
    from transformers.activations import SiLUActivation
    return type(act) in (SiLUActivation, torch.nn.SiLU) and not _has_hooks(act)


class FusedOps:
    """The fused forwards of a model's known modules (see the module doc)."""

    def __init__(self, model: torch.nn.Module):
        self.forwards: list[_Fused] = []
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
        self._lock = threading.Lock()
        self._users = 0
        self._installed: list[_Fused] = []
        log.info("fused CPU ops for %d modules (fused_ops=False keeps the model's own forwards)", len(self.forwards))

    @contextlib.contextmanager
    def installed(self):
        """The fused forwards for the block (nested and concurrent blocks share one installation)."""
        with self._lock:
            if self._users == 0:
                self._installed = [f for f in self.forwards if f.installable()]
                for fused in self._installed:
                    fused.module.forward = fused
            self._users += 1
        try:
            yield self
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    for fused in self._installed:
                        if fused.module.__dict__.get("forward") is fused:
                            del fused.module.forward
                    self._installed = []


