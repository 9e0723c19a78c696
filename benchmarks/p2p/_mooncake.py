"""Mooncake Transfer Engine measured like our tcp backend, in the same run: ``--peers mooncake``.

Layout (two processes, Mooncake's TCP transport, DRAM):

* this process (the initiator) starts the Mooncake target
  (``python -m benchmarks.p2p._mooncake_target``; the hello and the exit bell are :mod:`._peer`'s).
  The target initializes a ``TransferEngine`` with the TCP protocol and P2P handshake metadata
  (``"P2PHANDSHAKE"``: no metadata server, each engine answers for its own segment on its RPC
  port), registers one pre-faulted DRAM region of ``config.region_bytes`` and sends the region's
  address and size and its session name (``host:rpc_port``);
* the initiator initializes its own engine the same way, registers its source and destination
  buffers (the same ones our backends used) and measures, one call at a time:

  - bandwidth at every table size: ``transfer_sync_write`` / ``transfer_sync_read`` of the whole
    size (the median of the timed ones, as for our puts and gets);
  - latency of ``transfer_sync_write`` and ``transfer_sync_read`` at every latency size;
  - the batch: the same 10,000 x 4 KiB segments at an 8 KiB stride as ours, as
    ``batch_transfer_sync_write`` calls of ``QUEUE_DEPTH`` descriptors each (its TCP transport
    rejects more in flight to one peer), ``BATCH_ITERS`` times;
  - separate puts: the same 10,000 segments as 10,000 ``transfer_submit_write`` calls, submitted
    in windows of ``QUEUE_DEPTH`` and each waited for (``transfer_check_status``), as our single
    puts are all started and then gathered.

  Every series is checked, untimed: the bytes read back equal the bytes written (for the batch,
  each segment carries its own stamp).

Mooncake is optional: :func:`measure` reports "not installed" when ``mooncake.engine`` does not
import, and turns any failure into a reason in the report, so the rest of the run stands.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ..common.batch import BATCH_SEGMENT_BYTES, BATCH_SEGMENTS, BATCH_STRIDE
from ..common.errors import BenchError
from ..common.sizes import format_size
from ..common.stats import median, percentile
from ._peer import START_TIMEOUT_S, TargetHello, measure_peer, timed
from ._report import BenchConfig, DescListResult, LatencyResult, PeerResult, SeparateResult, SizeResult

log = logging.getLogger(__name__)

PEER_NAME = "mooncake"
INSTALL_HINT = "pip install mooncake-transfer-engine-non-cuda; it needs libibverbs1 (apt-get install libibverbs1)"
PROTOCOL = "tcp"
METADATA = "P2PHANDSHAKE"
HOST = "127.0.0.1"
BATCH_ITERS = 5
LATENCY_WARMUP = 50
_DISTRIBUTIONS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")
# Mooncake's TCP transport admits at most this many transfers per peer at once (its default
# max_queued_transfers_per_peer) and fails the rest with QUEUE_FULL instead of queueing them, so
# a batch or a window of separate writes is cut into pieces of at most this many.
QUEUE_DEPTH = 1024


def load_api() -> ModuleType | None:
    """``mooncake.engine``, or None when Mooncake is not installed.

    Raises:
        BenchError: Mooncake is installed but fails to import (e.g. libibverbs.so.1 is missing).
    """
    try:
        return importlib.import_module("mooncake.engine")
    except ModuleNotFoundError as exc:
        if exc.name in ("mooncake", "mooncake.engine"):
            return None
        raise BenchError(f"import mooncake.engine failed: {exc}") from exc
    except (ImportError, OSError) as exc:
        raise BenchError(f"import mooncake.engine failed: {exc}") from exc


def mooncake_version() -> str:
    """The installed Mooncake distribution and version."""
    for dist in _DISTRIBUTIONS:
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "mooncake (version unknown)"


def make_engine(api: ModuleType) -> Any:
    """A ``TransferEngine`` on the TCP transport with P2P handshake metadata.

    Raises:
        BenchError: ``initialize`` failed.
    """
    engine = api.TransferEngine()
    rc = engine.initialize(HOST, METADATA, PROTOCOL, "")
    if rc != 0:
        raise BenchError(f"Mooncake TransferEngine.initialize({HOST!r}, {METADATA!r}, {PROTOCOL!r}) returned {rc}")
    return engine


def register(engine: Any, buf: torch.Tensor) -> None:
    """Registers the whole of ``buf`` with ``engine``.

    Raises:
        BenchError: ``register_memory`` failed.
    """
    rc = engine.register_memory(buf.data_ptr(), buf.numel())
    if rc != 0:
        raise BenchError(f"Mooncake register_memory of {format_size(buf.numel())} returned {rc}")


class _Initiator:
    """This process's engine, talking to the target's region; one call at a time."""

    def __init__(self, engine: Any, hello: TargetHello) -> None:
        self.engine = engine
        self.session = hello.metadata.decode()
        self.remote = hello.address

    def write(self, local: int, offset: int, n: int) -> None:
        """``transfer_sync_write`` of ``n`` bytes from address ``local`` to the region at ``offset``.

        Raises:
            BenchError: Mooncake reported a failure.
        """
        rc = self.engine.transfer_sync_write(self.session, local, self.remote + offset, n)
        if rc != 0:
            raise BenchError(f"Mooncake transfer_sync_write of {format_size(n)} to {self.session} returned {rc}")

    def read(self, local: int, offset: int, n: int) -> None:
        """``transfer_sync_read`` of ``n`` bytes from the region at ``offset`` into address ``local``.

        Raises:
            BenchError: Mooncake reported a failure.
        """
        rc = self.engine.transfer_sync_read(self.session, local, self.remote + offset, n)
        if rc != 0:
            raise BenchError(f"Mooncake transfer_sync_read of {format_size(n)} from {self.session} returned {rc}")


def _measure_sizes(
    x: _Initiator, config: BenchConfig, src: torch.Tensor, dst: torch.Tensor, memcpy_gbps: dict[int, float]
) -> list[SizeResult]:
    out = []
    for i, size in enumerate(config.table_sizes):
        iters = config.iters_for(size)
        value = (19 * i + 7) % 251 + 1  # differs per size: stale bytes would show
        s_view, d_view = src[:size], dst[:size]
        s_view.fill_(value)
        d_view.fill_(0)
        put_times = timed(functools.partial(x.write, s_view.data_ptr(), 0, size), iters, config.warmup)
        get_times = timed(functools.partial(x.read, d_view.data_ptr(), 0, size), iters, config.warmup)
        if not torch.equal(s_view, d_view):
            raise BenchError(f"{format_size(size)} read back from the Mooncake target differs from what was written")
        sr = SizeResult(size, iters, size / median(put_times) / 1e9, size / median(get_times) / 1e9, memcpy_gbps[size])
        log.info("mooncake %s: put %.2f GB/s, get %.2f GB/s", format_size(size), sr.put_gbps, sr.get_gbps)
        out.append(sr)
    return out


def _measure_latency(x: _Initiator, config: BenchConfig, src: torch.Tensor, dst: torch.Tensor) -> list[LatencyResult]:
    out = []
    iters, warmup = config.latency_iters, min(LATENCY_WARMUP, config.latency_iters)
    for n in config.latency_sizes:
        for op, call in (("put", x.write), ("get", x.read)):
            local = (src if op == "put" else dst).data_ptr()
            us = [t * 1e6 for t in timed(functools.partial(call, local, 0, n), iters, warmup)]
            out.append(LatencyResult(op, n, len(us), median(us), percentile(us, 99)))
    return out


def _stamp_segments(src: torch.Tensor, dst: torch.Tensor, salt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's segments of ``src`` (each its own stamp) and as many of ``dst``, zeroed."""
    n, size = BATCH_SEGMENTS, BATCH_SEGMENT_BYTES
    stamps = ((torch.arange(n) + salt) % 251 + 1).to(torch.uint8)
    s_view, d_view = src[: n * size].view(n, size), dst[: n * size].view(n, size)
    s_view.copy_(stamps[:, None].expand(n, size))
    d_view.fill_(0)
    return s_view, d_view


