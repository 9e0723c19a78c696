"""GPU micro-benchmark: transport put/get between two processes on one GPU vs same-run torch copies.

    python -m benchmarks.gpu_bench                          # 1 MiB, 64 MiB, 1 GiB (~1 min on an H200)
    python -m benchmarks.gpu_bench --sizes 64MiB --iters 20 --json out.json --markdown out.md

One run:

* a **target** process (``python -m benchmarks.gpu_bench serve ...``) registers a device region
  (``torch.empty(..., device="cuda")``, the caching allocator) and a host region
  (``Transport.empty``) of the largest size over the ``ipc`` backend, then only waits for the exit
  doorbell: its application code takes no part in any transfer;
* this process (the **initiator**, same GPU) puts into and gets from those regions, one transfer
  at a time, each awaited before the next (a completed put means the bytes are in the target's
  memory): ``d2d put/get`` (local device tensor <-> remote device region), ``h2d put`` (local
  pinned host -> remote device), ``d2h get`` (remote device -> local pinned host), ``d2h put``
  (local device -> remote host region), ``h2d get`` (remote host region -> local device);
* in the same run and process, the **baselines**: torch ``copy_`` on the same GPU, device ->
  device, pinned host -> device and device -> pinned host, at the same sizes.

Every figure is the median of ``--iters`` timed operations after ``--warmup`` untimed ones, each
timed with ``torch.cuda.synchronize()`` before it and ``time.perf_counter()`` around it (the
baseline's timing ends with another synchronize): the same clock for both, so the ratio is
fair. The baselines are also timed with CUDA events (kernel time alone), shown beside.
GB/s = 1e9 bytes moved per second (each byte counted once). Data is checked after every series
(untimed). Nothing here asserts on timings.

An ``nccl broadcast`` baseline runs when torch has NCCL and at least two GPUs are visible (rank 0
on GPU 0 broadcasts to rank 1 on GPU 1: a different physical path from the one-GPU transfers);
with one GPU it is skipped with the reason. Without a CUDA GPU the benchmark exits with status 2
and says so.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import multiprocessing
import os
import queue as queue_mod
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import transport

from ..common.batch import BATCH_SEGMENT_BYTES, BATCH_SEGMENTS
from ..common.capabilities import cuda_unavailable_reason
from ..common.errors import BenchError
from ..common.procs import CHECKOUT, LoggedProcess, checkout_env, module_command
from ..common.sizes import GiB, format_size, parse_sizes
from ..common.stats import median
from ._report import BASELINE_NAMES, DEV_KEY, HOST_KEY, OPS, Report, Row, format_markdown, machine

DEFAULT_SIZES = "1MiB,64MiB,1GiB"
TARGET = "gpu-bench-target"
INITIATOR = "gpu-bench-initiator"
EXIT_SIGNAL = "bench.exit"
READY_SIGNAL = "bench.ready"
START_TIMEOUT_S = 120.0  # the target imports torch, initialises CUDA, allocates and registers
NCCL_DEADLINE_S = 120.0
_AUTO_BYTES = 16 * GiB
_AUTO_MIN_ITERS, _AUTO_MAX_ITERS = 10, 50


def needs_gpu_reason() -> str | None:
    """None when a CUDA GPU and transport's CUDA support are usable here, else why not."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no usable GPU (no driver or no device)"
    try:
        why = cuda_unavailable_reason()
    except ImportError as exc:
        return f"this build of transport has no CUDA support ({exc})"
    return f"transport cannot use CUDA here: {why}" if why else None


def iters_for(size: int, iters: int | None) -> int:
    """Timed operations per point at ``size`` (``iters`` when given, else 10..50 by size)."""
    if iters is not None:
        return iters
    return max(_AUTO_MIN_ITERS, min(_AUTO_MAX_ITERS, math.ceil(_AUTO_BYTES / size)))


# -------------------------------------------------------------------------------------------------
# Baselines (this process)


