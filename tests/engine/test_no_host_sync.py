"""No host synchronisation inside an engine decode forward (what a CUDA graph capture needs): for every
supported family, on the CPU kernel and the PyTorch path, eager and bucketed (static-buffer) decode steps
run under modes that raise on ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool(tensor)`` and
ops whose output shape depends on data. The modes are on only around the model's forward (after the plan)."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tiny_models import FAMILIES, make_model
from hf_paged.engine import Engine
from hf_paged.engine.graphs import eager_replay

A = torch.ops.aten
# Ops that read a tensor's data on the host or size their output from it.
SYNCING_OPS = {A._local_scalar_dense.default, A.nonzero.default, A.masked_select.default, A._unique2.default,
               A.unique_consecutive.default, A.unique_dim.default, A.repeat_interleave.Tensor,
               A.repeat_interleave.self_Tensor, A.masked_scatter.default}
SYNCING_METHODS = {"item", "tolist", "cpu", "numpy", "__bool__", "nonzero", "masked_select", "unique"}


class HostSync(RuntimeError):
    pass


class NoSyncDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        bool_index = func is A.index.Tensor and any(i is not None and i.dtype in (torch.bool, torch.uint8)
                                                     for i in args[1])
        if func in SYNCING_OPS or bool_index:
            raise HostSync(f"{func} in the decode forward (host sync or data-dependent shape)")
        return func(*args, **(kwargs or {}))


class NoSyncFunctions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in SYNCING_METHODS:
            raise HostSync(f"Tensor.{func.__name__} in the decode forward (host sync)")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_sync():
    with NoSyncFunctions(), NoSyncDispatch():
        yield


@pytest.mark.parametrize("call", [lambda x: x.sum().item(), lambda x: x.tolist(), lambda x: bool(x.any()),
                                  lambda x: x.cpu(), lambda x: x.numpy(), lambda x: x[x > 0],
                                  lambda x: x.nonzero(), lambda x: x.repeat_interleave(x.long().clamp(0, 2))])
def test_the_modes_catch_each_kind_of_sync(call):
    x = torch.tensor([1.0, -1.0, 2.0])
    with pytest.raises(HostSync):
        with no_host_sync():
            call(x)


def watched(engine: Engine) -> list[int]:
    """Put the engine's forwards of decode-only steps under ``no_host_sync``; returns the list that
    counts them (their token counts)."""
    model, seen = engine.runner.model, []

    def forward(**kwargs):
        plan = engine.cache.step.plan
        if not plan.is_decode:
            return model(**kwargs)
        seen.append(plan.num_tokens)
        with no_host_sync():
            return model(**kwargs)
    engine.runner.model = forward
    return seen


@pytest.mark.parametrize("kernel", ["1", "0"], ids=["cpu_kernel", "torch"])
@pytest.mark.parametrize("bucketed", [False, True], ids=["eager", "bucketed"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decode_forward_has_no_host_sync(family, bucketed, kernel, monkeypatch):
    monkeypatch.setenv("HF_PAGED_CPU_KERNEL", kernel)

    class GraphEngine(Engine):
        def _graph_capture(self, device, geometry):
            return eager_replay if bucketed else None
    engine = GraphEngine(make_model(family), block_size=4, num_blocks=64, max_num_seqs=4)
    seen = watched(engine)
    for prompt in ([5, 6, 7], [8, 9], [10, 11, 12, 13, 14]):
        engine.add_request(prompt, max_new_tokens=5, do_sample=False, ignore_eos=True)
    engine.run()
    assert len(seen) >= 4, seen        # decode forwards ran (and raised nothing)
    if bucketed:
        assert set(seen) <= {1, 2, 4} and engine.runner.graphs.replayed_steps > 0
