"""The point-to-point benchmark's configuration, its results, and the tables it prints.

See :mod:`benchmarks.p2p` for what is measured and how, and :mod:`._nixl` and :mod:`._mooncake` for the
peers measured in the same run (``--peers nixl,mooncake``).
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

from ..common.batch import BATCH_SEGMENTS, BATCH_STRIDE
from ..common.sizes import GiB, KiB, MiB, format_size

DEFAULT_SIZES: tuple[int, ...] = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1 * GiB)
DEFAULT_BACKENDS: tuple[str, ...] = ("ipc", "ucx", "tcp")
DEFAULT_LATENCY_SIZES: tuple[int, ...] = (8, 4 * KiB)
KNOWN_PEERS: tuple[str, ...] = ("nixl", "mooncake")

REFERENCE_PUT_BYTES = 1 * MiB
"""Always in the bandwidth table, whatever ``--sizes`` says: the headline small-bulk put."""

# The smallest region: the whole batch fits (80 MiB of stride) with 1 MiB to spare, whatever the sizes.
MIN_REGION_BYTES = BATCH_SEGMENTS * BATCH_STRIDE + 1 * MiB

# Automatic iteration count: about this many bytes per (operation, size), within the bounds. Small
# sizes get many: on a VM the first 100-300 transfers of a series run up to 1.5x slower while idle
# vCPUs wake up (a native C loop of process_vm_writev shows the same), and 50 transfers of 1 MiB
# (5 ms) measured mostly that.
_AUTO_BYTES = 8 * GiB
_AUTO_MIN_ITERS, _AUTO_MAX_ITERS = 5, 1000


@dataclass(frozen=True)
class BenchConfig:
    """What to measure.

    Args:
        backends: backends to measure, in this order; unavailable ones are skipped with a reason.
        sizes: transfer sizes in bytes.
        iters: timed transfers per (operation, size); None chooses per size (about 8 GiB moved,
            between 5 and 1000 transfers).
        warmup: untimed transfers before each timed series.
        latency_iters: timed small transfers for the latency figures, per size and operation.
        latency_sizes: the small transfer sizes whose latency is measured (bytes).
        timeout: seconds; bounds every single transfer and every wait for the target process.
        copy_threads: the Transports' native copy threads (the ipc data path).
        peers: other libraries measured the same way in the same run (of :data:`KNOWN_PEERS`).

    Raises:
        ValueError: an argument is out of range.
    """

    backends: tuple[str, ...] = DEFAULT_BACKENDS
    sizes: tuple[int, ...] = DEFAULT_SIZES
    iters: int | None = None
    warmup: int = 1
    latency_iters: int = 1000
    latency_sizes: tuple[int, ...] = DEFAULT_LATENCY_SIZES
    timeout: float = 120.0
    copy_threads: int = 2
    peers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("no backends to measure")
        if not self.sizes or min(self.sizes) <= 0:
            raise ValueError(f"sizes must be positive byte counts, got {self.sizes}")
        if self.iters is not None and self.iters < 1:
            raise ValueError(f"iters must be >= 1, got {self.iters}")
        if self.warmup < 0 or self.latency_iters < 1:
            raise ValueError("warmup must be >= 0 and latency_iters >= 1")
        if not self.latency_sizes or min(self.latency_sizes) < 1:
            raise ValueError(f"latency sizes must be positive byte counts, got {self.latency_sizes}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")
        unknown = [p for p in self.peers if p not in KNOWN_PEERS]
        if unknown:
            raise ValueError(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(KNOWN_PEERS)}")

    @property
    def table_sizes(self) -> tuple[int, ...]:
        """The sizes of the bandwidth table: ``sizes`` and :data:`REFERENCE_PUT_BYTES`, sorted."""
        return tuple(sorted({*self.sizes, REFERENCE_PUT_BYTES}))

    @property
    def region_bytes(self) -> int:
        """Size of the target's destination region (and of the local buffers): the largest
        transfer, and never less than :data:`MIN_REGION_BYTES` (the whole batch fits)."""
        return max(max(self.table_sizes), max(self.latency_sizes), MIN_REGION_BYTES)

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
    """Latency of small transfers, each awaited before the next.

    ``variant`` is empty for the plain operation; a peer may add others (NIXL: ``"new handle"``,
    a transfer handle created and released around every transfer).
    """

    op: str  # "put" or "get"
    nbytes: int
    iters: int
    median_us: float
    p99_us: float
    variant: str = ""


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
        """The prepared rate over the single-puts rate."""
        return self.prepared_seg_per_s / self.single_seg_per_s


@dataclass(frozen=True)
class PreparedResult:
    """One segment of ``nbytes``: a prepared put started again and again vs plain puts (medians
    of the same number of timed transfers, each awaited before the next)."""

    nbytes: int
    iters: int
    put_gbps: float
    prepared_gbps: float

    @property
    def ratio(self) -> float:
        """The prepared rate over the plain put's."""
        return self.prepared_gbps / self.put_gbps


