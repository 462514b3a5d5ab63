"""Measurement helpers for bench/gpu_check.py's sections (the runner is gpu_check.py, the sections
gpu_sections.py): the SectionContext a section function receives, guarded cases, timing (N calls between one
pair of CUDA events, CUDA-graph replay), tensors (paged and contiguous K/V, SDPA baselines), the backends, and
the tolerances results are compared with. hf_paged and torch are imported inside functions only: the section's
process sets up hf_paged's import path (gpu_check.import_package) before any of these run."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

SKIP_NO_CUDA = "skipped: no CUDA device"


# ---------------------------------------------------------------------------------------------------------
# The section's side: what a section function receives, timing, tensors
# ---------------------------------------------------------------------------------------------------------
class SectionContext:
    """Handed to a section function: ``record(case)`` appends one case to the result file at once (so a
    timeout or a crash keeps it), ``time_left()`` is the section's own deadline minus the time spent."""

    def __init__(self, result_file: Path, deadline_s: float, smoke: bool, graphs: bool):
        self.result_file, self.smoke, self.graphs = result_file, smoke, graphs
        self.started = time.monotonic()
        self.deadline_s = deadline_s
        self.package = None         # how hf_paged was imported (set by run_section)

    def write(self, kind: str, data) -> None:
        with open(self.result_file, "a") as f:
            f.write(json.dumps({"kind": kind, "data": data}, default=_jsonable) + "\n")

    def record(self, case: dict) -> None:
        self.write("case", case)

    def time_left(self) -> float:
        return self.deadline_s - (time.monotonic() - self.started)


def _jsonable(value) -> str:
    """json.dumps' default: what JSON cannot hold (NaN and inf included) as text."""
    return str(value)


def guarded(ctx: SectionContext, case: dict, fn) -> bool:
    """Run ``fn(case)`` (it fills ``case``), record the case with its exception if any. False when the CUDA
    context is lost (every later CUDA call would fail too), so the section should stop."""
    t0 = time.perf_counter()
    try:
        fn(case)
        case.setdefault("ok", True)
    except Exception as exc:  # noqa: BLE001 - recorded per case, the section goes on
        case.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
    case["seconds"] = round(time.perf_counter() - t0, 3)
    ctx.record(case)
    if case.get("ok") is False and "error" in case:
        return _context_alive()
    return True


def _context_alive() -> bool:
    import torch
    if not torch.cuda.is_available():
        return True
    try:
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").add_(1).item()
        return True
    except Exception:  # noqa: BLE001 - a sticky CUDA error: the section stops here
        return False


