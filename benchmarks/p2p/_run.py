"""Point-to-point micro-benchmark: put/get bandwidth and small-transfer latency per backend, with a baseline.

    python -m transport bench --sizes 1MiB,256MiB        # the library's thin entry to this module
    python -m benchmarks.p2p --backends ipc --json out.json
    python -m transport bench --peers nixl               # NIXL measured the same way, same run

Layout of one run:

* a **target** process (``python -m benchmarks.p2p._target ...``, a real separate process)
  opens a Transport on a temporary ``file://`` store, allocates one destination region of the
  largest size with :meth:`transport.Transport.empty` (shareable, pre-faulted) and then only waits
  for the exit doorbell: its application code takes no part in any transfer;
* this process is the **initiator**: under trio, one Transport per backend (``backends=(b,)``)
  puts into and gets from the target's region, one transfer at a time (each awaited before the
  next), after a warm-up, and reports the median: bandwidth at every size (1 MiB always among
  them), the latency of small puts and gets (8 B and 4 KiB by default), and a batch of 10,000
  segments of 4 KiB at an 8 KiB stride as one prepared put (the region is always large enough),
  a one-segment prepared put reposted against plain puts of the same bytes (8 B, 4 KiB, 1 MiB,
  8 MiB), and ``prepare_put_runs`` of 100,000 runs of 64 B (prepare + first start, runs/s);
* in the same run, the **baseline**: a single-threaded native ``memcpy`` (the C library's)
  between two pre-faulted buffers of this process, at the same sizes; tables show backend GB/s /
  memcpy GB/s;
* with ``--peers nixl,mooncake``, after our backends: NIXL (UCX backend, DRAM) and Mooncake
  Transfer Engine (TCP transport, DRAM), each with its own target process, measured the same way
  (:mod:`._nixl`, :mod:`._mooncake`), and a table of ratios (ours / theirs) per peer. When a peer
  is not installed, or fails here, the report says why and the rest of the run stands.

GB/s means 1e9 bytes per second. Nothing here asserts on timings: it measures and reports.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import numpy as np
import torch

import transport

from ..common.batch import BATCH_SEGMENT_BYTES, BATCH_SEGMENTS, BATCH_STRIDE
from ..common.capabilities import available_backends, is_one_sided
from ..common.errors import BenchError
from ..common.procs import CHECKOUT, LoggedProcess, checkout_env, module_command
from ..common.sizes import format_size, parse_size, parse_sizes
from ..common.stats import median, percentile
from . import _mooncake, _nixl
from ._report import (
    DEFAULT_LATENCY_SIZES,
    DEFAULT_SIZES,
    KNOWN_PEERS,
    BackendResult,
    BatchResult,
    BenchConfig,
    BenchReport,
    LatencyResult,
    PeerResult,
    PreparedResult,
    RunsResult,
    SizeResult,
    format_report,
    machine_info,
)
from ._target import EXIT_SIGNAL, PARENT_POLL_S, REGION_KEY, TARGET_NAME

log = logging.getLogger(__name__)

_LATENCY_WARMUP = 50
_BATCH_ITERS = 5
# A prepared put of one segment against plain puts, at these sizes (those the region holds).
_PREPARED_SIZES = (8, 4 << 10, 1 << 20, 8 << 20)
# An array of runs: RUNS runs of RUN_BYTES at a RUN_STRIDE stride (no two adjacent: nothing
# coalesces), prepared afresh RUNS_TRIES times.
RUNS, RUN_BYTES, RUN_STRIDE, RUNS_TRIES = 100_000, 64, 128, 3
# The peers of ``--peers``, each measured with its own target process after ours has gone.
_PEERS = {_nixl.PEER_NAME: _nixl, _mooncake.PEER_NAME: _mooncake}
_TARGET_START_TIMEOUT_S = 60.0  # the target imports torch and pre-faults the largest region


def _prefaulted(nbytes: int, value: int) -> torch.Tensor:
    """A uint8 tensor whose pages are all touched, so no page fault lands inside a timing."""
    return torch.empty(nbytes, dtype=torch.uint8).fill_(value)


@functools.cache
def _libc_memcpy() -> Callable[..., object]:
    """The C library's ``memcpy`` (single-threaded; ctypes releases the GIL around the call)."""
    fn = ctypes.CDLL(None).memcpy
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    fn.restype = None
    return fn


