"""OpenMP and engines stepping outside the thread that loaded the model.

torch's CPU ops (and hf_paged's C++ ones, built with ``-fopenmp``) run their parallel regions on OpenMP. In
GNU libgomp, the runtime of torch's pip wheels, every thread that starts a parallel region keeps a team of
worker threads of its own, and once the runtime manages more threads than there are CPUs it spins only
1,000 rounds at a barrier before sleeping on a futex (GOMP_SPINCOUNT's throttled value). So when the model
was loaded (or anything parallel ran) in one thread and an engine steps in another, as the server's engine
thread does, a machine whose cores torch already uses sees two teams: every parallel region of a step ends
in futex sleeps and wake-ups. Measured 2026-12-05 (SmolLM2-135M fp32, 2 cores, 2 threads, 32 requests): the
same engine run took 5.9 s in the main thread and 7.0 s in a second thread, with 28,500 voluntary context
switches against 3; with the main thread's team released first, 5.9 s and 7.
"""
from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("hf_paged")

GNU_OPENMP = "libgomp.so.1"     # the soname torch's wheels load (torch/lib/libgomp.so.1) and g++'s -fopenmp links
OMP_PAUSE_SOFT = 1              # omp_pause_resource_t: omp_pause_soft


def release_openmp_workers() -> bool:
    """Free the calling thread's OpenMP worker team (OpenMP 5's ``omp_pause_resource_all(omp_pause_soft)``),
    so that an engine started next in another thread runs its parallel regions unthrottled. True when
    libgomp was loaded and did it. Call it from the thread that loaded the model, before the engine thread
    starts, never from inside a parallel region. A later parallel region in this thread builds a new team
    (correct, and throttling again while both exist). Other OpenMP runtimes (Intel's, LLVM's) keep spinning
    for a fixed time whatever the thread count, and are left alone."""
    noload = getattr(os, "RTLD_NOLOAD", None)
    if noload is None:                                  # not a POSIX dlopen (Windows)
        return False
    try:
        runtime = ctypes.CDLL(GNU_OPENMP, mode=noload)  # only the copy already in this process, never a new one
        pause = runtime.omp_pause_resource_all
    except (OSError, AttributeError):                   # not loaded, or older than GCC 9 (no OpenMP 5 pause)
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    done = pause(OMP_PAUSE_SOFT) == 0
    if not done:
        log.debug("omp_pause_resource_all refused (called inside a parallel region?)")
    return done
