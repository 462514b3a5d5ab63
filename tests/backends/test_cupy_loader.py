"""cupy_loader names the right package when CuPy is missing or mismatched. No GPU, no CuPy: the installed
distributions (importlib.metadata), the driver version and the ``cupy`` module are simulated."""
from __future__ import annotations

import importlib.metadata
import sys
import types

import pytest

from hf_paged.backends import cupy_loader


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """Simulate a machine: ``machine(dists={...}, driver=12040, cupy=None|module)``; no CUDA headers
    unless ``headers`` is a CUDA version (then a fake $CUDA_PATH holds cuda_fp16.h of that version)."""

    def setup(dists=None, driver=None, cupy=None, headers=None):
        dists = dict(dists or {})

        def version(name):
            if name in dists:
                return dists[name]
            raise importlib.metadata.PackageNotFoundError(name)

        monkeypatch.setattr(importlib.metadata, "version", version)
        monkeypatch.setattr(cupy_loader, "driver_version", lambda: driver)
        monkeypatch.setitem(sys.modules, "cupy", cupy)      # None: `import cupy` raises ImportError
        monkeypatch.setitem(sys.modules, "nvidia", None)    # no pip header wheels
        monkeypatch.setattr(cupy_loader.Path, "is_file", _only_under(tmp_path))
        if headers is not None:
            include = tmp_path / "cuda" / "include"
            include.mkdir(parents=True)
            (include / "cuda_fp16.h").write_text("")
            (include / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION {headers}\n")
            monkeypatch.setenv("CUDA_PATH", str(tmp_path / "cuda"))
        else:
            monkeypatch.delenv("CUDA_PATH", raising=False)

    return setup


def _only_under(root):
    """Path.is_file that sees only files under ``root`` (hides a real /usr/local/cuda)."""
    real = cupy_loader.Path.is_file

    def is_file(self):
        return str(self).startswith(str(root)) and real(self)
    return is_file


def fake_cupy(runtime_version=12090):
    module = types.ModuleType("cupy")
    module.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(runtimeGetVersion=lambda: runtime_version))
    return module


def test_missing_cupy_on_cuda12_driver_names_the_cuda_extra(machine):
    machine(driver=12040)
    with pytest.raises(ImportError) as err:
        cupy_loader.import_cupy()
    msg = str(err.value)
    assert 'pip install "hf-paged[cuda]"' in msg and "cupy-cuda12x" in msg
    assert "hf-paged[cuda13]" not in msg    # a CUDA 12 driver cannot run cupy-cuda13x
    assert "HF_PAGED_FORCE_TORCH=1" in msg


def test_missing_cupy_on_cuda13_driver_names_both_extras(machine):
    machine(driver=13000)
    with pytest.raises(ImportError, match=r'hf-paged\[cuda13\]') as err:
        cupy_loader.import_cupy()
    assert 'hf-paged[cuda]"' in str(err.value) and "13.0" in str(err.value)


def test_missing_cupy_unknown_driver_names_both_extras(machine):
    machine(driver=None)
    with pytest.raises(ImportError) as err:
        cupy_loader.import_cupy()
    assert 'hf-paged[cuda]"' in str(err.value) and 'hf-paged[cuda13]"' in str(err.value)


def test_two_cupy_packages_are_refused_before_import(machine):
    machine(dists={"cupy-cuda12x": "14.2.0", "cupy-cuda13x": "14.2.0"}, driver=13000, cupy=fake_cupy())
    with pytest.raises(ImportError, match="several CuPy packages") as err:
        cupy_loader.import_cupy()
    assert "pip uninstall -y cupy-cuda12x cupy-cuda13x" in str(err.value)


def test_cupy_cuda13x_on_cuda12_driver_is_refused(machine):
    machine(dists={"cupy-cuda13x": "14.2.0"}, driver=12080, cupy=fake_cupy(13000))
    with pytest.raises(ImportError, match="cupy-cuda13x needs 13.0") as err:
        cupy_loader.import_cupy()
    assert "pip uninstall -y cupy-cuda13x" in str(err.value)
    assert 'pip install "hf-paged[cuda]"' in str(err.value)


def test_cupy_cuda11x_is_refused(machine):
    machine(dists={"cupy-cuda11x": "13.6.0"}, driver=12020, cupy=fake_cupy(11080))
    with pytest.raises(ImportError, match="pip uninstall -y cupy-cuda11x") as err:
        cupy_loader.import_cupy()
    assert 'hf-paged[cuda]"' in str(err.value)


def test_installed_but_broken_import_says_reinstall(machine):
    machine(dists={"cupy-cuda12x": "14.2.0"}, driver=12040, cupy=None)
    with pytest.raises(ImportError, match=r"cupy-cuda12x 14.2.0 is installed but `import cupy` failed"):
        cupy_loader.import_cupy()


@pytest.mark.parametrize("dist, runtime, driver", [("cupy-cuda12x", 12090, 12040), ("cupy-cuda12x", 12090, 13000),
                                                   ("cupy-cuda13x", 13000, 13000)])
def test_either_package_loads(machine, dist, runtime, driver):
    module = fake_cupy(runtime)
    machine(dists={dist: "14.2.0"}, driver=driver, cupy=module, headers=runtime)
    assert cupy_loader.import_cupy() is module


def test_no_headers_names_the_header_wheel_of_cupys_major(machine):
    machine(dists={"cupy-cuda12x": "14.2.0"}, driver=13000, cupy=fake_cupy(12090))
    with pytest.raises(ImportError, match="pip install nvidia-cuda-runtime-cu12"):
        cupy_loader.import_cupy()
    assert cupy_loader.import_cupy(require_headers=False).cuda.runtime.runtimeGetVersion() == 12090


def test_include_dirs_prefer_cupys_major(monkeypatch, tmp_path):
    """$CUDA_PATH first (as before), unless a later folder holds headers of CuPy's CUDA major."""
    dirs = {}
    for name, version in (("toolkit13", 13000), ("wheel12", 12090)):
        include = tmp_path / name / "include"
        include.mkdir(parents=True)
        (include / "cuda_fp16.h").write_text("")
        (include / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION {version}\n")
        dirs[name] = include
    wheel_root = tmp_path / "wheel12" / "nvidia"
    (wheel_root / "cuda_runtime").mkdir(parents=True)
    (wheel_root / "cuda_runtime" / "include").symlink_to(dirs["wheel12"])
    monkeypatch.setitem(sys.modules, "nvidia", types.SimpleNamespace(__path__=[str(wheel_root)]))
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "toolkit13"))
    monkeypatch.setattr(cupy_loader.Path, "is_file", _only_under(tmp_path))
    assert cupy_loader.cuda_include_dirs() == [str(dirs["toolkit13"])]
    assert cupy_loader.cuda_include_dirs(13) == [str(dirs["toolkit13"])]
    assert cupy_loader.cuda_include_dirs(12) == [str(wheel_root / "cuda_runtime" / "include")]

