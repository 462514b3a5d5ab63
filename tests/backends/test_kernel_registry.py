"""The kernel table and the CUDA backend's behaviour without a GPU."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

import harness
from hf_paged.backends import kernel_registry as reg
from hf_paged.backends.cuda_backend import CudaBackend
from hf_paged.backends.cupy_launcher import CupyLauncher


def test_shim_libraries_export_exactly_the_registry(shim_libraries):
    """Each library built (every model-dtype module, cache ops, one quantised module here; the NVRTC
    gate checks every module) exports exactly its module's registry kernels."""
    quantised = harness.quantised_units(head_dims=(64,), formats=("int4",))[0]
    shim_libraries[quantised]                        # noqa: B018  (built on first lookup)
    assert set(harness.module_units()) | {quantised} <= set(shim_libraries)
    for module, path in shim_libraries.items():
        symbols = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True,
                                 check=True).stdout.split()
        exported = {s[:-len("__launch")] for s in symbols if s.endswith("__launch")}
        assert exported == reg.module_kernel_names(module), module
    assert {s.name for s in reg.all_kernels()} == set().union(*map(reg.module_kernel_names, reg.attention_modules()),
                                                              reg.module_kernel_names((reg.CACHE_SOURCE, 0, "")))


def test_smem_mirror_matches_kernel_layout(shim_libraries):
    """A CTA given exactly attention_smem_bytes runs clean (the shim's guard zones catch overruns)."""
    backend = harness.shim_backend(shim_libraries)
    for d in reg.HEAD_DIMS:
        k = torch.randn(1, 4, 16, d).half()
        out = backend.decode_attention(torch.randn(1, reg.MAX_GROUP, d).half(), k, k,
                                       torch.arange(4, dtype=torch.int32).view(1, 4), torch.tensor([50]), 0.1)
        assert torch.isfinite(out.float()).all()


def test_import_does_not_import_cupy():
    code = "import sys, hf_paged, hf_paged.backends.cuda_backend, hf_paged.backends; print('cupy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed here")
def test_missing_cupy_names_the_install_command():
    backend = CudaBackend(CupyLauncher())
    backend.launcher.sm_count = lambda device: 132
    with pytest.raises(ImportError, match=r'pip install "hf-paged\[cuda(13)?\]"'):
        backend.launcher.launch(reg.COPY_BLOCKS, torch.device("cuda", 0), (1, 1, 1), (128, 1, 1), (), 0)


def test_refusals_list_supported_values():
    with pytest.raises(ValueError, match=r"supported: \(64, 80, 96, 128, 256\)"):
        reg.check_attention_shape(torch.float16, 72, 16, 8, 2)
    with pytest.raises(ValueError, match=r"supported: \(8, 16, 32\)"):
        reg.check_attention_shape(torch.float16, 64, 64, 8, 2)
    with pytest.raises(ValueError, match="float16"):
        reg.check_attention_shape(torch.float64, 64, 16, 8, 2)


def test_kernel_source_inlines_headers():
    text = reg.kernel_source(reg.ATTENTION_SOURCE)
    assert '#include "' not in text and "warp_max" in text
