# Manual check (not yet a pytest file): quantised fast decode on the shim vs quantized_torch.
# usage: python tests/backends/try_fast_quant.py FORMAT HEAD_DIM DTYPE GROUP
import sys, time, torch
sys.path.insert(0, "tests/backends")
import harness
from hf_paged import kv_formats
from hf_paged.backends import cuda_fast, quantized_torch as qt
from test_quantised_kernels import quantised_pools
from test_attention_kernels import cache_tables
fmt_name, d, dtype, group = (sys.argv[1], int(sys.argv[2]), getattr(torch, sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else ("int8", 128, torch.bfloat16, 4)
libs = harness.build(units=[])
gen = torch.Generator().manual_seed(0)
lengths = [0, 1, 7, 9, 200, 77]
bs, hkv = 16, 2
tables, lens = cache_tables(lengths, bs, gen) if False else (None, None)
nb = sum((l + bs - 1)//bs for l in lengths) + 2
perm = torch.randperm(nb, generator=gen)
w = max((l + bs - 1)//bs for l in lengths)
tables = torch.zeros(len(lengths), w, dtype=torch.int32); k = 0
for i, l in enumerate(lengths):
    n = (l + bs - 1)//bs; tables[i, :n] = perm[k:k+n]; k += n
lens = torch.tensor(lengths, dtype=torch.int32)
(kp, vp), _ = quantised_pools(kv_formats.FORMATS[fmt_name], hkv, nb, bs, d, gen, dtype)
q = torch.randn(len(lengths), hkv*group, d, generator=gen).to(dtype)
for win, part in ((0, None), (0, 32), (9, None)):
    for sched in ("warp_ahead", "random"):
        be = harness.shim_backend(libs, schedule=sched, seed=1, partition_size=part)
        t = time.time()
        out = cuda_fast.decode_fast_quantised(be, q, kp, vp, tables, lens, d**-0.5, win, 200)
        ref = qt.decode_attention(q, kp, vp, tables, lens, d**-0.5, sliding_window=win)
        print(fmt_name, d, dtype, group, win, part, sched, be.launcher.launches, f"{(out.float()-ref.float()).abs().max().item():.3g} |out| {out.float().abs().max().item():.3g} nz {(out.float()-ref.float()).ne(0).float().mean().item():.2f}", f"{time.time()-t:.1f}s")
