"""The GPU launcher of the CUDA backend: NVRTC builds through CuPy ``RawModule``, launches on torch's stream.

cupy is imported on the first launch (``cupy_loader.import_cupy`` names the package to install when it is
missing), never at ``import hf_paged``. Compiled modules are kept per device here and on disk by CuPy's
cache (keyed by the source text, which ``kernel_registry.kernel_source`` inlines headers into).
"""
from __future__ import annotations

import torch

from . import kernel_registry as reg
from .cupy_loader import cuda_include_dirs, cupy_cuda_major, import_cupy
from .launch_checks import DeviceLimits

DEFAULT_SMEM_LIMIT = 48 * 1024     # dynamic shared memory a kernel may use without opting in


class CupyLauncher:
    """Builds each kernel module with NVRTC (through CuPy) on first use per device, and launches on
    torch's current stream. Compiled modules are kept per device here and on disk by CuPy's cache."""

    def __init__(self):
        self._functions: dict[tuple[int, str], object] = {}
        self._modules: dict[tuple[int, tuple], object] = {}
        self._limits: dict[int, DeviceLimits] = {}
        self._cupy = None

    def sm_count(self, device: torch.device) -> int:
        return self.device_limits(device).sm_count

    def device_limits(self, device: torch.device) -> DeviceLimits:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._limits:
            self._limits[index] = DeviceLimits.for_device(index)
        return self._limits[index]

    def prepare(self, spec: reg.KernelSpec, device: torch.device):
        """The compiled kernel function (building its module on first use on this device)."""
        cupy = self._import_cupy()
        index = device.index if device.index is not None else torch.cuda.current_device()
        function = self._functions.get((index, spec.name))
        if function is None:
            with cupy.cuda.Device(index):
                function = self._module(cupy, index, spec).get_function(spec.name)
            self._functions[(index, spec.name)] = function
        return function

    def launch(self, spec: reg.KernelSpec, device: torch.device, grid, block, args, shared_mem: int) -> None:
        function = self.prepare(spec, device)
        cupy = self._cupy
        index = device.index if device.index is not None else torch.cuda.current_device()
        with cupy.cuda.Device(index):
            if shared_mem > DEFAULT_SMEM_LIMIT and function.max_dynamic_shared_size_bytes < shared_mem:
                function.max_dynamic_shared_size_bytes = shared_mem
            stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(index).cuda_stream)
            function(tuple(grid), tuple(block), args, shared_mem=shared_mem, stream=stream)

    def _module(self, cupy, index: int, spec: reg.KernelSpec):
        key = (index, spec.module)
        if key not in self._modules:
            includes = cuda_include_dirs(cupy_cuda_major(cupy))
            options = (*spec.defines, *(f"-I{d}" for d in includes))  # NVRTC 12+: C++17 by default
            module = cupy.RawModule(code=reg.kernel_source(spec.source), options=options, backend="nvrtc")
            module.compile()
            self._modules[key] = module
        return self._modules[key]

    def _import_cupy(self):
        if self._cupy is None:
            self._cupy = import_cupy()
        return self._cupy