def measure(fn, device, graphs: bool = True, target_ms: float = 20.0, repeats: int = 3,
            max_warm_s: float = 0.6) -> dict:
    """Milliseconds per call of ``fn(i)`` (i counts calls; fn rotates its inputs by it).

    CUDA: N calls back to back between one pair of events (N so that a batch lasts ~target_ms), after
    warm-up batches until two agree within 3% (or max_warm_s); median of ``repeats`` batches. Then, when
    ``graphs``, the same N calls captured into one CUDA graph and replayed (the GPU's time alone)."""
    import torch
    counter = iter(range(1 << 62))
    if device.type != "cuda":
        fn(next(counter))
        t0 = time.perf_counter()
        fn(next(counter))
        return {"ms": (time.perf_counter() - t0) * 1e3, "n": 1, "timer": "perf_counter"}

    def batch(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn(next(counter))
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n

    batch(1)
    one = batch(3)
    n = int(min(1000, max(3, target_ms / max(one, 1e-3))))
    t0, prev = time.perf_counter(), None
    while time.perf_counter() - t0 < max_warm_s:
        cur = batch(n)
        if prev is not None and abs(cur - prev) <= 0.03 * prev:
            break
        prev = cur
    samples = sorted(batch(n) for _ in range(repeats))
    out = {"ms": samples[len(samples) // 2], "eager_ms": samples[len(samples) // 2], "n": n,
           "spread": [samples[0], samples[-1]], "timer": "cuda events"}
    if graphs:
        try:
            out["graph_ms"] = _graph_ms(fn, counter, n, repeats)
            out["ms"] = out["graph_ms"]
            out["timer"] = "cuda graph replay"
        except Exception as exc:  # noqa: BLE001 - the eager figure stands
            out["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
            torch.cuda.synchronize()
    return out


def _graph_ms(fn, counter, n: int, repeats: int) -> float:
    import torch
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(next(counter))                       # a warm call on the capture stream
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(n):
            fn(next(counter))
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n)
    del graph
    return sorted(times)[len(times) // 2]


def heat_up(device, seconds: float = 0.3) -> None:
    """Load the GPU for a moment so that its clocks leave idle before the first measurement."""
    import torch
    if device.type != "cuda":
        return
    src = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            dst.copy_(src)
        torch.cuda.synchronize()


def paged_kv(lengths, block_size: int, num_kv_heads: int, head_dim: int, dtype, device, copies: int = 1,
             seed: int = 0):
    """Distinct K and V pools [Hkv, blocks, block_size, D] holding ``copies`` independent sets of the rows
    ``lengths`` in shuffled blocks; returns (k_pool, v_pool, [block_tables int32 [B, W]] per copy, lens)."""
    import torch
    gen = torch.Generator(device=device).manual_seed(seed)
    per_row = [max(1, -(-n // block_size)) for n in lengths]
    per_copy = sum(per_row)
    num_blocks = copies * per_copy + 1
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k_pool = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_pool = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    from hf_paged.backends.synthetic import assign_blocks
    order = torch.randperm(num_blocks - 1, generator=gen, device=device) + 1      # block 0 left unused
    tables = [assign_blocks(order[c * per_copy:], per_row) for c in range(copies)]
    return k_pool, v_pool, tables, torch.tensor(lengths, dtype=torch.int32, device=device)


def contiguous_kv(pool, table, length: int):
    """[B, Hkv, length, D] contiguous copy of the rows a block table names (a new tensor)."""
    from hf_paged.backends import torch_backend
    return torch_backend.gather_kv(pool, table, length).transpose(0, 1).contiguous()


def sdpa_runner(q, k, v, causal: bool):
    """(callable, how) for torch SDPA on q [B, Hq, Q, D], k/v [B, Hkv, L, D]: flash with enable_gqa when it
    runs, else flash over K/V repeated per query head (repeated here, outside any timing), else the default."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    group = q.shape[1] // k.shape[1]
    tries = [("flash, enable_gqa", [SDPBackend.FLASH_ATTENTION], k, v, group > 1)]
    if group > 1:
        tries.append(("flash, K/V repeated per query head", [SDPBackend.FLASH_ATTENTION], None, None, False))
    tries.append(("default backend, enable_gqa", None, k, v, group > 1))
    errors = []
    for how, backends, kk, vv, gqa in tries:
        if kk is None:
            kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

        def run(kk=kk, vv=vv, gqa=gqa, backends=backends):
            if backends is None:
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, enable_gqa=gqa)
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, enable_gqa=gqa)
        try:
            run()
            if q.is_cuda:
                torch.cuda.synchronize()
            return run, how
        except RuntimeError as exc:
            errors.append(f"{how}: {exc}"[:200])
    raise RuntimeError("no SDPA backend ran: " + " | ".join(errors))


def device_and_backend(ctx: SectionContext):
    """(device, kernel backend, torch_backend). --cpu-smoke: the CPU, and the PyTorch path standing in for
    the kernels (the section's code runs; its figures mean nothing)."""
    import torch
    from hf_paged.backends import torch_backend
    if ctx.smoke:
        return torch.device("cpu"), torch_backend, torch_backend
    from hf_paged.backends.cuda_backend import make_backend
    return torch.device("cuda"), make_backend(), torch_backend


def split_backend(backend, partition: int):
    """The kernel backend with split-K forced to ``partition`` keys per split (its compiled kernels shared)."""
    if not hasattr(backend, "launcher"):
        return backend
    return type(backend)(backend.launcher, partition_size=partition)


def l2_bytes(device) -> int:
    import torch
    if device.type != "cuda":
        return 1 << 20
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 60 * 2**20)


def _tolerance(torch, dtype) -> float:
    return {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4}[dtype]


def _compare(case: dict, out, ref, tol: float) -> None:
    """Fill max_abs_err, ref_max and ok: |out - ref| <= tol * max(1, max |ref|)."""
    if out.shape != ref.shape:
        raise AssertionError(f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    err = (out.float() - ref.float()).abs().max().item() if out.numel() else 0.0
    ref_max = ref.float().abs().max().item() if ref.numel() else 0.0
    case.update(max_abs_err=err, ref_max=ref_max, tol=tol * max(1.0, ref_max),
                ok=bool(math.isfinite(err) and err <= tol * max(1.0, ref_max)))


def kernel_choice(backend) -> dict:
    """Which kernels served: per (device, dtype, head dim[, KV format]), whether the fast kernels (fp16/bf16
    model-dtype pools; the quantised fast decode per format) passed their first-use self-check (False:
    attention.cu served instead, and its figures are what was measured)."""
    checked = getattr(backend, "checked", {})
    return {"fast_kernels": getattr(backend, "fast_kernels", None),
            "self_check_passed": {" ".join([str(dev), str(dtype).removeprefix("torch."), f"d{dim}", *fmt]): ok
                                  for (dev, dtype, dim, *fmt), ok in checked.items()}}