def _check_segments(x: _Initiator, s_view: torch.Tensor, d_view: torch.Tensor, what: str) -> None:
    """Reads the batch's segments back into ``d_view`` (one batched read) and compares.

    Raises:
        BenchError: the read failed, or a segment differs.
    """
    n, size, stride = BATCH_SEGMENTS, BATCH_SEGMENT_BYTES, BATCH_STRIDE
    for lo in range(0, n, QUEUE_DEPTH):
        idx = range(lo, min(n, lo + QUEUE_DEPTH))
        locals_, remotes = [d_view.data_ptr() + i * size for i in idx], [x.remote + i * stride for i in idx]
        rc = x.engine.batch_transfer_sync_read(x.session, locals_, remotes, [size] * len(idx))
        if rc != 0:
            raise BenchError(f"Mooncake batch_transfer_sync_read of the {what} returned {rc}")
    if not torch.equal(s_view, d_view):
        raise BenchError(f"the {what} of {n} segments read back from the Mooncake target differs from what was written")


def _measure_batch(x: _Initiator, src: torch.Tensor, dst: torch.Tensor) -> DescListResult:
    """The batch as ``batch_transfer_sync_write`` calls of ``QUEUE_DEPTH`` segments each (the
    descriptor lists built once, outside the timing)."""
    n, size, stride = BATCH_SEGMENTS, BATCH_SEGMENT_BYTES, BATCH_STRIDE
    s_view, d_view = _stamp_segments(src, dst, 3)
    pieces = [
        ([s_view.data_ptr() + i * size for i in idx], [x.remote + i * stride for i in idx], [size] * len(idx))
        for idx in (range(lo, min(n, lo + QUEUE_DEPTH)) for lo in range(0, n, QUEUE_DEPTH))
    ]

    def post() -> None:
        for locals_, remotes, lengths in pieces:
            rc = x.engine.batch_transfer_sync_write(x.session, locals_, remotes, lengths)
            if rc != 0:
                raise BenchError(f"Mooncake batch_transfer_sync_write of {len(locals_)} segments returned {rc}")

    times = timed(post, BATCH_ITERS, 1)
    _check_segments(x, s_view, d_view, "batch")
    return DescListResult(n, size, stride, BATCH_ITERS, n / median(times), calls=len(pieces))


