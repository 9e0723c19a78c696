"""Micro-benchmark: put/get bandwidth and small-transfer latency per backend, with a baseline.

Layout of one run (``python -m transport bench``):

* a **target** process (``python -m transport._bench serve ...``, a real separate process)
  opens a Transport on a temporary ``file://`` store, allocates one destination region of the
  largest size with :meth:`Transport.empty` (shareable, pre-faulted) and then only waits for the
  exit doorbell: its application code takes no part in any transfer;
* this process is the **initiator**: under trio, one Transport per backend (``backends=(b,)``)
  puts into and gets from the target's region, one transfer at a time (each awaited before the
  next), after a warm-up, and reports the median;
* in the same run, the **baseline**: a single-threaded native ``memcpy`` between two pre-faulted
  buffers of this process, at the same sizes; tables show backend GB/s / memcpy GB/s.

GB/s means 1e9 bytes per second. Nothing here asserts on timings: it measures and reports.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import logging
import math
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence, TypeVar

import torch

log = logging.getLogger(__name__)
_T = TypeVar("_T")

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_SIZES: tuple[int, ...] = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1 * GiB)
DEFAULT_BACKENDS: tuple[str, ...] = ("ipc", "ucx", "tcp")

TARGET_NAME = "bench-target"
REGION_KEY = "bench.dst"
EXIT_SIGNAL = "bench.exit"

# Automatic iteration count: about this many bytes per (operation, size), within the bounds.
_AUTO_BYTES = 8 * GiB
_AUTO_MIN_ITERS, _AUTO_MAX_ITERS = 5, 50
_LATENCY_WARMUP = 50
_TARGET_START_TIMEOUT_S = 60.0  # the target imports torch and pre-faults the largest region
_TARGET_EXIT_TIMEOUT_S = 20.0
_PARENT_POLL_S = 0.5

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1 << 40}


class BenchError(RuntimeError):
    """The benchmark could not run (bad arguments, target process failed, wrong data)."""


def parse_size(text: str) -> int:
    """Parses ``"1MiB"``, ``"4M"``, ``"512KiB"``, ``"1GiB"`` or a plain byte count.

    Units are binary (``M`` = ``MiB`` = 2**20 bytes).

    Raises:
        ValueError: not a size, or not a positive whole number of bytes.
    """
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 1MiB, 64M, 1GiB or a byte count)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0 or value != int(value):
        raise ValueError(f"size must be a positive whole number of bytes, got {text!r}")
    return int(value)


def parse_sizes(text: str) -> tuple[int, ...]:
    """Parses a comma-separated list of sizes (see :func:`parse_size`); sorted, deduplicated."""
    sizes = {parse_size(part) for part in text.split(",") if part.strip()}
    if not sizes:
        raise ValueError(f"no sizes in {text!r}")
    return tuple(sorted(sizes))


def format_size(n: int) -> str:
    """``1048576`` -> ``"1 MiB"``; sizes that are not whole units are shown in bytes."""
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty sequence."""
    s = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(s)))
    return s[rank - 1]


# -------------------------------------------------------------------------------------------------
# Configuration and results


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
        return self.put_gbps / self.memcpy_gbps

    @property
    def get_ratio(self) -> float:
        return self.get_gbps / self.memcpy_gbps


@dataclass(frozen=True)
class LatencyResult:
    """Latency of small transfers, each awaited before the next."""

    op: str
    nbytes: int
    iters: int
    median_us: float
    p99_us: float


@dataclass
class BackendResult:
    """Everything measured for one backend."""

    name: str
    one_sided: bool
    sizes: list[SizeResult] = field(default_factory=list)
    latency: list[LatencyResult] = field(default_factory=list)


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
    from . import __version__

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "transport_version": __version__,
    }


# -------------------------------------------------------------------------------------------------
# Formatting


