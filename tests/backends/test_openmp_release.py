"""An engine stepping in a second thread is not throttled by the OpenMP team of the thread that loaded the model.

libgomp spins only 1,000 rounds at its barriers once it manages more threads than there are CPUs, so two
teams of torch's full thread count (the loading thread's, idle, and the stepping thread's) turn every parallel
region into futex sleeps: voluntary context switches, one or more per region. ``release_openmp_workers`` frees
the calling thread's team; the server's ``EngineWorker.start`` calls it before its engine thread starts.
"""
from __future__ import annotations

import os
import resource
import threading

import pytest
import torch

from hf_paged.backends.openmp import release_openmp_workers
from hf_paged.integrations.server import worker as server_worker

REGIONS = 300


def voluntary_switches() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw


def switches_in_a_second_thread(x: torch.Tensor) -> int:
    """Voluntary context switches of this process while another thread runs REGIONS parallel regions."""
    def work():
        for _ in range(REGIONS):
            x.exp()                     # one at::parallel_for region (4 Mi elements: well above its grain)
    thread = threading.Thread(target=work)
    before = voluntary_switches()
    thread.start()
    thread.join()
    return voluntary_switches() - before


@pytest.fixture
def every_core_threads():
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        pytest.skip("one CPU: torch runs no parallel regions, there is no team to throttle")
    before = torch.get_num_threads()
    torch.set_num_threads(cpus)          # two teams of this size exceed the CPUs: libgomp throttles its spinning
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_releasing_the_loading_threads_team_stops_the_futex_sleeps(every_core_threads):
    x = torch.randn(1 << 22)
    x.exp()                                                  # this thread's team exists, as after loading a model
    throttled = switches_in_a_second_thread(x)
    if not release_openmp_workers():
        pytest.skip("torch's OpenMP runtime here is not GNU libgomp (nothing to release)")
    released = switches_in_a_second_thread(x)
    assert throttled >= REGIONS // 2, f"the throttled case did not show: {throttled} switches"
    assert released * 10 < throttled, f"{released} switches after the release against {throttled} before"


def test_the_server_worker_releases_the_team_before_its_thread_starts(monkeypatch):
    seen = []
    monkeypatch.setattr(server_worker, "release_openmp_workers", lambda: seen.append(threading.current_thread()))

    class NoEngine:                                          # start() only reads the engine in its thread
        has_work = False
        config = None

        def stats(self):
            return None

    worker = server_worker.EngineWorker(NoEngine(), max_queue=0)
    monkeypatch.setattr(worker, "_run", lambda: seen.append("ran"))
    worker.start()
    worker._thread.join(5)
    assert seen == [threading.current_thread(), "ran"]
