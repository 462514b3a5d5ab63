"""The pieces every fused forward shares (``hf_paged.engine.fused``): when a fused forward may run, the
base class that falls back to the module's own forward, and the norm and MLP forwards. The decoder-layer
and attention forwards are in ``fused_layers``; both import from here, nothing here imports them."""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

import torch

from .prepack import InstalledForward, sibling_outputs

_DTYPES = (torch.float32, torch.bfloat16)


def _has_hooks(module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or getattr(module, "_hf_hook", None) is not None)


def _usable(x: torch.Tensor, module) -> bool:
    """Whether a fused forward may run: inference (no grad), eval, a CPU tensor of a dtype the ops know."""
    return (not torch.is_grad_enabled() and not module.training and x.device.type == "cpu" and x.dtype in _DTYPES)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with a contiguous last dimension (a view when x allows it)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def rotate_qk(ops, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, S, H, D] (fresh tensors, or views of one fresh q/k/v product) rotated in place by ``rotary_``,
    returned as [B, H, S, D] views. rotary_ takes any row strides with contiguous heads (rows of a packed
    product)."""
    query, key = (x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous() for x in (query, key))
    tokens, d = query.shape[0] * query.shape[1], query.shape[-1]
    cos = cos.expand(*query.shape[:2], cos.shape[-1]).reshape(tokens, -1)
    sin = sin.expand(*query.shape[:2], sin.shape[-1]).reshape(tokens, -1)
    ops.rotary_(query.view(tokens, -1, d), key.view(tokens, -1, d), cos.contiguous(), sin.contiguous(), interleaved)
    return query.transpose(1, 2), key.transpose(1, 2)


class _Fused(InstalledForward):
    """An instance forward for ``module``. ``bypassed``: its sub-modules this forward does not call, or whose
    outputs it changes in place; a hook on any of them keeps the module's own forward. Outside the owner's
    forwards (``here()``: another thread's plain forward meanwhile) the module's own forward runs."""
    bypassed: tuple[str, ...] = ()

    def __init__(self, module, ops, **spec):
        self.module, self.ops, self.spec = module, ops, spec
        # the keyword the module's own forward takes the cache by (``cache`` since transformers 5.2x)
        self.cache_kw = "cache" if "cache" in inspect.signature(type(module).forward).parameters else "past_key_values"

    def installable(self) -> bool:
        return not _has_hooks(self.module) and not any(_has_hooks(getattr(self.module, n)) for n in self.bypassed)

    def own(self, *args, **kwargs):
        return type(self.module).forward(self.module, *args, **kwargs)


class _Norm(_Fused):
    def __call__(self, x):
        m = self.module
        if not (self.here() and _usable(x, m) and m.weight.dtype == x.dtype and m.weight.is_contiguous()):
            return self.own(x)
        return self.ops.rms_norm(_rows(x), m.weight, m.variance_epsilon).view(x.shape)


def norm_fusible(norm, x: torch.Tensor) -> bool:
    """Whether ``add_rms_norm`` may stand for the norm module ``norm`` on ``x``."""
    return _is_known_norm(type(norm)) and not _has_hooks(norm) and norm.weight.dtype == x.dtype \
        and norm.weight.is_contiguous()


class _Mlp(_Fused):
    """SiLU(gate) * up in one op; the linears are called as modules (prepacked, hooks kept)."""

    def __init__(self, module, ops, split: bool):
        super().__init__(module, ops)
        self.split = split
        self.bypassed = ("activation_fn",) if split else ("act_fn",)

    def __call__(self, x):
        m = self.module
        if not (self.here() and _usable(x, m)):
            return self.own(x)
        if self.split:              # GLM: gate_up_proj, gate = first half, up = second (chunk(2))
            gate_up = m.gate_up_proj(x)
            half = gate_up.shape[-1] // 2
            rows = _rows(gate_up)
            gate, up = rows[:, :half], rows[:, half:]
        else:
            pair = None if _has_hooks(m.gate_proj) or _has_hooks(m.up_proj) else \
                sibling_outputs((m.gate_proj, m.up_proj), x)                # one packed call for both
            gate, up = (_rows(y) for y in (pair if pair is not None else (m.gate_proj(x), m.up_proj(x))))
            half = gate.shape[-1]
        if gate.dtype not in _DTYPES or gate.dtype != up.dtype:
            return self.own(x)
        return m.down_proj(self.ops.silu_mul(gate, up).view(*x.shape[:-1], half))


def _silu(act) -> bool:
    """Whether ``act`` is a hook-free SiLU (what silu_mul computes)."""
    from transformers.activations import SiLUActivation
    return type(act) in (SiLUActivation, torch.nn.SiLU) and not _has_hooks(act)


@dataclass(frozen=True)
class FamilyClasses:
    """One family's module classes as the fused forwards take them (``transformers.models.<family>``'s
    ``<prefix>RMSNorm``, ``<prefix>MLP`` where it has a dense one, ``<prefix>Attention``,
    ``<prefix>DecoderLayer``). window: the ``sliding_window`` its attention's forward passes ("module": its
    attribute, "config": its config's, None: none); qk_norm: Qwen3's q/k norms; interleaved: GLM's rotary;
    sandwich: GLM-4-0414's two extra norms; split: GLM's gate_up_proj."""
    family: str
    prefix: str
    window: str | None = None
    qk_norm: bool = False
    interleaved: bool = False
    sandwich: bool = False
    split: bool = False

    def module_class(self, suffix: str):
        return getattr(_modeling(self.family), f"{self.prefix}{suffix}", None)


FAMILY_CLASSES = (
    FamilyClasses("llama", "Llama"), FamilyClasses("qwen2", "Qwen2", window="module"),
    FamilyClasses("qwen3", "Qwen3", window="module", qk_norm=True),
    FamilyClasses("glm", "Glm", interleaved=True, split=True),
    FamilyClasses("glm4", "Glm4", interleaved=True, sandwich=True, split=True),
    FamilyClasses("mistral", "Mistral", window="config"), FamilyClasses("mixtral", "Mixtral", window="config"),
    FamilyClasses("qwen2_moe", "Qwen2Moe"), FamilyClasses("qwen3_moe", "Qwen3Moe", window="module", qk_norm=True),
)


def passed_window(attention, how: str | None) -> int | None:
    """The ``sliding_window`` an attention module's own forward passes (``how``: FamilyClasses.window)."""
    if how == "module":
        return attention.sliding_window
    if how == "config":
        return getattr(attention.config, "sliding_window", None)
    return None


# modeling module -> its RMSNorm class's name: norm_fusible's per-call test (no import on the hot path)
_NORM_NAMES = {f"transformers.models.{f.family}.modeling_{f.family}": f"{f.prefix}RMSNorm" for f in FAMILY_CLASSES}


def _is_known_norm(cls: type) -> bool:
    return _NORM_NAMES.get(cls.__module__) == cls.__name__


def _known_norms() -> tuple[type, ...]:
    return tuple(f.module_class("RMSNorm") for f in FAMILY_CLASSES)


def _modeling(family: str):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")
