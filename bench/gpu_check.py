"""The prepared check for a GPU machine, built so that one try cannot be lost (<= 5 minutes on an H200):

    python -m bench gpu --out $OUT                  (from the repository root)
    python -m bench gpu --list                      the sections and their deadlines
    python -m bench gpu --sections correctness,decode_bandwidth --out $OUT
    python -m bench gpu --dry-run --out /tmp/x      the machinery on the CPU, with fake sections

First ``pip install --no-deps --no-build-isolation --no-index -e .`` (offline; when it fails, each section
loads hf_paged straight from this checkout's folders, and says so). Then every section runs in its own
subprocess (``python -m bench gpu --section NAME``) under its own deadline: a CUDA fault (sticky for
the process) or a timeout loses only that section, and what the section recorded before it died is kept.
Each section's result is appended, as one JSON line, to ``$OUT/gpu_check.jsonl`` (or ``--out``) the moment
it finishes; a compact summary of whatever finished is printed last. Sections (``--list``; the table is
gpu_sections.SECTIONS): env, correctness, quantised, engine_step, generate_batch, decode_bandwidth, extend,
generate, engine, quantised_extend (the later ones when the budget has room left).

Timing: N back-to-back calls between one pair of CUDA events, after a warm-up that runs until two batches
agree within 3%; the same N calls replayed from a CUDA graph too (the kernels' time without the host's), unless
--no-graphs. Inputs rotate over enough copies that each round touches >= 3x the L2 (60 MB on an H200); K and V
are distinct tensors for every baseline; bandwidth counts the bytes actually read and written (K+V of every
context token, q and out).

Files: this runner (command line, install, one process per section, JSON lines, summary, the --dry-run fake
sections); gpu_sections.py, gpu_kernels.py, gpu_models.py (the sections and their cases); gpu_timing.py
(timing, tensors, tolerances).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

if __name__ == "__main__" and not __package__:   # the old `python bench/gpu_check.py`: say where it went
    sys.exit("the GPU check is `python -m bench gpu [ARGS]`, from the repository root")

from .gpu_sections import SECTIONS  # noqa: E402
from .gpu_timing import SKIP_NO_CUDA, SectionContext, _jsonable  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TOTAL_BUDGET_S = 300.0        # the whole run, install included (the device lease is 15 minutes with start-up)
MIN_SECTION_S = 15.0          # a section is not started with less time than this left
TARGETS = "decode >= 80% of copy at 64x4k GQA 4, >= 60% at GQA 16; batch-1 4k within 1.5x SDPA; extend >= 50% SDPA"


# Fake sections for --dry-run: the machinery (subprocess, deadline, JSON lines, summary) on the CPU.
def fake_ok(ctx: SectionContext) -> dict:
    ctx.record({"case": "one", "ok": True, "value": 1.0})
    ctx.record({"case": "two", "ok": True, "value": 2.0})
    return {"summary": ["fake_ok: two cases"], "device": "fake"}


def fake_fail(ctx: SectionContext) -> dict:
    ctx.record({"case": "before the failure", "ok": True})
    raise RuntimeError("a planted failure")


def fake_timeout(ctx: SectionContext) -> dict:
    ctx.record({"case": "before the hang", "ok": True})
    time.sleep(600)
    return {}


def fake_crash(ctx: SectionContext) -> dict:
    ctx.record({"case": "before the crash", "ok": True})
    sys.stdout.flush()
    os.abort()          # as a CUDA fault that takes the process down


FAKE_SECTIONS = {
    "fake_ok": (10, False, fake_ok, "records two cases"),
    "fake_fail": (10, False, fake_fail, "raises after one case"),
    "fake_timeout": (2, False, fake_timeout, "hangs past its 2 s deadline after one case"),
    "fake_crash": (10, False, fake_crash, "aborts the process after one case"),
    "fake_after": (10, False, fake_ok, "runs after the others: isolation holds"),
}


# ---------------------------------------------------------------------------------------------------------
# The child: one section in this process
# ---------------------------------------------------------------------------------------------------------
def import_package() -> str:
    """Import hf_paged from this checkout: installed (editable) if it imports from here, else loaded from the
    folders setup.py maps (hf_paged/, integrations/ -> hf_paged.integrations, cuda/ -> hf_paged.cuda)."""
    try:
        import hf_paged
        import hf_paged.cuda  # noqa: F401
        import hf_paged.integrations  # noqa: F401
        if Path(hf_paged.__file__).resolve().is_relative_to(REPO):
            return "imported from this checkout"
        found = f"installed elsewhere ({hf_paged.__file__})"
    except ImportError as exc:
        found = f"not importable ({exc})"
    for name in [m for m in sys.modules if m == "hf_paged" or m.startswith("hf_paged.")]:
        del sys.modules[name]
    spec = importlib.util.spec_from_file_location("hf_paged", REPO / "hf_paged" / "__init__.py",
                                                  submodule_search_locations=[str(REPO / "hf_paged"), str(REPO)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["hf_paged"] = module
    spec.loader.exec_module(module)
    return f"loaded from {REPO} (the package was {found})"


def _die_with_parent(seconds: float) -> None:
    """A section never outlives its parent (Linux: SIGKILL when the parent dies) nor its deadline by much
    (a timer ends the process) — a GPU left busy would spoil the next try."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)          # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    timer = threading.Timer(seconds, lambda: os._exit(124))
    timer.daemon = True
    timer.start()


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_section(name: str, result_file: Path, deadline: float, smoke: bool, graphs: bool) -> int:
    table = {**SECTIONS, **FAKE_SECTIONS}
    _, needs_cuda, fn, _ = table[name]
    ctx = SectionContext(result_file, deadline, smoke, graphs)
    if name in SECTIONS:
        import torch
        if needs_cuda and not smoke and not torch.cuda.is_available():
            ctx.write("status", SKIP_NO_CUDA)
            return 0
        ctx.package = import_package()
    try:
        figures = fn(ctx) or {}
        if name in SECTIONS and not smoke:
            import torch
            if torch.cuda.is_available():
                figures.setdefault("device", torch.cuda.get_device_name())
        ctx.write("figures", figures)
        return 0
    except BaseException:  # noqa: BLE001 - recorded; the parent reads it
        ctx.write("error", traceback.format_exc()[-4000:])
        return 1