def format_report(report: BenchReport) -> str:
    """Fixed-width tables, one per backend, then latency lines."""
    m = report.machine
    lines = [
        f"transport {m['transport_version']} bench on {m['hostname']} ({m['cpu_model']}, {m['cpu_count']} cpus), "
        f"torch {m['torch_version']}, {m['date']}",
        "GB/s = 1e9 bytes/s; median of the timed transfers after warm-up, one transfer in flight at a time.",
        "memcpy = single-threaded native memcpy between two pre-faulted buffers of this process, same run;",
        f"ipc copies run on the Transport's {report.config.copy_threads} native copy threads, and ucx splits large "
        "transfers across its lanes (2 worker threads by default), so their ratios to memcpy may exceed 1.",
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
    for name, reason in report.skipped.items():
        lines += ["", f"backend {name} skipped: {reason}"]
    lines += ["", f"total {report.elapsed_s:.1f} s"]
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------
# Measurement (initiator side)


def _prefaulted(nbytes: int, value: int) -> torch.Tensor:
    """A uint8 tensor whose pages are all touched, so no page fault lands inside a timing."""
    return torch.empty(nbytes, dtype=torch.uint8).fill_(value)


def measure_memcpy(src: torch.Tensor, dst: torch.Tensor, size: int, iters: int, warmup: int) -> float:
    """Median GB/s of ``memcpy(dst, src, size)`` (native, single-threaded, GIL released)."""
    from ._native import load

    c = load()
    s, d = src.data_ptr(), dst.data_ptr()
    for _ in range(warmup):
        c.memcpy(d, s, size)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        c.memcpy(d, s, size)
        times.append(time.perf_counter() - t0)
    return size / _median(times) / 1e9


async def _timed(op: Callable[[], Awaitable[object]], iters: int, warmup: int) -> list[float]:
    """Runs ``op`` ``warmup`` times, then ``iters`` times; returns the timed durations (s)."""
    for _ in range(warmup):
        await op()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        await op()
        times.append(time.perf_counter() - t0)
    return times


class LoggedProcess:
    """A benchmark's helper process whose output goes to a log file, quoted when it fails.
    :meth:`stop` always leaves it joined: it waits a bounded time for a clean exit, then kills it.
    (Also used by ``benchmarks/gpu_bench.py``.)"""

    def __init__(self, cmd: Sequence[str], log_path: Path, *, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        try:
            self.proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        except BaseException:
            self._log.close()
            raise
        log.info("bench helper process started: pid %d", self.proc.pid)

    def failure(self) -> str | None:
        """None while it runs, else how it ended and the tail of its output."""
        rc = self.proc.poll()
        if rc is None:
            return None
        return f"the target process exited with code {rc}; its output ends with:\n{self.output_tail()}"

    def output_tail(self, limit: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-limit:].decode(errors="replace")
        except OSError as exc:
            return f"(cannot read {self.log_path}: {exc})"

    def stop(self, timeout: float = _TARGET_EXIT_TIMEOUT_S) -> int:
        """Joins the process (killing it after ``timeout`` s); returns its exit code."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("bench helper process (pid %d) did not exit within %gs; killing it", self.proc.pid, timeout)
            self.proc.kill()
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        """Kills the process (if still running) and joins it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.stop()

    def supervise(self, call: Callable[[], _T], error: type[Exception] = BenchError) -> _T:
        """Runs ``call`` while the process serves it: kills the process if ``call`` fails, else
        joins it and raises ``error`` (with the tail of its output) unless it exited with 0."""
        try:
            result = call()
        except BaseException:
            self.kill()
            raise
        rc = self.stop()
        if rc != 0:
            raise error(f"the target process exited with code {rc}; its output ends with:\n{self.output_tail()}")
        return result


class _TargetProcess(LoggedProcess):
    """The target: a separate process serving one region until the exit doorbell rings."""

    def __init__(self, store_url: str, config: BenchConfig, backends: Sequence[str], log_path: Path) -> None:
        cmd = [
            sys.executable, "-m", "transport._bench", "serve",
            "--store", store_url,
            "--name", TARGET_NAME,
            "--nbytes", str(config.region_bytes),
            "--backends", ",".join(backends),
            "--timeout", str(config.timeout),
            "--lifetime", str(_lifetime_bound(config)),
            "--parent", str(os.getpid()),
        ]  # fmt: skip
        super().__init__(cmd, log_path)


def _lifetime_bound(config: BenchConfig) -> float:
    """An upper bound on a whole run (every transfer is bounded by ``config.timeout``), so the
    target exits by itself even if no doorbell ever comes."""
    per_backend = sum(config.iters_for(n) + config.warmup for n in config.sizes) * 2 + config.latency_iters * 2 + 2
    return _TARGET_START_TIMEOUT_S + config.timeout * (per_backend * len(config.backends) + 2)


async def _wait_for_target(t: Any, target: _TargetProcess, nbytes: int, timeout: float) -> None:
    """Waits until the target has published a region of ``nbytes`` under REGION_KEY.

    Raises:
        BenchError: the target exited, or did not publish in time.
    """
    import trio

    from ._errors import PeerNotFoundError

    with trio.move_on_after(timeout):
        while True:
            failure = target.failure()
            if failure is not None:
                raise BenchError(failure)
            try:
                peer = await t.peer(TARGET_NAME, timeout=_PARENT_POLL_S)
            except PeerNotFoundError:
                continue
            region = peer.regions.get(REGION_KEY)
            if region is not None and region.nbytes >= nbytes:
                return
            await trio.sleep(0.02)
    raise BenchError(
        f"the target did not publish its {nbytes}-byte region within {timeout:g}s; "
        f"its output ends with:\n{target.output_tail()}"
    )


async def _measure_backend(
    t: Any,
    name: str,
    config: BenchConfig,
    target: _TargetProcess,
    src: torch.Tensor,
    dst: torch.Tensor,
    memcpy_gbps: dict[int, float],
) -> BackendResult:
    """Bandwidth at every size and small-transfer latency, through Transport ``t``.

    Raises:
        BenchError: the target process exited meanwhile, or data came back wrong.
    """
    from .backends import REGISTRY

    def check_target() -> None:
        # Polling also reaps a dead target: an unreaped (zombie) child still looks alive to
        # the library, and puts into its shared mapping would keep "succeeding".
        failure = target.failure()
        if failure is not None:
            raise BenchError(f"{name}: {failure}")

    result = BackendResult(name, REGISTRY[name].one_sided)
    for i, size in enumerate(config.sizes):
        iters = config.iters_for(size)
        value = (7 * i + 3 * len(name) + 11) % 251 + 1  # differs per size: stale bytes would show
        s_view, d_view = src[:size], dst[:size]
        s_view.fill_(value)
        d_view.fill_(0)
        put_times = await _timed(functools.partial(t.put, s_view, TARGET_NAME, key=REGION_KEY), iters, config.warmup)
        get_times = await _timed(functools.partial(t.get, d_view, TARGET_NAME, key=REGION_KEY), iters, config.warmup)
        # Not timed: the bytes that came back are the bytes that were put.
        if not torch.equal(s_view, d_view):
            raise BenchError(f"{name}: {format_size(size)} read back from the target differs from what was put")
        check_target()
        sr = SizeResult(
            size=size,
            iters=iters,
            put_gbps=size / _median(put_times) / 1e9,
            get_gbps=size / _median(get_times) / 1e9,
            memcpy_gbps=memcpy_gbps[size],
        )
        log.info("%s %s: put %.2f GB/s, get %.2f GB/s", name, format_size(size), sr.put_gbps, sr.get_gbps)
        result.sizes.append(sr)

    n = config.latency_bytes
    small_src, small_dst = src[:n], dst[:n]
    warmup = min(_LATENCY_WARMUP, config.latency_iters)
    for op, call in (
        ("put", functools.partial(t.put, small_src, TARGET_NAME, key=REGION_KEY)),
        ("get", functools.partial(t.get, small_dst, TARGET_NAME, key=REGION_KEY)),
    ):
        times = await _timed(call, config.latency_iters, warmup)
        us = [x * 1e6 for x in times]
        result.latency.append(LatencyResult(op, n, len(us), _median(us), _percentile(us, 99)))
    check_target()
    return result


async def _initiate(
    config: BenchConfig,
    backends: Sequence[str],
    store_url: str,
    target: _TargetProcess,
    src: torch.Tensor,
    dst: torch.Tensor,
    memcpy_gbps: dict[int, float],
) -> list[BackendResult]:
    """The initiator: one Transport per backend, measured in turn; then rings the exit bell."""
    from ._transport import Transport

    results = []
    for i, name in enumerate(backends):
        async with Transport(
            f"bench-initiator-{name}",
            store=store_url,
            backends=(name,),
            timeout=config.timeout,
            copy_threads=config.copy_threads,
        ) as t:
            start_timeout = _TARGET_START_TIMEOUT_S + config.timeout if i == 0 else config.timeout
            await _wait_for_target(t, target, config.region_bytes, start_timeout)
            results.append(await _measure_backend(t, name, config, target, src, dst, memcpy_gbps))
            if i == len(backends) - 1:
                await t.signal(TARGET_NAME, EXIT_SIGNAL, 1)
    return results


def run(config: BenchConfig) -> BenchReport:
    """Runs the benchmark (blocking; starts and always joins the target process).

    Returns:
        The report; print it with :func:`format_report`.

    Raises:
        BenchError: the target failed, a transfer failed, or data came back wrong.
        ValueError: an unknown backend name.
    """
    import trio

    from .backends import PLANNED, REGISTRY, availability

    started = time.perf_counter()
    avail = availability()
    unknown = [b for b in config.backends if b not in avail]
    if unknown:
        raise ValueError(f"unknown backend(s) {', '.join(unknown)}; known: {', '.join([*REGISTRY, *PLANNED])}")
    backends = [b for b in config.backends if avail[b] is None]
    skipped = {b: str(avail[b]) for b in config.backends if avail[b] is not None}
    if not backends:
        raise BenchError("none of the requested backends is available: " + "; ".join(f"{b}: {r}" for b, r in skipped.items()))

    nbytes = config.region_bytes
    src = _prefaulted(nbytes, 1)
    dst = _prefaulted(nbytes, 2)
    memcpy_gbps = {n: measure_memcpy(src, dst, n, config.iters_for(n), max(1, config.warmup)) for n in config.sizes}

    with tempfile.TemporaryDirectory(prefix="transport-bench-") as tmp:
        store_url = f"file://{tmp}/store"
        target = _TargetProcess(store_url, config, backends, Path(tmp) / "target.log")
        results = target.supervise(lambda: trio.run(_initiate, config, backends, store_url, target, src, dst, memcpy_gbps))
    return BenchReport(
        config=config,
        machine=machine_info(),
        memcpy_gbps=memcpy_gbps,
        backends=results,
        skipped=skipped,
        elapsed_s=time.perf_counter() - started,
    )


# -------------------------------------------------------------------------------------------------
# The target process


async def serve(
    store: str,
    name: str,
    nbytes: int,
    backends: Sequence[str],
    timeout: float,
    lifetime: float,
    parent: int | None,
) -> None:
    """The target: registers ``nbytes`` shareable bytes and waits for the exit doorbell.

    Returns when the doorbell rings. Its application code does nothing else, so what the
    initiator measures is the one-sided path (for ``tcp``: the background agent alone).

    Raises:
        BenchError: the parent process went away, or no doorbell came within ``lifetime`` s.
    """
    import trio

    from ._errors import TransferTimeoutError
    from ._transport import Transport

    async with Transport(name, store=store, backends=tuple(backends), timeout=timeout) as t:
        t.empty(REGION_KEY, (nbytes,), dtype=torch.uint8)
        async with trio.open_nursery() as nursery:

            async def watch_parent() -> None:
                # An orphaned target (the bench was killed) exits by itself.
                while parent is None or os.getppid() == parent:
                    await trio.sleep(_PARENT_POLL_S)
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch_parent)
            try:
                await t.wait_signal(EXIT_SIGNAL, at_least=1, timeout=lifetime)
            except TransferTimeoutError as exc:
                raise BenchError(f"no exit doorbell within {lifetime:g}s") from exc
            nursery.cancel_scope.cancel()
        if t.signal_value(EXIT_SIGNAL) is None:
            raise BenchError(f"parent process {parent} went away")


def serve_main(argv: Sequence[str] | None = None) -> int:
    """Entry of the target process: ``python -m transport._bench serve ...``."""
    import trio

    p = argparse.ArgumentParser(prog="python -m transport._bench", description="bench target process (internal)")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--store", required=True)
    s.add_argument("--name", default=TARGET_NAME)
    s.add_argument("--nbytes", type=int, required=True)
    s.add_argument("--backends", required=True)
    s.add_argument("--timeout", type=float, default=120.0)
    s.add_argument("--lifetime", type=float, default=3600.0)
    s.add_argument("--parent", type=int, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="bench-target %(levelname)s %(name)s: %(message)s")
    backends = tuple(b for b in args.backends.split(",") if b)
    try:
        trio.run(serve, args.store, args.name, args.nbytes, backends, args.timeout, args.lifetime, args.parent)
    except BenchError as exc:
        print(f"bench target: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(serve_main())
