"""Noticing that a model's weights changed between calls, so that what was computed from the old ones
(prefix-cached K/V, the engine's prepacked copies of the linears) is not used with the new ones.

Two readings, both cheap enough for every request:

* ``introspect.weights_key``: which tensors the parameters are, their storage and their version counters.
  It sees ``load_state_dict``, dtype or device conversions and ordinary in-place ops (``p.copy_`` under
  ``no_grad``, the optimizers' for-loop and foreach steps).
* a strided sample of every parameter's values (``SAMPLES`` elements spread over the tensor), compared bit
  for bit. It sees the writes that bump no version counter: fused optimizer steps
  (``torch.optim.AdamW(fused=True)``), updates through ``p.data`` (EMA, PEFT's ``merge``).

A write that bumps no counter and touches none of the sampled elements (a few rows of an embedding) is
not seen: tell the owner instead (``LLM.weights_changed()``, ``hf_paged.weights_changed(model)``).
"""
from __future__ import annotations

import torch

from .introspect import weights_key

SAMPLES = 64        # elements read from each parameter at each check


class WeightsWatch:
    """Whether ``model``'s weights changed since the last :meth:`settle` (made at construction). It keeps
    the sampled values, not views of the parameters: a view would keep replaced weights alive."""

    def __init__(self, model):
        self.model = model
        self.settle()

    def settle(self) -> None:
        """Take the weights as they are now as the ones to compare with."""
        self._key, self._sample = weights_key(self.model), sample(self.model)

    def changed(self, values: bool = True) -> bool:
        """Whether the weights changed; ``values=False`` reads only ``weights_key`` (well under a millisecond
        for a few hundred parameters), not the sampled values (about twice that)."""
        if weights_key(self.model) != self._key:
            return True
        return values and any(not torch.equal(now, before) for now, before in zip(sample(self.model), self._sample))


def sample(model) -> list[torch.Tensor]:
    """Up to ``SAMPLES`` elements spread over each plain parameter, as bits (a NaN equals itself): one uint8
    tensor per (device, dtype) group, in parameter order. Tensor subclasses (quantised weights) and meta
    tensors are left to ``weights_key``. Read under inference mode: views without autograd's bookkeeping,
    which would double the time (SmolLM2's 272 parameters: ~2 ms)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    with torch.inference_mode():
        for p in model.parameters():
            if type(p) not in (torch.nn.Parameter, torch.Tensor) or p.device.type == "meta" or p.numel() == 0:
                continue
            if p.is_contiguous():
                n = p.numel()
                picked = p.as_strided((min(SAMPLES, n),), (max(1, n // SAMPLES),))
            else:           # a transposed or sliced parameter: the first element of rows spread over dim 0
                picked = p[::max(1, p.shape[0] // SAMPLES)]
                while picked.dim() > 1:
                    picked = picked.select(-1, 0)
            groups.setdefault((p.device, p.dtype), []).append(picked)
        return [torch.cat(views).view(torch.uint8) for views in groups.values()]