@dataclass(frozen=True)
class RunsResult:
    """An array of runs (``prepare_put_runs``): what preparing it and starting it the first
    time takes (median of ``tries`` fresh prepares), and the rate of the reposted starts."""

    runs: int
    run_bytes: int
    stride: int
    tries: int
    first_runs_per_s: float  # runs / (prepare + first start, awaited)
    reposted_runs_per_s: float


@dataclass
class BackendResult:
    """Everything measured for one backend."""

    name: str
    one_sided: bool
    sizes: list[SizeResult] = field(default_factory=list)
    latency: list[LatencyResult] = field(default_factory=list)
    batch: list[BatchResult] = field(default_factory=list)
    prepared: list[PreparedResult] = field(default_factory=list)
    runs: list[RunsResult] = field(default_factory=list)


@dataclass(frozen=True)
class DescListResult:
    """A peer library's batch: the same segments as :class:`BatchResult` in one transfer built
    from one descriptor list (prepared once, posted ``iters`` times)."""

    segments: int
    segment_bytes: int
    stride: int
    iters: int
    seg_per_s: float  # median of the timed posts
    calls: int = 1  # descriptor lists posted per transfer (a library may cap the entries per list)


@dataclass(frozen=True)
class SeparateResult:
    """A peer library's separate puts: the segments of :class:`BatchResult`, one transfer each,
    all submitted and then each waited for (as our single puts are all started, then gathered)."""

    segments: int
    segment_bytes: int
    stride: int
    puts_per_s: float
    window: int  # at most this many in flight (the library's cap per peer), else all of them


@dataclass
class PeerResult:
    """Another library measured the same way in the same run (e.g. NIXL), or why it was not.

    ``sizes`` and ``latency`` use the same records as a backend: op ``"put"`` / ``"get"`` are the
    peer's WRITE / READ with a handle prepared once and posted again for every transfer; latency
    variant ``"new handle"`` creates (and releases) a handle around every transfer.
    """

    name: str
    detail: str = ""  # version and how it was set up
    unavailable: str | None = None  # None: measured; else why not (not installed, or what failed)
    sizes: list[SizeResult] = field(default_factory=list)
    latency: list[LatencyResult] = field(default_factory=list)
    batch: list[DescListResult] = field(default_factory=list)
    separate: list[SeparateResult] = field(default_factory=list)


@dataclass(frozen=True)
class Ratio:
    """One figure of a backend of ours next to the same figure of a peer: ``ours / theirs``.

    For rates (GB/s, segments/s) a ratio above 1 means ours is faster; for latencies (us) a ratio
    below 1 means ours is faster.
    """

    backend: str
    peer: str
    measure: str  # e.g. "put 1 MiB"
    unit: str  # "GB/s", "segments/s", "puts/s" or "us"
    ours: float
    theirs: float

    @property
    def ratio(self) -> float:
        """``ours / theirs``."""
        return self.ours / self.theirs


def _put_gbps(sizes: list[SizeResult], size: int) -> float | None:
    """The put bandwidth measured at ``size``, if any."""
    return next((s.put_gbps for s in sizes if s.size == size), None)


def _put_median_us(latency: list[LatencyResult], nbytes: int) -> float | None:
    """The median latency of plain puts of ``nbytes``, if measured."""
    return next((x.median_us for x in latency if (x.op, x.nbytes, x.variant) == ("put", nbytes, "")), None)


def _reposted_us(peer: PeerResult, nbytes: int) -> float | None:
    """Microseconds per transfer of the peer's prepared WRITE handle reposted, at ``nbytes``: from
    its bandwidth table, else from its latency series (both post one handle again and again)."""
    gbps = _put_gbps(peer.sizes, nbytes)
    return nbytes / (gbps * 1e3) if gbps else _put_median_us(peer.latency, nbytes)