def time_baseline(fn: Callable[[], object], iters: int, warmup: int) -> tuple[float, float]:
    """Median seconds of ``fn`` by synchronize + perf_counter, and by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    wall, events = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - t0)
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        events.append(start.elapsed_time(end) / 1e3)
    return median(wall), median(events)


@dataclass
class Buffers:
    dev_src: torch.Tensor
    dev_dst: torch.Tensor
    pin_src: torch.Tensor
    pin_dst: torch.Tensor

    @classmethod
    def allocate(cls, nbytes: int) -> Buffers:
        dev = torch.device("cuda", 0)
        b = cls(
            torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(1),
            torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(2),
            torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(3),
            torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(4),
        )
        torch.cuda.synchronize()
        return b

    def local(self, memory: str, direction: str, n: int) -> torch.Tensor:
        if memory == "dev":
            return (self.dev_src if direction == "put" else self.dev_dst)[:n]
        return (self.pin_src if direction == "put" else self.pin_dst)[:n]


Baselines = dict[str, dict[int, tuple[float, float]]]  # kind -> size -> (wall GB/s, events GB/s)


def measure_baselines(buf: Buffers, sizes: Sequence[int], iters: int | None, warmup: int) -> Baselines:
    out: Baselines = {"d2d": {}, "h2d": {}, "d2h": {}}
    for n in sizes:
        k = iters_for(n, iters)
        ops = {
            "d2d": lambda n=n: buf.dev_dst[:n].copy_(buf.dev_src[:n]),
            "h2d": lambda n=n: buf.dev_dst[:n].copy_(buf.pin_src[:n], non_blocking=True),
            "d2h": lambda n=n: buf.pin_dst[:n].copy_(buf.dev_src[:n], non_blocking=True),
        }
        for kind, fn in ops.items():
            wall, ev = time_baseline(fn, k, warmup)
            out[kind][n] = (n / wall / 1e9, n / ev / 1e9 if ev > 0 else float("nan"))
            print(f"gpu_bench: baseline {BASELINE_NAMES[kind]} {format_size(n)}: {out[kind][n][0]:.1f} GB/s "
                  f"({out[kind][n][1]:.1f} by events)", file=sys.stderr, flush=True)
    return out


# -------------------------------------------------------------------------------------------------
# The target process


class TargetProcess(LoggedProcess):
    """``python -m benchmarks.gpu_bench serve``; its output goes to a log quoted on failure."""

    def __init__(self, store: str, nbytes: int, timeout: float, log_path: Path) -> None:
        cmd = module_command(
            "benchmarks.gpu_bench", "serve", "--store", store, "--nbytes", str(nbytes), "--timeout", str(timeout),
            "--parent", str(os.getpid()),
        )  # fmt: skip
        super().__init__(cmd, log_path, env=checkout_env(), cwd=CHECKOUT)


async def serve(store: str, nbytes: int, timeout: float, parent: int) -> None:
    import trio

    async with transport.Transport(TARGET, store=store, backends=("ipc",), timeout=timeout) as t:
        dev = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        t.register(DEV_KEY, dev)
        t.empty(HOST_KEY, (nbytes,), dtype=torch.uint8)
        await t.peer(INITIATOR, timeout=START_TIMEOUT_S)
        await t.signal(INITIATOR, READY_SIGNAL, 1)
        deadline = time.monotonic() + 3600
        while not t.signal_value(EXIT_SIGNAL):
            if os.getppid() != parent:
                raise BenchError(f"parent process {parent} went away")
            if time.monotonic() > deadline:
                raise BenchError("no exit doorbell within an hour")
            await trio.sleep(0.1)


def serve_main(argv: Sequence[str]) -> int:
    import trio

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_bench serve", description="the benchmark's target process (internal)"
    )
    p.add_argument("--store", required=True)
    p.add_argument("--nbytes", type=int, required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--parent", type=int, required=True)
    args = p.parse_args(argv)
    try:
        trio.run(serve, args.store, args.nbytes, args.timeout, args.parent)
    except BenchError as exc:
        print(f"gpu_bench target: {exc}", file=sys.stderr)
        return 1
    return 0


# -------------------------------------------------------------------------------------------------
# The initiator


def _all_equal(t: torch.Tensor, value: int) -> bool:
    return bool((t == value).all().item())


async def measure_transport(
    t: Any, target: TargetProcess, buf: Buffers, sizes: Sequence[int], iters: int | None, warmup: int,
    baselines: Baselines, rows: list[Row],
) -> None:
    """Appends one Row per (size, op) to ``rows`` as it goes (a failure keeps what was measured)."""

    def check_target() -> None:
        failure = target.failure()
        if failure is not None:
            raise BenchError(failure)

    async def run(op: str, n: int) -> float:
        direction, memory, key, _ = OPS[op]
        local = buf.local(memory, direction, n)
        call = t.put if direction == "put" else t.get
        k = iters_for(n, iters)
        for _ in range(warmup):
            await call(local, TARGET, key=key)
        times = []
        for _ in range(k):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            await call(local, TARGET, key=key)
            times.append(time.perf_counter() - t0)
        check_target()
        wall, events = baselines[OPS[op][3]][n]
        row = Row(op, n, k, n / median(times) / 1e9, OPS[op][3], wall, events)
        rows.append(row)
        print(
            f"gpu_bench: {op} {format_size(n)}: {row.gbps:.1f} GB/s ({row.ratio:.2f}x {BASELINE_NAMES[row.baseline]})",
            file=sys.stderr,
            flush=True,
        )
        return row.gbps

    async def verify(what: str, ok: bool) -> None:
        if not ok:
            raise BenchError(f"{what}: the bytes that arrived differ from the bytes sent")

    for i, n in enumerate(sizes):
        a, b = 11 + 2 * i, 12 + 2 * i  # differ per size: stale bytes would show
        buf.dev_src[:n].fill_(a)
        buf.pin_src[:n].fill_(b)
        torch.cuda.synchronize()
        scratch = buf.dev_dst[:n]

        await run("d2d put", n)  # remote dev = a
        scratch.zero_()
        await t.get(scratch, TARGET, key=DEV_KEY)
        await verify(f"d2d put {format_size(n)}", _all_equal(scratch, a))

        scratch.zero_()
        await run("d2d get", n)
        await verify(f"d2d get {format_size(n)}", _all_equal(scratch, a))

        buf.pin_dst[:n].zero_()
        await run("d2h get", n)
        await verify(f"d2h get {format_size(n)}", _all_equal(buf.pin_dst[:n], a))

        await run("h2d put", n)  # remote dev = b
        scratch.zero_()
        await t.get(scratch, TARGET, key=DEV_KEY)
        await verify(f"h2d put {format_size(n)}", _all_equal(scratch, b))

        await run("d2h put", n)  # remote host = a
        scratch.zero_()
        await run("h2d get", n)
        await verify(f"d2h put + h2d get {format_size(n)}", _all_equal(scratch, a))


async def measure_batch(t: Any, buf: Buffers, region_bytes: int, out: dict[str, Any]) -> None:
    """One prepared put of up to 10,000 device segments of 4 KiB at an 8 KiB stride into the
    target's device region (CUDA IPC, batched on the transport's stream): segments/s, median of
    5 starts after one, against the same segments as single puts (one gather); read back and
    checked. Fills ``out``."""
    size, stride = BATCH_SEGMENT_BYTES, 2 * BATCH_SEGMENT_BYTES
    n = min(BATCH_SEGMENTS, (region_bytes - size) // stride + 1, buf.dev_src.numel() // size)
    if n < 2:
        out["skipped"] = f"the {format_size(region_bytes)} region holds fewer than 2 segments"
        return
    src = buf.dev_src[: n * size]
    src.copy_(torch.arange(n * size, device=src.device, dtype=torch.int64).remainder_(251).to(torch.uint8))
    items = [(src[i * size : (i + 1) * size], DEV_KEY, i * stride) for i in range(n)]
    prepared = t.prepare_put(TARGET, items)
    await prepared.start()
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        await prepared.start()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    await transport.gather(*[t.put(s, TARGET, key=DEV_KEY, offset=o) for s, _, o in items])
    single = time.perf_counter() - t0
    back = buf.dev_dst[: n * size]
    back.zero_()
    await t.prepare_get(TARGET, [(back[i * size : (i + 1) * size], DEV_KEY, i * stride) for i in range(n)]).start()
    if not torch.equal(back, src):
        raise BenchError("d2d batch: the segments read back differ from the segments put")
    out.clear()
    out.update(segments=n, segment_bytes=size, stride=stride, prepared_per_s=n / median(times),
               single_per_s=n / single)
    print(f"gpu_bench: d2d batch of {n} x {format_size(size)}: prepared put {out['prepared_per_s'] / 1e3:.1f}k "
          f"segments/s, single puts {out['single_per_s'] / 1e3:.1f}k/s", file=sys.stderr, flush=True)


async def initiate(store: str, target: TargetProcess, buf: Buffers, sizes: Sequence[int], iters: int | None,
                   warmup: int, timeout: float, baselines: Baselines, rows: list[Row],
                   batch: dict[str, Any], closing: dict[str, float]) -> None:
    import trio

    async with transport.Transport(INITIATOR, store=store, backends=("ipc",), timeout=timeout) as t:
        with trio.move_on_after(START_TIMEOUT_S) as scope:
            while t.signal_value(READY_SIGNAL) is None:
                failure = target.failure()
                if failure is not None:
                    raise BenchError(failure)
                await trio.sleep(0.05)
        if scope.cancelled_caught:
            raise BenchError(
                f"the target was not ready within {START_TIMEOUT_S:g}s; its output ends with:\n{target.output_tail()}"
            )
        await t.peer(TARGET, regions=[DEV_KEY, HOST_KEY], timeout=timeout)
        try:
            await measure_transport(t, target, buf, sizes, iters, warmup, baselines, rows)
            await measure_batch(t, buf, max(sizes), batch)
        finally:
            with trio.move_on_after(10):
                if target.failure() is None:
                    await t.signal(TARGET, EXIT_SIGNAL, 1)
        await t.fence(TARGET)  # the doorbell landed: nothing is in flight from here
        t0 = time.perf_counter()
        await t.aclose()
        closing["close_s"] = time.perf_counter() - t0
        print(f"gpu_bench: Transport.aclose of the initiator: {closing['close_s'] * 1e3:.1f} ms", file=sys.stderr,
              flush=True)


# -------------------------------------------------------------------------------------------------
# nccl broadcast (two GPUs)


def nccl_unavailable_reason() -> str | None:
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if not dist.is_nccl_available():
        return "this torch build has no NCCL"
    n = torch.cuda.device_count()
    if n < 2:
        return (f"needs 2 GPUs, {n} visible: NCCL never places two ranks on one GPU, and a 1-rank "
                "broadcast moves no bytes, so there is no meaningful broadcast baseline on one GPU")
    return None


def _nccl_rank(rank: int, port: int, sizes: list[int], iters: int | None, warmup: int, q: Any) -> None:
    import torch.distributed as dist

    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=NCCL_DEADLINE_S))
        out = []
        for n in sizes:
            x = torch.full((n,), 5 if rank == 0 else 0, dtype=torch.uint8, device="cuda")
            k = iters_for(n, iters)
            for _ in range(warmup):
                dist.broadcast(x, src=0)
            torch.cuda.synchronize()
            times = []
            for _ in range(k):
                dist.barrier(device_ids=[rank])
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dist.broadcast(x, src=0)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            if rank == 1 and not _all_equal(x, 5):
                raise BenchError(f"nccl broadcast {format_size(n)}: wrong bytes arrived")
            out.append({"size": n, "iters": k, "gbps": n / median(times) / 1e9})
        dist.destroy_process_group()
        q.put({"rank": rank, "sizes": out})
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which prints it
        q.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})


def measure_nccl(sizes: Sequence[int], iters: int | None, warmup: int) -> dict[str, Any]:
    why = nccl_unavailable_reason()
    if why is not None:
        return {"skipped": why}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_nccl_rank, args=(r, port, list(sizes), iters, warmup, q), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + NCCL_DEADLINE_S
        while len(results) < 2 and time.monotonic() < deadline:
            try:
                msg = q.get(timeout=1.0)
            except queue_mod.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                continue
            results[msg["rank"]] = msg
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    errors = [m["error"] for m in results.values() if "error" in m]
    if errors or 1 not in results:
        return {"error": "; ".join(errors) or f"the ranks did not report within {NCCL_DEADLINE_S:g} s"}
    return {"sizes": results[1]["sizes"], "timed_on": "receiver (rank 1, GPU 1)"}


# -------------------------------------------------------------------------------------------------
# main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma-separated sizes (default {DEFAULT_SIZES})")
    p.add_argument("--iters", type=int, default=None, help="timed operations per point (default: 10..50 by size)")
    p.add_argument("--warmup", type=int, default=3, help="untimed operations before each series (default 3)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds bounding each transfer (default 120)")
    p.add_argument("--json", type=Path, default=None, help="write the numbers here")
    p.add_argument("--markdown", type=Path, default=None, help="write the Markdown report here too")
    p.add_argument("--no-nccl", action="store_true", help="skip the nccl broadcast baseline")
    args = p.parse_args(argv)
    try:
        args.size_list = parse_sizes(args.sizes)
    except ValueError as exc:
        p.error(str(exc))
    if args.iters is not None and args.iters < 1:
        p.error("--iters must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        return serve_main(argv[1:])
    args = parse_args(argv)
    why = needs_gpu_reason()
    if why is not None:
        print(f"gpu_bench: needs a CUDA GPU: {why}", file=sys.stderr)
        return 2

    import trio

    started = time.perf_counter()
    sizes = list(args.size_list)
    info = machine()
    print(f"gpu_bench: {info['gpu']}, driver {info['driver']}, torch {info['torch']}; sizes "
          f"{', '.join(format_size(n) for n in sizes)}", file=sys.stderr, flush=True)
    config = {"sizes": sizes, "iters": args.iters, "warmup": args.warmup, "timeout": args.timeout,
              "iters_per_size": {str(n): iters_for(n, args.iters) for n in sizes}}
    rows: list[Row] = []
    baselines: Baselines = {}
    nccl: dict[str, Any] = {"skipped": "not run"}
    batch: dict[str, Any] = {"skipped": "not run"}
    closing: dict[str, float] = {}
    error = None

    def write(final: bool) -> str:
        report = Report(info, config, rows, baselines, nccl, error, time.perf_counter() - started, batch=batch,
                        close_s=closing.get("close_s"))
        text = format_markdown(report)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        if args.markdown is not None and final:
            args.markdown.parent.mkdir(parents=True, exist_ok=True)
            args.markdown.write_text(text + "\n")
        return text

    try:
        buf = Buffers.allocate(max(sizes))
        baselines = measure_baselines(buf, sizes, args.iters, args.warmup)
        with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
            store = f"file://{tmp}/store"
            target = TargetProcess(store, max(sizes), args.timeout, Path(tmp) / "target.log")
            run = functools.partial(
                trio.run, initiate, store, target, buf, sizes, args.iters, args.warmup, args.timeout, baselines, rows,
                batch, closing,
            )
            target.supervise(run, BenchError)
        del buf
        torch.cuda.empty_cache()
        if args.no_nccl:
            nccl = {"skipped": "--no-nccl"}
        else:
            nccl = {"skipped": "interrupted before it finished"}
            write(final=False)  # the transport figures are safe even if the broadcast never returns
            nccl = measure_nccl(sizes, args.iters, args.warmup)
        if "skipped" in nccl:
            print(f"gpu_bench: nccl broadcast skipped: {nccl['skipped']}", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - report what was measured, and why the rest was not
        error = f"{type(exc).__name__}: {exc}"
        print(f"gpu_bench: failed: {error}", file=sys.stderr)
    print(write(final=True), flush=True)
    return 1 if error else 0