# ---------------------------------------------------------------------------------------------------------
# The parent: install, one subprocess per section, JSON lines, summary
# ---------------------------------------------------------------------------------------------------------
def out_path(arg: str | None) -> Path:
    """--out: a .jsonl/.json file, or a folder (gpu_check.jsonl inside); default $OUT/gpu_check.jsonl, else
    ./gpu_check.jsonl."""
    if arg is None:
        base = os.environ.get("OUT")
        return Path(base) / "gpu_check.jsonl" if base else Path("gpu_check.jsonl")
    path = Path(arg)
    if path.suffix in (".jsonl", ".json") and not path.is_dir():
        return path
    return path / "gpu_check.jsonl"


def install(budget_s: float) -> dict:
    """pip install --no-deps --no-build-isolation --no-index -e <repo> (offline)."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
           "--disable-pip-version-check", "-e", str(REPO)]
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=budget_s, cwd=REPO)
        status = "ok" if done.returncode == 0 else "failed"
        tail = (done.stdout + done.stderr).strip()[-1500:]
    except subprocess.TimeoutExpired:
        status, tail = "timeout", f"pip did not finish in {budget_s:.0f} s"
    except OSError as exc:
        status, tail = "failed", repr(exc)
    record = {"section": "install", "status": status, "seconds": round(time.monotonic() - t0, 2),
              "command": " ".join(cmd)}
    if status != "ok":
        record["error"] = tail
        record["fallback"] = f"each section loads hf_paged from {REPO}'s folders (import_package)"
    return record


def spawn(name: str, deadline: float, workdir: Path, smoke: bool, graphs: bool) -> dict:
    """Run one section in its own process group under ``deadline``; its output is echoed with a prefix."""
    result_file = workdir / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "bench", "gpu", "--section", name, "--result-file", str(result_file),
           "--deadline", f"{deadline:.0f}"] + (["--cpu-smoke"] if smoke else []) + ([] if graphs else ["--no-graphs"])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    # its own process group (killed whole at the deadline) but not its own session, so that whatever ends
    # this run (a job limit) ends the section too
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
                            **group)
    tail: collections.deque = collections.deque(maxlen=30)

    def pump():
        for line in proc.stdout:
            tail.append(line.rstrip())
            print(f"  [{name}] {line.rstrip()}", flush=True)
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=deadline)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:                            # the deadline, or this process interrupted: the section goes
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
            proc.wait()
    reader.join(timeout=5)
    seconds = time.monotonic() - t0
    return _collect(name, cmd, proc.returncode, timed_out, seconds, deadline, result_file, list(tail))


def _collect(name, cmd, returncode, timed_out, seconds, deadline, result_file: Path, tail: list) -> dict:
    cases, figures, error, status_line = [], None, None, None
    if result_file.exists():
        for line in result_file.read_text().splitlines():
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                continue            # a line cut by the kill
            kind, data = item.get("kind"), item.get("data")
            if kind == "case":
                cases.append(data)
            elif kind == "figures":
                figures = data
            elif kind == "error":
                error = data
            elif kind == "status":
                status_line = data
    figures = dict(figures or {})
    bad = [c for c in cases if c.get("ok") is False]
    if timed_out:
        status = "timeout"
        error = error or f"killed at its {deadline:.0f} s deadline; {len(cases)} cases recorded before"
    elif status_line:
        status = status_line
    elif figures.get("status"):
        status = figures.pop("status")
    elif returncode != 0 or error is not None or figures == {} and not cases:
        status = "failed"
        if error is None:
            sig = -returncode if returncode and returncode < 0 else None
            what = f"signal {signal.Signals(sig).name}" if sig else f"exit code {returncode}"
            error = f"the section process ended with {what} (a CUDA fault kills the process)"
    elif bad:
        status = "failed"
    else:
        status = "ok"
    record = {"section": name, "status": status, "seconds": round(seconds, 2), "deadline_s": round(deadline),
              "device": figures.get("device"), "command": " ".join(cmd),
              "cases_total": len(cases), "cases_failed": len(bad), "figures": {**figures, "cases": cases}}
    if error:
        record["error"] = error
    if status not in ("ok",) and not status.startswith("skipped"):
        record["log_tail"] = tail[-15:]
    return record


def append(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record, default=_jsonable) + "\n")


def summarize(records: list[dict], path: Path) -> None:
    print(f"\n==== gpu_check summary ({TARGETS}) ====", flush=True)
    for r in records:
        head = f"{r['section']:<17} {r['status']:<26} {r['seconds']:7.1f} s"
        if r["section"] != "install":
            head += f"  cases {r.get('cases_total', 0) - r.get('cases_failed', 0)}/{r.get('cases_total', 0)} ok"
        print(head)
        if r.get("error"):
            print("    error: " + str(r["error"]).strip().splitlines()[-1][:300])
        figures = r.get("figures", {})
        for line in figures.get("summary", []):
            print("    " + line)
        failed = [c for c in figures.get("cases", []) if c.get("ok") is False]
        for c in failed[:6]:
            keys = {k: v for k, v in c.items() if k not in ("ok", "seconds") and not k.endswith("timing")}
            print("    FAIL " + json.dumps(keys, default=_jsonable)[:300])
        if len(failed) > 6:
            print(f"    ... {len(failed) - 6} more failed cases in the JSON")
    print(f"wrote {path}", flush=True)


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="JSON-lines file, or a folder for gpu_check.jsonl (default $OUT/gpu_check.jsonl)")
    parser.add_argument("--sections", help="comma-separated subset, in run order (see --list)")
    parser.add_argument("--list", action="store_true", help="list the sections and their deadlines")
    parser.add_argument("--budget", type=float, default=TOTAL_BUDGET_S,
                        help=f"seconds for the whole run ({TOTAL_BUDGET_S:.0f})")
    parser.add_argument("--no-install", action="store_true", help="skip the offline pip install -e")
    parser.add_argument("--no-graphs", action="store_true", help="time eagerly only (no CUDA graph replay)")
    parser.add_argument("--dry-run", action="store_true", help="fake sections on the CPU: the machinery alone")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="the real sections' code on the CPU, tiny shapes, PyTorch path for the kernels "
                             "(for developing this script; no figure means anything)")
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=60.0, help=argparse.SUPPRESS)
    return parser


def main(argv=None, prog: str = "python -m bench gpu"):
    parser = build_parser(prog)
    args = parser.parse_args(argv)

    if args.section:                    # the child
        _die_with_parent(args.deadline + 15)
        code = run_section(args.section, Path(args.result_file), args.deadline, args.cpu_smoke, not args.no_graphs)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)      # the result is written; a library thread left running must not hold the exit

    table = FAKE_SECTIONS if args.dry_run else SECTIONS
    if args.list:
        for name, (deadline, cuda, _, line) in table.items():
            print(f"{name:<17} {deadline:>4} s  {'CUDA' if cuda else '    '}  {line}")
        return
    names = list(table) if not args.sections else [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [n for n in names if n not in table]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; known: {list(table)} (see --list)")
    path = out_path(args.out)
    run_id = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    start = time.monotonic()
    left = lambda: args.budget - (time.monotonic() - start)  # noqa: E731
    records = []

    def finish(record):
        record.update(run_id=run_id, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        records.append(record)
        append(path, record)
        print(f"-- {record['section']}: {record['status']} ({record['seconds']:.1f} s) -> {path}", flush=True)

    if args.dry_run or args.no_install:
        finish({"section": "install", "status": "skipped (--dry-run)" if args.dry_run else "skipped (--no-install)",
                "seconds": 0.0})
    else:
        print(f"installing {REPO} offline (pip install --no-deps --no-build-isolation --no-index -e .)", flush=True)
        finish(install(min(60.0, left() / 4)))
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        _run_sections(names, table, args, left, finish)
    except KeyboardInterrupt as exc:
        print(f"\ninterrupted ({exc}): the running section was stopped", flush=True)
        records.append({"section": "interrupted", "status": "interrupted", "seconds": 0.0})
    finally:                            # also when interrupted: whatever finished is in the file already
        summarize(records, path)
    bad = [r["section"] for r in records if r["status"] in ("failed", "timeout", "interrupted")]
    if bad:
        sys.exit(f"gpu_check: not ok: {', '.join(bad)}")


def _run_sections(names, table, args, left, finish) -> None:
    device = cuda_seen = None
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        for name in names:
            deadline, needs_cuda, _, _ = table[name]
            budget = min(deadline, left() - 5)
            t0 = time.monotonic()
            if needs_cuda and cuda_seen is False and not args.cpu_smoke:
                record = {"section": name, "status": SKIP_NO_CUDA, "seconds": 0.0,
                          "note": "env found no CUDA device; the section was not started"}
            elif budget < min(MIN_SECTION_S, deadline):
                record = {"section": name, "status": "skipped: out of time budget", "seconds": 0.0,
                          "note": f"{left():.0f} s of the {args.budget:.0f} s budget left"}
            else:
                print(f"== {name} (deadline {budget:.0f} s)", flush=True)
                record = spawn(name, budget, Path(tmp), args.cpu_smoke, not args.no_graphs)
                if name == "env":
                    cuda_seen = record["figures"].get("cuda_available")   # None (unknown) skips nothing
                    device = record["figures"].get("device")
            record.setdefault("device", device)
            record["device"] = record["device"] or device
            record["seconds"] = record.get("seconds") or round(time.monotonic() - t0, 2)
            finish(record)