def measure_memcpy(src: torch.Tensor, dst: torch.Tensor, size: int, iters: int, warmup: int) -> float:
    """Median GB/s of ``memcpy(dst, src, size)`` (native, single-threaded, GIL released).

    Args:
        src: source buffer of at least ``size`` bytes (pre-faulted).
        dst: destination buffer of at least ``size`` bytes (pre-faulted).
        size: bytes per copy.
        iters: timed copies.
        warmup: untimed copies first.

    Returns:
        Bandwidth in GB/s (1e9 bytes/s) of the median copy.
    """
    copy = _libc_memcpy()
    # Arguments converted once, outside the timing: only the call and the copy are timed.
    args = (ctypes.c_void_p(dst.data_ptr()), ctypes.c_void_p(src.data_ptr()), ctypes.c_size_t(size))
    for _ in range(warmup):
        copy(*args)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        copy(*args)
        times.append(time.perf_counter() - t0)
    return size / median(times) / 1e9


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


class _TargetProcess(LoggedProcess):
    """The target: a separate process serving one region until the exit doorbell rings."""

    def __init__(self, store_url: str, config: BenchConfig, backends: Sequence[str], log_path: Path) -> None:
        cmd = module_command(
            f"{__package__}._target",
            "--store", store_url,
            "--name", TARGET_NAME,
            "--nbytes", str(config.region_bytes),
            "--backends", ",".join(backends),
            "--timeout", str(config.timeout),
            "--lifetime", str(_lifetime_bound(config)),
            "--parent", str(os.getpid()),
        )  # fmt: skip
        super().__init__(cmd, log_path, env=checkout_env(), cwd=CHECKOUT)


def _lifetime_bound(config: BenchConfig) -> float:
    """An upper bound on a whole run (every transfer is bounded by ``config.timeout``), so the
    target exits by itself even if no doorbell ever comes."""
    per_backend = sum(config.iters_for(n) + config.warmup for n in config.table_sizes) * 2
    per_backend += len(config.latency_sizes) * 2 * (config.latency_iters + _LATENCY_WARMUP)
    per_backend += _BATCH_ITERS + 1 + 1 + 2  # the batch: warm-up, timed starts, single puts (one gather)
    per_backend += 2 * len(_PREPARED_SIZES) * (2000 + 4 * config.warmup)  # prepared vs put
    per_backend += RUNS_TRIES + _BATCH_ITERS + 2  # the runs
    return _TARGET_START_TIMEOUT_S + config.timeout * (per_backend * len(config.backends) + 2)


async def _wait_for_target(t: transport.Transport, target: _TargetProcess, nbytes: int, timeout: float) -> None:
    """Waits until the target has published a region of ``nbytes`` under REGION_KEY.

    Raises:
        BenchError: the target exited, or did not publish in time.
    """
    import trio

    with trio.move_on_after(timeout):
        while True:
            failure = target.failure()
            if failure is not None:
                raise BenchError(failure)
            try:
                peer = await t.peer(TARGET_NAME, timeout=PARENT_POLL_S)
            except transport.PeerNotFoundError:
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
    t: transport.Transport,
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
    def check_target() -> None:
        # Polling also reaps a dead target: an unreaped (zombie) child still looks alive to
        # the library, and puts into its shared mapping would keep "succeeding".
        failure = target.failure()
        if failure is not None:
            raise BenchError(f"{name}: {failure}")

    result = BackendResult(name, is_one_sided(name))
    for i, size in enumerate(config.table_sizes):
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
            put_gbps=size / median(put_times) / 1e9,
            get_gbps=size / median(get_times) / 1e9,
            memcpy_gbps=memcpy_gbps[size],
        )
        log.info("%s %s: put %.2f GB/s, get %.2f GB/s", name, format_size(size), sr.put_gbps, sr.get_gbps)
        result.sizes.append(sr)

    warmup = min(_LATENCY_WARMUP, config.latency_iters)
    for n in config.latency_sizes:
        small_src, small_dst = src[:n], dst[:n]
        for op, call in (
            ("put", functools.partial(t.put, small_src, TARGET_NAME, key=REGION_KEY)),
            ("get", functools.partial(t.get, small_dst, TARGET_NAME, key=REGION_KEY)),
        ):
            times = await _timed(call, config.latency_iters, warmup)
            us = [x * 1e6 for x in times]
            result.latency.append(LatencyResult(op, n, len(us), median(us), percentile(us, 99)))
        check_target()
    batch = await _measure_batch(t, config, src)
    if batch is not None:
        result.batch.append(batch)
    check_target()
    result.prepared = await _measure_prepared(t, config, src)
    check_target()
    runs = await _measure_runs(t, config, src)
    if runs is not None:
        result.runs.append(runs)
    check_target()
    return result


