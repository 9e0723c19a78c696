"""The point-to-point benchmark's configuration, its results, and the tables it prints.

See :mod:`benchmarks.p2p` for what is measured and how.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
import socket
from dataclasses import dataclass, field
from typing import Any

import torch

import transport

from ._sizes import GiB, MiB, format_size

DEFAULT_SIZES: tuple[int, ...] = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1 * GiB)
DEFAULT_BACKENDS: tuple[str, ...] = ("ipc", "ucx", "tcp")

# Automatic iteration count: about this many bytes per (operation, size), within the bounds.
_AUTO_BYTES = 8 * GiB
_AUTO_MIN_ITERS, _AUTO_MAX_ITERS = 5, 50


@dataclass(frozen=True)
class BenchConfig:
    """What to measure.

    Args:
        backends: backends to measure, in this order; unavailable ones are skipped with a reason.
        sizes: transfer sizes in bytes.
        iters: timed transfers per (operation, size); None chooses per size (about 8 GiB moved,
            between 5 and 50 transfers).
        warmup: untimed transfers before each timed series.
        latency_iters: timed small transfers for the latency figures.
        latency_bytes: size of a small transfer.
        timeout: seconds; bounds every single transfer and every wait for the target process.
        copy_threads: the Transports' native copy threads (the ipc data path).

    Raises:
        ValueError: an argument is out of range.
    """

    backends: tuple[str, ...] = DEFAULT_BACKENDS
    sizes: tuple[int, ...] = DEFAULT_SIZES
    iters: int | None = None
    warmup: int = 1
    latency_iters: int = 1000
    latency_bytes: int = 8
    timeout: float = 120.0
    copy_threads: int = 2

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("no backends to measure")
        if not self.sizes or min(self.sizes) <= 0:
            raise ValueError(f"sizes must be positive byte counts, got {self.sizes}")
        if self.iters is not None and self.iters < 1:
            raise ValueError(f"iters must be >= 1, got {self.iters}")
        if self.warmup < 0 or self.latency_iters < 1 or self.latency_bytes < 1:
            raise ValueError("warmup must be >= 0, latency_iters and latency_bytes >= 1")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")

    @property
    def region_bytes(self) -> int:
        """Size of the target's destination region (and of the local buffers)."""
        return max(max(self.sizes), self.latency_bytes)

    def iters_for(self, size: int) -> int:
        """Timed transfers per operation at ``size``."""
        if self.iters is not None:
            return self.iters
        return max(_AUTO_MIN_ITERS, min(_AUTO_MAX_ITERS, math.ceil(_AUTO_BYTES / size)))


@dataclass(frozen=True)
class SizeResult:
    """Bandwidths at one size (medians over ``iters`` timed transfers)."""

    size: int
    iters: int
    put_gbps: float
    get_gbps: float
    memcpy_gbps: float

    @property
    def put_ratio(self) -> float:
        """The put bandwidth over the memcpy bandwidth."""
        return self.put_gbps / self.memcpy_gbps

    @property
    def get_ratio(self) -> float:
        """The get bandwidth over the memcpy bandwidth."""
        return self.get_gbps / self.memcpy_gbps


@dataclass(frozen=True)
class LatencyResult:
    """Latency of small transfers, each awaited before the next."""

    op: str
    nbytes: int
    iters: int
    median_us: float
    p99_us: float


@dataclass(frozen=True)
class BatchResult:
    """Many small segments to one peer: one prepared transfer vs as many single puts."""

    segments: int
    segment_bytes: int
    stride: int
    prepared_seg_per_s: float  # median of the timed starts of one prepared put
    single_seg_per_s: float  # the same segments as single puts, all started, then gathered

    @property
    def speedup(self) -> float:
        return self.prepared_seg_per_s / self.single_seg_per_s


@dataclass
class BackendResult:
    """Everything measured for one backend."""

    name: str
    one_sided: bool
    sizes: list[SizeResult] = field(default_factory=list)
    latency: list[LatencyResult] = field(default_factory=list)
    batch: list[BatchResult] = field(default_factory=list)


@dataclass
class BenchReport:
    """One run: machine facts, the configuration, the memcpy baseline and each backend."""

    config: BenchConfig
    machine: dict[str, Any]
    memcpy_gbps: dict[int, float]
    backends: list[BackendResult]
    skipped: dict[str, str]
    elapsed_s: float

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of everything in the report (ratios included)."""
        return {
            "schema": 1,
            **self.machine,
            "config": dataclasses.asdict(self.config),
            "memcpy": [{"size": n, "gbps": g} for n, g in sorted(self.memcpy_gbps.items())],
            "backends": {
                b.name: {
                    "one_sided": b.one_sided,
                    "sizes": [
                        {**dataclasses.asdict(s), "put_ratio": s.put_ratio, "get_ratio": s.get_ratio}
                        for s in b.sizes
                    ],
                    "latency": [dataclasses.asdict(lat) for lat in b.latency],
                    "batch": [{**dataclasses.asdict(x), "speedup": x.speedup} for x in b.batch],
                }
                for b in self.backends
            },
            "skipped": dict(self.skipped),
            "elapsed_s": self.elapsed_s,
        }


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """Date, host, CPU and software versions, as recorded with the results."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "transport_version": transport.__version__,
    }


def format_report(report: BenchReport) -> str:
    """Fixed-width tables, one per backend, then latency lines."""
    m = report.machine
    lines = [
        (
            f"transport {m['transport_version']} bench on {m['hostname']} ({m['cpu_model']}, {m['cpu_count']} cpus), "
            f"torch {m['torch_version']}, {m['date']}"
        ),
        "GB/s = 1e9 bytes/s; median of the timed transfers after warm-up, one transfer in flight at a time.",
        "memcpy = single-threaded native memcpy between two pre-faulted buffers of this process, same run;",
        (
            f"ipc copies run on the Transport's {report.config.copy_threads} native copy threads, and ucx splits "
            "large transfers across its lanes (2 worker threads by default), so their ratios to memcpy may exceed 1."
        ),
    ]
    header = (
        f"{'size':>9} | {'put GB/s':>9} | {'get GB/s':>9} | {'memcpy GB/s':>11} | "
        f"{'put/memcpy':>10} | {'get/memcpy':>10} | {'iters':>5}"
    )
    for b in report.backends:
        kind = "one-sided" if b.one_sided else "served by the target's agent"
        lines += ["", f"backend {b.name} ({kind})", header, "-" * len(header)]
        for s in b.sizes:
            lines.append(
                f"{format_size(s.size):>9} | {s.put_gbps:>9.2f} | {s.get_gbps:>9.2f} | {s.memcpy_gbps:>11.2f} | "
                f"{s.put_ratio:>10.2f} | {s.get_ratio:>10.2f} | {s.iters:>5}"
            )
        for lat in b.latency:
            lines.append(
                f"  latency {lat.op} {lat.nbytes} B: median {lat.median_us:.1f} us, "
                f"p99 {lat.p99_us:.1f} us ({lat.iters} {lat.op}s)"
            )
        for x in b.batch:
            lines.append(
                f"  batch of {x.segments} x {format_size(x.segment_bytes)} at a {format_size(x.stride)} stride: "
                f"prepared put {x.prepared_seg_per_s / 1e3:.1f}k segments/s, single puts "
                f"{x.single_seg_per_s / 1e3:.1f}k segments/s ({x.speedup:.1f}x)"
            )
    for name, reason in report.skipped.items():
        lines += ["", f"backend {name} skipped: {reason}"]
    lines += ["", f"total {report.elapsed_s:.1f} s"]
    return "\n".join(lines)