def _measure_separate(x: _Initiator, src: torch.Tensor, dst: torch.Tensor, timeout: float) -> SeparateResult:
    """The same segments as separate writes: submitted in windows of ``QUEUE_DEPTH``, each
    waited for."""
    n, size, stride = BATCH_SEGMENTS, BATCH_SEGMENT_BYTES, BATCH_STRIDE
    s_view, d_view = _stamp_segments(src, dst, 5)
    base = s_view.data_ptr()

    def all_separately() -> None:
        deadline = time.monotonic() + timeout
        for lo in range(0, n, QUEUE_DEPTH):
            ids = [x.engine.transfer_submit_write(x.session, base + i * size, x.remote + i * stride, size)
                   for i in range(lo, min(n, lo + QUEUE_DEPTH))]
            if min(ids) < 0:
                raise BenchError(f"Mooncake transfer_submit_write failed ({min(ids)})")
            for batch_id in ids:
                while (status := x.engine.transfer_check_status(batch_id)) == 0:  # 0: still in progress
                    if time.monotonic() > deadline:
                        raise BenchError(f"{n} separate Mooncake writes did not complete within {timeout:g}s")
                if status != 1:  # 1: completed; -1 failed, -2 timed out
                    raise BenchError(f"a separate Mooncake write failed (transfer_check_status {status})")

    times = timed(all_separately, 1, 0)
    _check_segments(x, s_view, d_view, "separate writes")
    return SeparateResult(n, size, stride, n / median(times), window=QUEUE_DEPTH)


def lifetime_bound(config: BenchConfig) -> float:
    """An upper bound on the Mooncake part of a run (every call is bounded by ``config.timeout``),
    so the target exits by itself even if the socket never closes."""
    calls = sum(config.iters_for(n) + config.warmup for n in config.table_sizes) * 2
    calls += len(config.latency_sizes) * 2 * (config.latency_iters + LATENCY_WARMUP)
    calls += BATCH_ITERS + 1 + 2 + 2
    return START_TIMEOUT_S + config.timeout * (calls + 2)


def _initiate(
    api: ModuleType,
    config: BenchConfig,
    src: torch.Tensor,
    dst: torch.Tensor,
    memcpy_gbps: dict[int, float],
    hello: TargetHello,
) -> PeerResult:
    """Everything measured with Mooncake, against the target that sent ``hello`` (which holds
    ``config.region_bytes``, as :func:`measure_peer` checked)."""
    engine = make_engine(api)
    for buf in (src, dst):
        register(engine, buf)
    try:
        x = _Initiator(engine, hello)
        detail = f"{mooncake_version()}, {PROTOCOL.upper()} transport, {METADATA} metadata, DRAM, two processes"
        result = PeerResult(PEER_NAME, detail=detail)
        result.sizes = _measure_sizes(x, config, src, dst, memcpy_gbps)
        result.latency = _measure_latency(x, config, src, dst)
        result.batch.append(_measure_batch(x, src, dst))
        result.separate.append(_measure_separate(x, src, dst, config.timeout))
        return result
    finally:
        for buf in (src, dst):
            if engine.unregister_memory(buf.data_ptr()) != 0:
                log.warning("mooncake: unregister_memory failed")
        del engine  # the Python API has no close: the last reference shuts the engine down


def measure(
    config: BenchConfig, src: torch.Tensor, dst: torch.Tensor, memcpy_gbps: dict[int, float], workdir: Path
) -> PeerResult:
    """Measures Mooncake the way :mod:`benchmarks.p2p` measures a backend (blocking; starts and
    always joins the Mooncake target process).

    Args:
        config: the run's configuration (sizes, iterations, timeout).
        src: this process's source buffer, at least ``config.region_bytes`` (pre-faulted).
        dst: this process's destination buffer, the same size.
        memcpy_gbps: the memcpy baseline per table size, for the put/memcpy columns.
        workdir: a private temporary directory (the socket and the target's log go there).

    Returns:
        The results; or, when Mooncake is not installed or anything about it failed, a result
        whose ``unavailable`` says why.
    """
    args = ("--nbytes", str(config.region_bytes), "--timeout", str(config.timeout),
            "--lifetime", str(lifetime_bound(config)))

    def initiate(api: ModuleType, hello: TargetHello) -> PeerResult:
        return _initiate(api, config, src, dst, memcpy_gbps, hello)

    return measure_peer(PEER_NAME, load_api, INSTALL_HINT, mooncake_version, f"{__package__}._mooncake_target",
                        args, workdir, config, initiate)