def ratios(backends: list[BackendResult], peer: PeerResult, config: BenchConfig) -> list[Ratio]:
    """Each backend's figures over the peer's: batch segments/s, separate puts/s, put GB/s at
    every table size, put median latency at every latency size, and our one-segment prepared put
    reposted against the peer's reposted handle of the same size (GB/s from 64 KiB up, us
    below). Figures either side lacks are left out."""
    out: list[Ratio] = []
    if peer.unavailable is not None:
        return out
    for b in backends:
        rows: list[tuple[str, str, float | None, float | None]] = []
        if b.batch and peer.batch and b.batch[0].segments == peer.batch[0].segments:
            x, d = b.batch[0], peer.batch[0]
            label = f"batch {x.segments} x {format_size(x.segment_bytes)}"
            rows.append((label, "segments/s", x.prepared_seg_per_s, d.seg_per_s))
        if b.batch and peer.separate and b.batch[0].segments == peer.separate[0].segments:
            x, s = b.batch[0], peer.separate[0]
            label = f"{x.segments} separate {format_size(x.segment_bytes)} puts"
            rows.append((label, "puts/s", x.single_seg_per_s, s.puts_per_s))
        for size in config.table_sizes:
            rows.append((f"put {format_size(size)}", "GB/s", _put_gbps(b.sizes, size), _put_gbps(peer.sizes, size)))
        for pr in b.prepared:
            theirs_us = _reposted_us(peer, pr.nbytes)
            if theirs_us is None:
                continue
            label = f"prepared put {format_size(pr.nbytes)}, reposted"
            ours_us = pr.nbytes / (pr.prepared_gbps * 1e3)
            if pr.nbytes >= 64 * KiB:
                rows.append((label, "GB/s", pr.prepared_gbps, pr.nbytes / (theirs_us * 1e3)))
            else:
                rows.append((label + " (time each)", "us", ours_us, theirs_us))
        for n in config.latency_sizes:
            ours, theirs = _put_median_us(b.latency, n), _put_median_us(peer.latency, n)
            rows.append((f"put {format_size(n)} median latency", "us", ours, theirs))
        for measure, unit, ours, theirs in rows:
            if ours is not None and theirs is not None and theirs > 0:
                out.append(Ratio(b.name, peer.name, measure, unit, ours, theirs))
    return out


def _size_json(s: SizeResult) -> dict[str, Any]:
    return {**dataclasses.asdict(s), "put_ratio": s.put_ratio, "get_ratio": s.get_ratio}


