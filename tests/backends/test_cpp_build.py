"""The C++ extensions' build guards (hf_paged/backends/cpp_build.py): a cached library cut short is built again
(torch loaded it and the process died of SIGBUS), a killed build's lock file does not stop every later load
(torch waits on it forever), the build's name does not depend on what the process built before (torch appends
its link flags to the list it is given), a failed build is not repeated in a process, and the environment
switches take one spelling everywhere."""
from __future__ import annotations

import shutil
import _ssl

import pytest
from torch.utils import cpp_extension

from hf_paged.backends import cpp_build


def test_a_library_cut_short_is_found_and_dropped(tmp_path, monkeypatch):
    whole = tmp_path / "whole.so"
    shutil.copy(_ssl.__file__, whole)
    assert cpp_build._whole_elf(whole)
    data = whole.read_bytes()
    for size in (0, 63, 100, len(data) // 2, len(data) - 1):
        cut = tmp_path / f"cut{size}.so"
        cut.write_bytes(data[:size])
        assert not cpp_build._whole_elf(cut), size
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    (tmp_path / "hf_paged_x.so").write_bytes(data[: len(data) // 3])
    (tmp_path / "hf_paged_y.so").write_bytes(data)
    cpp_build._drop_if_cut_short("hf_paged_x")
    cpp_build._drop_if_cut_short("hf_paged_y")
    assert not (tmp_path / "hf_paged_x.so").exists() and (tmp_path / "hf_paged_y.so").exists()


def test_a_killed_builds_lock_file_is_removed_under_the_build_lock(tmp_path, monkeypatch):
    """torch's loader waits, even for a library already built, while its `lock` file exists; a build killed
    while holding it (SIGKILL, a notebook kernel restarted, a deadline) leaves it, and every later load hung."""
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    seen = []

    def load(name, **kwargs):                    # torch's loader: its lock file must be gone by now
        seen.append((tmp_path / "lock").exists())

    monkeypatch.setattr(cpp_extension, "load", load)
    (tmp_path / "lock").write_text("")           # what a killed build leaves
    assert cpp_build._built.__wrapped__("hf_paged_test_", ("paged_attention_cpu.cpp",), (), ("-O3",), "x") is None
    assert seen == [False] and not (tmp_path / "lock").exists()
    with cpp_build._build_lock("hf_paged_test_"):             # a live build's lock file is its own, kept
        (tmp_path / "lock").write_text("")
    assert (tmp_path / "lock").exists()


def test_the_build_name_does_not_depend_on_earlier_builds(monkeypatch):
    names = []

    def load(name, sources, extra_cflags, extra_ldflags, **kwargs):
        extra_ldflags.extend(["-ltorch", "-lc10"])          # what torch's loader does to the list it is given
        names.append(name)

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(cpp_build, "_drop_if_cut_short", lambda name: None)
    for _ in range(2):
        assert cpp_build._built.__wrapped__("hf_paged_test_", ("paged_attention_cpu.cpp",), (), ("-O3",), "x") is None
    assert names[0] == names[1] and cpp_build.LDFLAGS == ("-fopenmp",)


def test_a_failed_build_is_not_repeated_in_the_process(monkeypatch):
    calls = []

    def load(name, **kwargs):
        calls.append(name)
        raise OSError("no c++")

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(cpp_build, "_drop_if_cut_short", lambda name: None)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="could not build the test op .*no c\\+\\+"):
            cpp_build.build_extension("hf_paged_fails_", ("paged_attention_cpu.cpp",), flags=["-O1"],
                                      what="the test op")
    assert len(calls) == 1


@pytest.mark.parametrize("value, want", [("", True), ("1", True), ("on", True), ("TRUE", True), (" yes ", True),
                                         ("0", False), ("off", False), ("No", False), ("false", False)])
def test_switches_take_one_spelling(monkeypatch, value, want):
    monkeypatch.setenv(cpp_build.KERNEL_ENV, value)
    assert cpp_build.kernel_enabled() is want


def test_a_misspelt_switch_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(cpp_build.KERNEL_ENV, "junk")
    with pytest.raises(ValueError, match="HF_PAGED_CPU_KERNEL='junk': use 1 .* or 0"):
        cpp_build.kernel_enabled()
