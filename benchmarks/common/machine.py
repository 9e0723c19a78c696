"""What a recorded run ran on and against: the host, the ``transport`` checkout, the command
line, and how busy the rest of the machine was meanwhile (on a shared machine the figures are
only as good as that load is small)."""

from __future__ import annotations

import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .sizes import GiB, KiB


def meminfo(field: str) -> int:
    """A ``/proc/meminfo`` field (e.g. ``"MemAvailable"``) in bytes; 0 where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * KiB
    except OSError:
        pass
    return 0


def machine() -> dict[str, Any]:
    """What this host is (for the record)."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "host": platform.node(), "cpu": cpu, "nproc": os.cpu_count(),
        "memory_gib": round(meminfo("MemTotal") / GiB, 1),
        "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
    }


def library() -> dict[str, Any]:
    """Which ``transport`` was measured: its version, and the git commit of its checkout with the
    files that differ from it (the numbers describe that exact code)."""
    import transport

    root = Path(transport.__file__).resolve().parent.parent
    out: dict[str, Any] = {"version": getattr(transport, "__version__", "?"), "path": str(root)}
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "transport", "csrc"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return out
    out["commit"] = commit
    out["uncommitted"] = sorted(line[3:] for line in dirty)
    return out


@dataclass(frozen=True)
class CpuSample:
    """Busy CPU seconds of the whole machine, and of this process and its reaped children."""

    machine_busy_s: float
    ours_s: float
    wall: float

    @staticmethod
    def take() -> CpuSample:
        """A sample now (zeros for what this platform does not expose)."""
        busy = 0.0
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
            # user nice system idle iowait irq softirq steal ...: everything but idle and iowait
            busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            pass
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return CpuSample(busy, own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime, time.monotonic())


def other_load(start: CpuSample, end: CpuSample) -> dict[str, float]:
    """CPU time that processes outside this benchmark used during the run: on a shared machine,
    the numbers are only as good as this is small."""
    wall = max(1e-9, end.wall - start.wall)
    cores = os.cpu_count() or 1
    others = max(0.0, (end.machine_busy_s - start.machine_busy_s) - (end.ours_s - start.ours_s))
    return {"other_cpu_s": round(others, 1), "other_cores_avg": round(others / wall, 2),
            "other_share": round(others / (wall * cores), 3)}


def command_line(argv: Sequence[str] | None, module: str) -> str:
    """The command that ran ``python -m module`` with ``argv`` (default: this process's)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return f"python -m {module}" + ("" if not args else " " + shlex.join(args))


def library_line(lib: dict[str, Any]) -> str:
    """One sentence on the measured library (:func:`library`), for a report."""
    line = f"Library: transport {lib.get('version', '?')}"
    if "commit" in lib:
        line += f" at commit {lib['commit']}"
        if lib["uncommitted"]:
            line += f" with uncommitted changes in {', '.join(lib['uncommitted'])}"
    return line + "."