@dataclass
class BenchReport:
    """One run: machine facts, the configuration, the memcpy baseline, each backend and each peer."""

    config: BenchConfig
    machine: dict[str, Any]
    memcpy_gbps: dict[int, float]
    backends: list[BackendResult]
    skipped: dict[str, str]
    elapsed_s: float
    peers: list[PeerResult] = field(default_factory=list)

    def ratios(self) -> list[Ratio]:
        """Every backend against every measured peer (see :func:`ratios`)."""
        return [r for p in self.peers for r in ratios(self.backends, p, self.config)]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of everything in the report (ratios included).

        Schema 2: ``config.latency_sizes`` (a list) replaced ``config.latency_bytes``; ``peers``
        and ``ratios`` are new. A peer's ``separate`` (its separate puts) may be empty.
        """
        return {
            "schema": 2,
            **self.machine,
            "config": dataclasses.asdict(self.config),
            "memcpy": [{"size": n, "gbps": g} for n, g in sorted(self.memcpy_gbps.items())],
            "backends": {
                b.name: {
                    "one_sided": b.one_sided,
                    "sizes": [_size_json(s) for s in b.sizes],
                    "latency": [dataclasses.asdict(lat) for lat in b.latency],
                    "batch": [{**dataclasses.asdict(x), "speedup": x.speedup} for x in b.batch],
                    "prepared": [{**dataclasses.asdict(x), "ratio": x.ratio} for x in b.prepared],
                    "runs": [dataclasses.asdict(x) for x in b.runs],
                }
                for b in self.backends
            },
            "skipped": dict(self.skipped),
            "peers": {
                p.name: {
                    "detail": p.detail,
                    "unavailable": p.unavailable,
                    "sizes": [_size_json(s) for s in p.sizes],
                    "latency": [dataclasses.asdict(lat) for lat in p.latency],
                    "batch": [dataclasses.asdict(x) for x in p.batch],
                    "separate": [dataclasses.asdict(x) for x in p.separate],
                }
                for p in self.peers
            },
            "ratios": [{**dataclasses.asdict(r), "ratio": r.ratio} for r in self.ratios()],
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


_TABLE_HEADER = (
    f"{'size':>9} | {'put GB/s':>9} | {'get GB/s':>9} | {'memcpy GB/s':>11} | "
    f"{'put/memcpy':>10} | {'get/memcpy':>10} | {'iters':>5}"
)


def _size_table(sizes: list[SizeResult]) -> list[str]:
    """The bandwidth table of one backend or peer."""
    lines = [_TABLE_HEADER, "-" * len(_TABLE_HEADER)]
    for s in sizes:
        lines.append(
            f"{format_size(s.size):>9} | {s.put_gbps:>9.2f} | {s.get_gbps:>9.2f} | {s.memcpy_gbps:>11.2f} | "
            f"{s.put_ratio:>10.2f} | {s.get_ratio:>10.2f} | {s.iters:>5}"
        )
    return lines


def _latency_lines(latency: list[LatencyResult]) -> list[str]:
    return [
        f"  latency {lat.op} {format_size(lat.nbytes)}{f' ({lat.variant})' if lat.variant else ''}: "
        f"median {lat.median_us:.1f} us, p99 {lat.p99_us:.1f} us ({lat.iters} {lat.op}s)"
        for lat in latency
    ]


def _format_figure(value: float, unit: str) -> str:
    if unit in ("segments/s", "puts/s"):
        return f"{value / 1e3:.1f}k"
    return f"{value:.2f}" if unit == "GB/s" else f"{value:.1f}"


def _ratio_table(rows: list[Ratio]) -> list[str]:
    """``ours / theirs`` per backend and measure."""
    peer = rows[0].peer
    header = f"{'backend':<7} | {'measure':<40} | {'unit':<10} | {'transport':>10} | {peer:>10} | {'ratio':>6}"
    lines = [
        f"transport / {peer} (rates: above 1 = transport faster; latencies: below 1 = transport faster)",
        header,
        "-" * len(header),
    ]
    for r in rows:
        lines.append(
            f"{r.backend:<7} | {r.measure:<40} | {r.unit:<10} | {_format_figure(r.ours, r.unit):>10} | "
            f"{_format_figure(r.theirs, r.unit):>10} | {r.ratio:>6.2f}"
        )
    return lines


def _rate(nbytes: int, gbps: float) -> str:
    """GB/s from 64 KiB up, the time per transfer below (where bandwidth says little)."""
    return f"{gbps:.2f} GB/s" if nbytes >= 64 << 10 else f"{nbytes / (gbps * 1e3):.1f} us each"


def format_report(report: BenchReport) -> str:
    """Fixed-width tables, one per backend (then its latency and batch lines), one per peer, and
    the ratios of ours to each peer's."""
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
    for b in report.backends:
        kind = "one-sided" if b.one_sided else "served by the target's agent"
        lines += ["", f"backend {b.name} ({kind})", *_size_table(b.sizes), *_latency_lines(b.latency)]
        for x in b.batch:
            lines.append(
                f"  batch of {x.segments} x {format_size(x.segment_bytes)} at a {format_size(x.stride)} stride: "
                f"prepared put {x.prepared_seg_per_s / 1e3:.1f}k segments/s, single puts "
                f"{x.single_seg_per_s / 1e3:.1f}k segments/s ({x.speedup:.1f}x)"
            )
        for pr in b.prepared:
            lines.append(f"  prepared put of one {format_size(pr.nbytes)} segment, reposted: "
                         f"{_rate(pr.nbytes, pr.prepared_gbps)}, plain put {_rate(pr.nbytes, pr.put_gbps)} "
                         f"({pr.ratio:.2f}x)")
        for r in b.runs:
            lines.append(f"  runs: {r.runs} x {format_size(r.run_bytes)} at a {format_size(r.stride)} stride, "
                         f"prepare_put_runs + first start {r.first_runs_per_s / 1e6:.2f}M runs/s "
                         f"(median of {r.tries}), reposted {r.reposted_runs_per_s / 1e6:.2f}M runs/s")
    for name, reason in report.skipped.items():
        lines += ["", f"backend {name} skipped: {reason}"]
    for p in report.peers:
        if p.unavailable is not None:
            lines += ["", f"{p.name}: {p.unavailable}"]
            continue
        lines += ["", f"peer {p.name} ({p.detail})", *_size_table(p.sizes), *_latency_lines(p.latency)]
        for d in p.batch:
            lines.append(
                f"  batch of {d.segments} x {format_size(d.segment_bytes)} at a {format_size(d.stride)} stride: "
                + (f"one transfer from a {d.segments}-entry descriptor list" if d.calls == 1 else
                   f"{d.calls} batch calls (the library's cap on transfers in flight per peer)")
                + f", {d.seg_per_s / 1e3:.1f}k segments/s (prepared once, median of {d.iters} posts)"
            )
        for s in p.separate:
            lines.append(
                f"  {s.segments} separate {format_size(s.segment_bytes)} puts at a {format_size(s.stride)} stride, "
                f"submitted {s.window} at a time, each waited for: {s.puts_per_s / 1e3:.1f}k puts/s"
            )
    for p in report.peers:
        table = ratios(report.backends, p, report.config)
        if table:
            lines += ["", *_ratio_table(table)]
    lines += ["", f"total {report.elapsed_s:.1f} s"]
    return "\n".join(lines)
