"""Large, long-lived CPU buffers on transparent huge pages (Linux), for the data a step streams from memory.

A decode step on the CPU streams every linear weight once, and with 4 KiB pages that stream also walks the
page tables: the packed float32 weights of SmolLM2-135M (513 MiB) are 131k pages, far more than the TLB
holds. On 2 MiB pages the same kernel on the same weights took 0.91x the time at 1-14 rows (2 threads,
AVX-512 Xeon, 2026-12-06; 0.99x at 32 rows, where the arithmetic dominates).

``huge_page_buffer(numel, dtype)`` returns a 1-D tensor whose memory starts on a 2 MiB boundary and was
marked ``MADV_HUGEPAGE`` before anything touched it, so the kernel backs it with huge pages as it is first
written, where the system allows (``/sys/kernel/mm/transparent_hugepage/enabled`` = ``always`` or
``madvise``). Elsewhere (another OS, THP ``never``, a refused ``madvise``) it is an ordinary buffer: same
numbers, only the speed differs. It costs up to 4 MiB of address space beyond ``numel`` elements (never touched,
so no memory), which is why callers use it for buffers of many MiB only (``MIN_BYTES``).
"""
from __future__ import annotations

import ctypes
import logging
import sys

import torch

log = logging.getLogger("hf_paged")

HUGE_PAGE = 2 << 20
MIN_BYTES = 16 << 20            # smaller buffers: an ordinary allocation (the alignment slack would matter)
_MADV_HUGEPAGE = 14             # linux/mman.h
_MADV_COLLAPSE = 25             # linux/mman.h, Linux 6.1+


def _advise(address: int, nbytes: int, advice: int = _MADV_HUGEPAGE) -> bool:
    """madvise(address, nbytes, advice); False where that is not possible or was refused."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), advice) == 0
    except (OSError, AttributeError):
        return False


def collapse_onto_huge_pages(ranges: list[tuple[int, int]]) -> int:
    """Move the written memory of ``ranges`` ((address, bytes), buffers someone else allocated, such as oneDNN's
    packed weights) onto huge pages now (``MADV_COLLAPSE``, Linux 6.1+): ranges closer than a huge page are
    merged (big allocations sit next to each other), and each merged range's whole 2 MiB pages are collapsed.
    The neighbours sharing those pages (allocator headers, other buffers) move too, which changes nothing but
    their backing. Returns the bytes collapsed (0 where the kernel cannot: an older kernel, THP ``never``)."""
    merged: list[list[int]] = []
    for address, nbytes in sorted(ranges):
        if merged and address - merged[-1][1] < HUGE_PAGE:
            merged[-1][1] = max(merged[-1][1], address + nbytes)
        else:
            merged.append([address, address + nbytes])
    done = 0
    for begin, end in merged:
        begin, end = -(-begin // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
        if end > begin and _advise(begin, end - begin, _MADV_COLLAPSE):
            done += end - begin
    return done


def huge_page_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of ``numel`` elements on huge pages where possible (module doc)."""
    size = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * size
    if nbytes < MIN_BYTES:
        return torch.empty(numel, dtype=dtype)
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    raw = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)          # untouched: malloc maps it lazily
    start = -raw.data_ptr() % HUGE_PAGE
    if not _advise(raw.data_ptr() + start, span):
        log.debug("madvise(MADV_HUGEPAGE) refused; %d MiB on ordinary pages", nbytes >> 20)
    return raw[start:start + nbytes].view(dtype)
