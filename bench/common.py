"""What every bench command shares: min / median / max over rounds, the record of the machine (CPU, its
flags, cores, threads, load), versions, result paths and timestamps, and matplotlib on demand."""
from __future__ import annotations

import argparse
import datetime as dt
import importlib
import os
import platform
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
# The /proc/cpuinfo flags that decide which CPU kernels run (oneDNN's bf16 / AMX paths, our C++ kernel).
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def spread(values) -> dict | None:
    """``{"min", "median", "max", "n"}`` of the values that are numbers (None and NaN left out); None if none."""
    vals = [v for v in values if v is not None and v == v]
    if not vals:
        return None
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals), "n": len(vals)}


def fmt_spread(s: dict | None, fmt: str = "{:.1f}") -> str:
    """'median (min–max)', or '–' for no figure."""
    if not s:
        return "–"
    med = s["median"]
    return f"{fmt.format(med)} ({fmt.format(s.get('min', med))}–{fmt.format(s.get('max', med))})"


def stamp() -> str:
    """Local time as the results' file names carry it: 20261201-225300."""
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def now() -> str:
    return dt.datetime.now().isoformat(timespec="seconds")


def load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return model, flags


def _stat_fields(path: Path) -> list[str] | None:
    """/proc/<pid>/stat's fields from the state on (the name before them may hold spaces), or None (exited)."""
    try:
        return path.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, every thread) process ``pid`` has used so far; None without /proc or once
    it has exited."""
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    return None if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def session_cpu_s(session: int) -> float | None:
    """CPU seconds (user + system, every thread) used so far by the live processes of ``session`` (a server
    started with ``start_new_session``: its pid), read from /proc; None where there is no /proc."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    total = 0
    for stat in proc.glob("[0-9]*/stat"):
        fields = _stat_fields(stat)
        if fields is not None and int(fields[3]) == session:    # fields from state: state ppid pgrp session ...
            total += int(fields[11]) + int(fields[12])           # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def machine(load_start: list | None = None) -> dict:
    """The CPU, the flags of it that matter here, cores (and those this process may use), torch's thread
    count, the platform and the load average at the start (``load_start``, taken by a caller that records the
    machine after its run; else now)."""
    import torch
    model, flags = _cpuinfo()
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "cpu_flags": [f for f in CPU_FLAGS if f in flags], "cores": os.cpu_count(),
            "cores_allowed": allowed, "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
            "python": platform.python_version(),
            "load_avg_start": load_avg() if load_start is None else load_start}


def versions(*modules: str) -> dict:
    """``__version__`` of each module (None when it does not import), and this checkout's git commit."""
    out = {}
    for name in modules:
        try:
            out[name] = importlib.import_module(name).__version__
        except Exception:  # noqa: BLE001 - an absent peer is recorded as absent
            out[name] = None
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(git + ["status", "--porcelain"], capture_output=True, text=True).stdout.strip()
    out["git"] = head + ("+dirty" if dirty else "")
    return out


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (and a line saying so) when matplotlib is absent."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] no plots: matplotlib is not installed (pip install matplotlib)")
        return None
    return plt


def md_table(header: list[str], rows) -> list[str]:
    """Markdown table lines: the header, its rule, one line per row (cells as given, str() applied)."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


def at_least(low, kind=int, what: str = "an integer"):
    """An argparse ``type``: a ``kind`` (int or float) >= ``low``; anything else is refused with the option's
    name and the bound."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not value >= low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        return value
    return parse


def int_at_least(low: int):
    """An argparse ``type``: an integer >= ``low``."""
    return at_least(low)


def ints_at_least(low: int):
    """An argparse ``type``: a comma list of integers, each >= ``low`` (a list, in the order given)."""
    one = at_least(low)

    def parse(text: str) -> list[int]:
        values = [one(part.strip()) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError("give at least one integer")
        return values
    return parse


def float_at_least(low: float):
    """An argparse ``type``: a number >= ``low``."""
    return at_least(low, float, "a number")