async def _measure_prepared(t: transport.Transport, config: BenchConfig, src: torch.Tensor) -> list[PreparedResult]:
    """A one-segment prepared put, started again and again (as NIXL reposts a prepared
    handle), against plain puts of the same bytes; the two interleaved in rounds, so that
    both see the same machine."""
    out = []
    for size in _PREPARED_SIZES:
        if size > min(config.region_bytes, src.numel()):
            continue
        iters = max(20, min(config.iters_for(size), 2000))
        piece = src[:size]
        prepared = t.prepare_put(TARGET_NAME, [(piece, REGION_KEY, 0)])
        put = functools.partial(t.put, piece, TARGET_NAME, key=REGION_KEY)
        puts, preps = [], []
        for _ in range(4):  # rounds
            puts += await _timed(put, iters // 4, config.warmup)
            preps += await _timed(prepared.start, iters // 4, config.warmup)
        out.append(PreparedResult(size, len(puts), size / median(puts) / 1e9, size / median(preps) / 1e9))
    return out


async def _measure_runs(t: transport.Transport, config: BenchConfig, src: torch.Tensor) -> RunsResult | None:
    """``prepare_put_runs`` of RUNS runs, prepare plus first start (awaited), RUNS_TRIES times
    with a fresh prepare each; then that transfer reposted. Checks the bytes landed."""
    n = min(RUNS, (config.region_bytes - RUN_BYTES) // RUN_STRIDE + 1, src.numel() // RUN_BYTES)
    if n < 2:
        return None
    idx = np.arange(n, dtype=np.int64)
    runs = np.stack([idx * RUN_BYTES, idx * RUN_STRIDE, np.full(n, RUN_BYTES)], axis=1)
    firsts = []
    prepared = None
    for _ in range(RUNS_TRIES):
        t0 = time.perf_counter()
        prepared = t.prepare_put_runs(TARGET_NAME, src, REGION_KEY, runs)
        await prepared.start()
        firsts.append(time.perf_counter() - t0)
    assert prepared is not None
    reposted = await _timed(prepared.start, _BATCH_ITERS, 1)
    back = torch.empty(RUN_BYTES, dtype=torch.uint8)
    await t.get(back, TARGET_NAME, key=REGION_KEY, offset=int(runs[-1, 1]))
    if not torch.equal(back, src[int(runs[-1, 0]) : int(runs[-1, 0]) + RUN_BYTES]):
        raise BenchError("the last run read back from the target differs from what was put")
    return RunsResult(n, RUN_BYTES, RUN_STRIDE, RUNS_TRIES, n / median(firsts), n / median(reposted))


async def _measure_batch(t: transport.Transport, config: BenchConfig, src: torch.Tensor) -> BatchResult | None:
    """10,000 segments of 4 KiB at an 8 KiB stride (the region always holds them): one prepared
    put started ``_BATCH_ITERS`` times, against the same segments as single puts."""
    size, stride = BATCH_SEGMENT_BYTES, BATCH_STRIDE
    n = min(BATCH_SEGMENTS, (config.region_bytes - size) // stride + 1, src.numel() // size)
    if n < 2:
        return None
    items = [(src[i * size : (i + 1) * size], REGION_KEY, i * stride) for i in range(n)]
    prepared = t.prepare_put(TARGET_NAME, items)
    times = await _timed(prepared.start, _BATCH_ITERS, 1)

    async def singles() -> None:
        await transport.gather(*[t.put(s, TARGET_NAME, key=REGION_KEY, offset=o) for s, _, o in items])

    single = await _timed(singles, 1, 0)
    return BatchResult(n, size, stride, n / median(times), n / median(single))


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
    results = []
    for i, name in enumerate(backends):
        async with transport.Transport(
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

    started = time.perf_counter()
    avail = available_backends()
    unknown = [b for b in config.backends if b not in avail]
    if unknown:
        raise ValueError(f"unknown backend(s) {', '.join(unknown)}; known: {', '.join(avail)}")
    backends = [b for b in config.backends if avail[b] is None]
    skipped = {b: str(avail[b]) for b in config.backends if avail[b] is not None}
    if not backends:
        reasons = "; ".join(f"{b}: {r}" for b, r in skipped.items())
        raise BenchError(f"none of the requested backends is available: {reasons}")

    nbytes = config.region_bytes
    src = _prefaulted(nbytes, 1)
    dst = _prefaulted(nbytes, 2)
    memcpy_gbps = {
        n: measure_memcpy(src, dst, n, config.iters_for(n), max(1, config.warmup)) for n in config.table_sizes
    }

    peers: list[PeerResult] = []
    with tempfile.TemporaryDirectory(prefix="transport-bench-") as tmp:
        store_url = f"file://{tmp}/store"
        target = _TargetProcess(store_url, config, backends, Path(tmp) / "target.log")
        initiate = functools.partial(trio.run, _initiate, config, backends, store_url, target, src, dst, memcpy_gbps)
        results = target.supervise(initiate)
        # After our target has gone (its region freed): each peer with its own target process.
        for name in config.peers:
            peers.append(_PEERS[name].measure(config, src, dst, memcpy_gbps, Path(tmp)))
    return BenchReport(
        config=config,
        machine=machine_info(),
        memcpy_gbps=memcpy_gbps,
        backends=results,
        skipped=skipped,
        elapsed_s=time.perf_counter() - started,
        peers=peers,
    )


# -------------------------------------------------------------------------------------------------
# Command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the benchmark's options to ``p`` (``python -m transport bench`` has the same ones)."""
    p.add_argument(
        "--backends",
        default="ipc,ucx,tcp",
        help="comma-separated, in order (default: ipc,ucx,tcp; unavailable ones are skipped)",
    )
    p.add_argument(
        "--sizes",
        default=None,
        help="comma-separated sizes, e.g. 1MiB,64MiB,1GiB (default: 1MiB..1GiB, x4); 1 MiB is always measured",
    )
    p.add_argument("--max-size", default=None, help="drop sizes above this one, e.g. 256MiB")
    p.add_argument(
        "--iters", type=int, default=None, help="timed transfers per size and op (default: ~8 GiB moved, 5..50)"
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed transfers before each series (default: 1)")
    p.add_argument(
        "--latency-iters", type=int, default=1000, help="small transfers timed for latency (default: 1000)"
    )
    p.add_argument(
        "--latency-size",
        default=",".join(str(n) for n in DEFAULT_LATENCY_SIZES),
        help="comma-separated small transfer sizes timed for latency (default: 8,4096 bytes)",
    )
    p.add_argument(
        "--timeout", type=float, default=120.0, help="seconds bounding each transfer and wait (default: 120)"
    )
    p.add_argument(
        "--peers",
        default="",
        help=(
            f"comma-separated other libraries to measure the same way in the same run ({', '.join(KNOWN_PEERS)}; "
            "nixl: NIXL, UCX backend, DRAM, needs pip install nixl-cu12; mooncake: Mooncake Transfer Engine, "
            "TCP transport, DRAM, needs pip install mooncake-transfer-engine-non-cuda and libibverbs1); "
            "the report adds ratios ours / theirs"
        ),
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write all results as JSON here")


def config_from(args: argparse.Namespace) -> BenchConfig:
    """The configuration the parsed options ask for.

    Raises:
        ValueError: a bad size, or an option out of range.
    """
    sizes = parse_sizes(args.sizes) if args.sizes else DEFAULT_SIZES
    if args.max_size:
        cap = parse_size(args.max_size)
        sizes = tuple(n for n in sizes if n <= cap)
        if not sizes:
            raise ValueError(f"--max-size {args.max_size} leaves no size to measure")
    return BenchConfig(
        backends=tuple(b.strip() for b in args.backends.split(",") if b.strip()),
        sizes=sizes,
        iters=args.iters,
        warmup=args.warmup,
        latency_iters=args.latency_iters,
        latency_sizes=parse_sizes(args.latency_size),
        timeout=args.timeout,
        peers=tuple(x.strip() for x in args.peers.split(",") if x.strip()),
    )


def _is_interrupt(exc: BaseException) -> bool:
    """True for KeyboardInterrupt, also when trio delivered it inside a task group (then it
    arrives wrapped in a BaseExceptionGroup)."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    inner = getattr(exc, "exceptions", None)
    return isinstance(inner, tuple) and bool(inner) and all(_is_interrupt(e) for e in inner)


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks.p2p") -> int:
    """Runs the benchmark with command-line arguments; prints the tables (and writes JSON).

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).
        prog: the program name shown in usage and help.

    Returns:
        The exit code: 0 success, 1 the run failed, 2 bad arguments, 130 interrupted.
    """
    p = argparse.ArgumentParser(prog=prog, description="put/get bandwidth and latency per backend vs memcpy")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        config = config_from(args)
    except ValueError as exc:
        print(f"transport bench: {exc}", file=sys.stderr)
        return 2
    try:
        report = run(config)
    except (ValueError, BenchError, transport.TransportError) as exc:
        print(f"transport bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except BaseException as exc:
        if not _is_interrupt(exc):
            raise
        print("transport bench: interrupted", file=sys.stderr)  # the target was killed and joined
        return 130
    print(format_report(report))
    if args.json:
        path = Path(args.json)
        path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        print(f"results written to {path}")
    return 0
