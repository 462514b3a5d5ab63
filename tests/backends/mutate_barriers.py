"""Mutation check: delete each __syncthreads of the decode path in turn; the kernel tests must fail.

    python tests/backends/mutate_barriers.py [pytest -k expression, default SELECTION]

For each deletion, builds the shim from a mutated copy of cuda/ (HF_PAGED_SHIM_SOURCES) and runs the
decode tests, printing which failed. Exits non-zero if some deletion leaves every test passing.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CUDA = HERE.parents[1] / "cuda"
BARRIER = re.compile(r"__syncthreads\(\);")
# The model-dtype decode tests. The quantised kernels share attend_tiles and its barriers (their staging
# adds none), so they are left out: each mutated build would otherwise compile their modules too.
SELECTION = "decode and not nvrtc and not quantised"


def main(selection: str = SELECTION) -> int:
    text = (CUDA / "attention.cu").read_text()
    sites = list(BARRIER.finditer(text))
    survivors = []
    for n, site in enumerate(sites):
        line = text.count("\n", 0, site.start()) + 1
        comment = text[site.end():text.find("\n", site.end())].strip()
        with tempfile.TemporaryDirectory() as tmp:
            for f in CUDA.glob("*.cu*"):
                shutil.copy(f, tmp)
            Path(tmp, "attention.cu").write_text(text[:site.start()] + text[site.end():])
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", str(HERE), "-q", "-p", "no:cacheprovider", "-k", selection,
                 "-o", "addopts="],
                capture_output=True, text=True, env={**__import__("os").environ, "HF_PAGED_SHIM_SOURCES": tmp})
        failed = sorted(set(re.findall(r"^FAILED (\S+)", proc.stdout, re.M)))
        summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
        print(f"deletion {n + 1}/{len(sites)}: line {line} {comment}\n  {summary}")
        for name in failed:
            print(f"    {name.split('::', 1)[1]}")
        if not failed:
            survivors.append(line)
    print("every deletion caught" if not survivors else f"NOT caught: deletions at lines {survivors}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
