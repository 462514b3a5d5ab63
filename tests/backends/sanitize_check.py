"""Small-shape kernel runs for a sanitizer build of the shim (run by test_sanitizers.py):

    ASAN_OPTIONS=detect_leaks=0 LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so)" \\
        python tests/backends/sanitize_check.py address,undefined

Builds head dim 64 with -fsanitize=..., runs every kernel under the warp-ahead
schedule against the PyTorch reference; any sanitizer report aborts the process (non-zero exit).
ThreadSanitizer does not start under this Python (it segfaults before running `print(1)`), so races
are left to the shim's schedules.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from hf_paged.backends import torch_backend as ta  # noqa: E402


def main(sanitize: str) -> None:
    libs = harness.build(sanitize=sanitize, head_dims=(64,))
    gen = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1.6e-2), (torch.float32, 2e-5)):
        backend = harness.shim_backend(libs, schedule="warp_ahead", partition_size=32)
        kp = torch.randn(2, 12, 16, 64, generator=gen).to(dtype)
        vp = torch.randn(2, 12, 16, 64, generator=gen).to(dtype)
        tables = torch.tensor([[3, 1, 4, 0, 5, 9], [2, 6, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.int32)
        lens = torch.tensor([90, 17, 0], dtype=torch.int32)
        q = torch.randn(3, 8, 64, generator=gen).to(dtype)
        for window in (0, 20):
            ref = ta.decode_attention(q, kp, vp, tables, lens, 0.125, sliding_window=window)
            out = backend.decode_attention(q, kp, vp, tables, lens, 0.125, sliding_window=window)
            torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
        pos = torch.tensor([[85, 86, 87, 88, 89], [-1, -1, 14, 15, 16], [-1] * 5], dtype=torch.int32)
        qe = torch.randn(3, 8, 5, 64, generator=gen).to(dtype)
        ref = ta.extend_attention(qe, kp, vp, tables, lens, pos, 0.125)
        out = backend.extend_attention(qe, kp, vp, tables, lens, pos, 0.125)
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
        want = [kp.clone(), vp.clone()]
        key = torch.randn(4, 2, 64, generator=gen).to(dtype)
        slots = torch.tensor([0, -1, 191, 40])
        ta.write_kv(*want, key, key, slots)
        backend.write_kv(kp, vp, key, key, slots)
        ta.copy_blocks(want, torch.tensor([[3, 7], [1, 8]]))
        backend.copy_blocks([kp, vp], torch.tensor([[3, 7], [1, 8]]))
        assert torch.equal(kp, want[0]) and torch.equal(vp, want[1])
    print("sanitizer run clean")


def out_of_bounds(sanitize: str) -> None:
    """Negative control: a block table naming the block one past the pool's end must be reported."""
    libs = harness.build(sanitize=sanitize, head_dims=(64,))
    k_pool = torch.randn(2, 4, 16, 64).half()
    tables = torch.tensor([[3, 4]], dtype=torch.int32)
    harness.shim_backend(libs).decode_attention(torch.randn(1, 8, 64).half(), k_pool, k_pool.clone(), tables,
                                                torch.tensor([20], dtype=torch.int32), 0.1)
    print("no report")


if __name__ == "__main__":
    run = out_of_bounds if sys.argv[2:] == ["--out-of-bounds"] else main
    run(sys.argv[1] if len(sys.argv) > 1 else "address,undefined")
