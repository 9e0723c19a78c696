"""NIXL (NVIDIA Inference Xfer Library) measured like our backends, in the same run: ``--peers nixl``.

Layout (two processes, NIXL's UCX backend, DRAM):

* this process (the initiator) starts the NIXL target (``python -m benchmarks.p2p._nixl_target``;
  the hello and the exit bell are :mod:`._peer`'s). The target creates a NIXL agent with the UCX
  backend, registers one pre-faulted DRAM region of ``config.region_bytes`` and sends the region's
  address and size and its agent metadata (``get_agent_metadata``);
* the initiator creates its own agent (without NIXL's progress thread: its polls progress the
  worker), registers its source and destination buffers (the same ones our backends used), loads
  the target's metadata (``add_remote_agent``) and measures, one transfer in flight at a time,
  each posted with ``transfer`` and polled to completion with ``check_xfer_state`` (NIXL's Python
  API has no blocking wait):

  - bandwidth at every table size: a WRITE and a READ handle made once (``initialize_xfer``),
    each posted ``warmup + iters`` times; the median of the timed ones, as for our puts and gets;
  - latency at every latency size: WRITE and READ with a handle made once and posted again for
    every transfer, and WRITE with a new handle per transfer (``initialize_xfer``, ``transfer``,
    ``release_xfer_handle`` inside the timing);
  - the batch: the same 10,000 x 4 KiB segments at an 8 KiB stride as ours, as one transfer from
    one 10,000-entry descriptor list (``prep_xfer_dlist`` for both sides and
    ``make_prepped_xfer``, once), posted ``BATCH_ITERS`` times.

  Every series is checked, untimed: the bytes READ back equal the bytes written (for the batch,
  each segment carries its own stamp, so a misplaced segment shows).

NIXL is optional: :func:`measure` reports "not installed" when no NIXL module imports, and turns
any failure of NIXL (or of its target process) into a reason in the report instead of an error,
so the rest of the run stands.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from ..common.batch import BATCH_SEGMENT_BYTES, BATCH_SEGMENTS, BATCH_STRIDE
from ..common.errors import BenchError
from ..common.sizes import format_size
from ..common.stats import median, percentile
from ._peer import START_TIMEOUT_S, TargetHello, measure_peer, timed
from ._report import (
    BenchConfig,
    DescListResult,
    LatencyResult,
    PeerResult,
    SizeResult,
)

log = logging.getLogger(__name__)

PEER_NAME = "nixl"
INSTALL_HINT = "pip install nixl-cu12, or nixl-cu13 for CUDA 13"
TARGET_AGENT = "bench-nixl-target"
INITIATOR_AGENT = "bench-nixl-initiator"
NIXL_BACKEND = "UCX"
MEM_TYPE = "DRAM"
BATCH_ITERS = 5
LATENCY_WARMUP = 50

# The NIXL API module under each of its distributions' names: the ``nixl`` meta package, or the
# CUDA-specific wheels alone (``pip install nixl-cu12`` provides ``nixl_cu12`` and no ``nixl``).
_API_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
_DISTRIBUTIONS = ("nixl-cu12", "nixl-cu13", "nixl")

# NIXL's Python API reports transfer states as strings.
_DONE, _IN_PROGRESS = "DONE", "PROC"
_POLLS_PER_CLOCK_CHECK = 1024  # the deadline is read once per this many polls, not on every one



# -------------------------------------------------------------------------------------------------
# Loading NIXL


def _module_missing(exc: ModuleNotFoundError, module: str) -> bool:
    """Whether ``exc`` says ``module`` (or a package above it) is absent, rather than something
    it imports being broken."""
    parts = module.split(".")
    return exc.name in {".".join(parts[: i + 1]) for i in range(len(parts))}


def load_api() -> ModuleType | None:
    """NIXL's Python API module (``nixl._api`` or a CUDA-specific wheel's), or None when none is
    installed. Quiets NIXL's INFO logging, which would otherwise land in the report.

    Raises:
        BenchError: a NIXL module is installed but fails to import (the message says why).
    """
    for name in _API_MODULES:
        try:
            api = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if _module_missing(exc, name):
                continue
            raise BenchError(f"import {name} failed: {exc}") from exc
        except (ImportError, OSError) as exc:
            raise BenchError(f"import {name} failed: {exc}") from exc
        logging.getLogger("nixl").setLevel(logging.WARNING)
        return api
    return None


def nixl_version() -> str:
    """The installed NIXL distribution and version, e.g. ``"nixl-cu12 1.5.1"``."""
    for dist in _DISTRIBUTIONS:
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "nixl (version unknown)"


def _skip_ib_modules_without_devices() -> None:
    """Keeps NIXL's UCX from loading its InfiniBand modules on a host with no RDMA device.

    NIXL's wheel bundles its own libibverbs and libnl; where the system's libibverbs is installed
    too (Mooncake's TCP transport needs it), UCX's ib module loads both copies of libnl-route, and
    the process crashes in their destructors at exit (SIGSEGV in ``rtnl_tc_unregister``), after
    the run. Without a device those modules have nothing to drive, so this changes no figure.
    A ``UCX_MODULES`` the user set is left alone. UCX reads it when the agent creates its context.
    """
    devices = Path("/sys/class/infiniband")
    if not (devices.is_dir() and any(devices.iterdir())):
        os.environ.setdefault("UCX_MODULES", "^ib")


def make_agent(api: ModuleType, name: str, *, progress_thread: bool) -> Any:
    """A NIXL agent with the UCX backend (NIXL's default agent configuration otherwise).

    Args:
        api: NIXL's API module (:func:`load_api`).
        name: the agent's name.
        progress_thread: whether NIXL runs its progress thread (its default). Without it, the
            agent's worker only progresses inside NIXL calls such as ``check_xfer_state``.

    Raises:
        BenchError: NIXL has no UCX backend here.
    """
    _skip_ib_modules_without_devices()
    config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[NIXL_BACKEND])
    agent = api.nixl_agent(name, config)
    if NIXL_BACKEND not in agent.backends:
        raise BenchError(
            f"NIXL could not create its {NIXL_BACKEND} backend (plugins found: {', '.join(agent.get_plugin_list())})"
        )
    return agent


# -------------------------------------------------------------------------------------------------
# Transfers


def _quietly(what: str, release: Callable[[], object]) -> None:
    """Runs a NIXL release; a failure is logged, not raised (it must not hide the real error)."""
    try:
        release()
    except Exception as exc:  # noqa: BLE001 - NIXL raises its own exception types
        log.warning("nixl: %s failed: %s", what, exc)


class _Initiator:
    """This process's NIXL agent, talking to the target's region; one transfer at a time.

    Args:
        agent: the initiator's agent, the target's metadata loaded.
        remote: the target agent's name (what ``add_remote_agent`` returned).
        hello: the target's region.
        timeout: seconds bounding each transfer.
    """

    def __init__(self, agent: Any, remote: Any, hello: TargetHello, timeout: float) -> None:
        self.agent = agent
        self.remote = remote
        self.hello = hello
        self.timeout = timeout

    def wait(self, handle: Any) -> None:
        """Posts ``handle`` and polls it to completion (NIXL's Python API has no blocking wait).

        Raises:
            BenchError: the transfer failed, or did not complete within the timeout.
        """
        deadline = time.monotonic() + self.timeout
        state = self.agent.transfer(handle)
        polls = 0
        while state == _IN_PROGRESS:
            state = self.agent.check_xfer_state(handle)
            polls += 1
            if polls % _POLLS_PER_CLOCK_CHECK == 0 and time.monotonic() > deadline:
                raise BenchError(f"a transfer to {TARGET_AGENT} did not complete within {self.timeout:g}s")
        if state != _DONE:
            raise BenchError(f"a transfer to {TARGET_AGENT} failed (NIXL state {state!r})")

    def make(self, op: str, local: torch.Tensor) -> Any:
        """A transfer handle (``initialize_xfer``): ``op`` ("WRITE" or "READ") between the uint8
        tensor ``local`` and the start of the target's region, as many bytes as ``local`` has."""
        n = local.numel()
        local_descs = self.agent.get_xfer_descs([(local.data_ptr(), n, 0)], MEM_TYPE)
        remote_descs = self.agent.get_xfer_descs([(self.hello.address, n, 0)], MEM_TYPE)
        return self.agent.initialize_xfer(op, local_descs, remote_descs, self.remote)

    @contextlib.contextmanager
    def handle(self, op: str, local: torch.Tensor) -> Iterator[Any]:
        """:meth:`make`, released on the way out."""
        h = self.make(op, local)
        try:
            yield h
        finally:
            _quietly("release_xfer_handle", functools.partial(self.agent.release_xfer_handle, h))

    def once_with_new_handle(self, op: str, local: torch.Tensor) -> None:
        """One transfer with a handle made for it and released after it."""
        h = self.make(op, local)
        try:
            self.wait(h)
        finally:
            self.agent.release_xfer_handle(h)


def _measure_sizes(
    x: _Initiator, config: BenchConfig, src: torch.Tensor, dst: torch.Tensor, memcpy_gbps: dict[int, float]
) -> list[SizeResult]:
    out = []
    for i, size in enumerate(config.table_sizes):
        iters = config.iters_for(size)
        value = (13 * i + 5) % 251 + 1  # differs per size: stale bytes would show
        s_view, d_view = src[:size], dst[:size]
        s_view.fill_(value)
        d_view.fill_(0)
        with x.handle("WRITE", s_view) as write:
            put_times = timed(functools.partial(x.wait, write), iters, config.warmup)
        with x.handle("READ", d_view) as read:
            get_times = timed(functools.partial(x.wait, read), iters, config.warmup)
        if not torch.equal(s_view, d_view):
            raise BenchError(f"{format_size(size)} READ back from the NIXL target differs from what was written")
        sr = SizeResult(size, iters, size / median(put_times) / 1e9, size / median(get_times) / 1e9, memcpy_gbps[size])
        log.info("nixl %s: put %.2f GB/s, get %.2f GB/s", format_size(size), sr.put_gbps, sr.get_gbps)
        out.append(sr)
    return out


def _latency(op: str, n: int, times: list[float], variant: str = "") -> LatencyResult:
    us = [t * 1e6 for t in times]
    return LatencyResult(op, n, len(us), median(us), percentile(us, 99), variant)


def _measure_latency(x: _Initiator, config: BenchConfig, src: torch.Tensor, dst: torch.Tensor) -> list[LatencyResult]:
    out = []
    iters, warmup = config.latency_iters, min(LATENCY_WARMUP, config.latency_iters)
    for i, n in enumerate(config.latency_sizes):
        s_view, d_view = src[:n], dst[:n]
        s_view.fill_((17 * i + 29) % 251 + 1)
        d_view.fill_(0)
        with x.handle("WRITE", s_view) as write:
            out.append(_latency("put", n, timed(functools.partial(x.wait, write), iters, warmup)))
        with x.handle("READ", d_view) as read:
            out.append(_latency("get", n, timed(functools.partial(x.wait, read), iters, warmup)))
        if not torch.equal(s_view, d_view):
            raise BenchError(f"{format_size(n)} READ back from the NIXL target differs from what was written")
        new_handle = functools.partial(x.once_with_new_handle, "WRITE", s_view)
        out.append(_latency("put", n, timed(new_handle, iters, warmup), "new handle"))
    return out


def _descs(base: int, count: int, size: int, stride: int) -> np.ndarray:
    """An Nx3 descriptor array (address, length, device 0) of ``count`` pieces ``stride`` apart."""
    out = np.zeros((count, 3), dtype=np.uint64)
    out[:, 0] = base + np.arange(count, dtype=np.uint64) * stride
    out[:, 1] = size
    return out


def _measure_batch(x: _Initiator, src: torch.Tensor, dst: torch.Tensor) -> DescListResult:
    """The batch as one transfer from one descriptor list per side, prepared once."""
    n, size, stride = BATCH_SEGMENTS, BATCH_SEGMENT_BYTES, BATCH_STRIDE
    if x.hello.nbytes < (n - 1) * stride + size or min(src.numel(), dst.numel()) < n * size:
        raise BenchError(f"the buffers are too small for the batch of {n} x {format_size(size)}")
    stamps = (torch.arange(n) % 251 + 1).to(torch.uint8)
    s_view, d_view = src[: n * size].view(n, size), dst[: n * size].view(n, size)
    s_view.copy_(stamps[:, None].expand(n, size))  # each segment its own stamp
    d_view.fill_(0)
    agent = x.agent
    with contextlib.ExitStack() as stack:
        lists = {}
        for key, (who, descs) in {
            "src": ("NIXL_INIT_AGENT", _descs(src.data_ptr(), n, size, size)),
            "dst": ("NIXL_INIT_AGENT", _descs(dst.data_ptr(), n, size, size)),
            "remote": (x.remote, _descs(x.hello.address, n, size, stride)),
        }.items():
            lists[key] = agent.prep_xfer_dlist(who, descs, MEM_TYPE)
            stack.callback(_quietly, "release_dlist_handle", functools.partial(agent.release_dlist_handle, lists[key]))
        indices = np.arange(n, dtype=np.int32)
        write = agent.make_prepped_xfer("WRITE", lists["src"], indices, lists["remote"], indices)
        stack.callback(_quietly, "release_xfer_handle", functools.partial(agent.release_xfer_handle, write))
        times = timed(functools.partial(x.wait, write), BATCH_ITERS, 1)
        read = agent.make_prepped_xfer("READ", lists["dst"], indices, lists["remote"], indices)
        stack.callback(_quietly, "release_xfer_handle", functools.partial(agent.release_xfer_handle, read))
        x.wait(read)
    if not torch.equal(s_view, d_view):
        raise BenchError(f"the batch of {n} segments READ back from the NIXL target differs from what was written")
    return DescListResult(n, size, stride, BATCH_ITERS, n / median(times))


# -------------------------------------------------------------------------------------------------
# The run


def lifetime_bound(config: BenchConfig) -> float:
    """An upper bound on the NIXL part of a run (every transfer is bounded by ``config.timeout``),
    so the target exits by itself even if the socket never closes."""
    transfers = sum(config.iters_for(n) + config.warmup for n in config.table_sizes) * 2
    transfers += len(config.latency_sizes) * 3 * (config.latency_iters + LATENCY_WARMUP)
    transfers += BATCH_ITERS + 2
    return START_TIMEOUT_S + config.timeout * (transfers + 2)


def _initiate(
    api: ModuleType,
    config: BenchConfig,
    src: torch.Tensor,
    dst: torch.Tensor,
    memcpy_gbps: dict[int, float],
    hello: TargetHello,
) -> PeerResult:
    """Everything measured with NIXL, against the target that sent ``hello`` (which holds
    ``config.region_bytes``, as :func:`measure_peer` checked)."""
    # No progress thread here: the initiator polls every transfer to completion, and those
    # polls progress the worker; NIXL's thread (which spins) would only compete for the cores
    # (on a 2-core machine it cost this process's large WRITEs and its batch a third of their
    # rate). The target keeps its thread (see there).
    agent = make_agent(api, INITIATOR_AGENT, progress_thread=False)
    try:
        return _measure_with(agent, hello, config, src, dst, memcpy_gbps)
    finally:
        # NIXL's Python API has no close: dropping the last reference destroys the agent (its
        # UCX workers and endpoints) here, before the connection closes and the target goes.
        del agent


def _measure_with(
    agent: Any,
    hello: TargetHello,
    config: BenchConfig,
    src: torch.Tensor,
    dst: torch.Tensor,
    memcpy_gbps: dict[int, float],
) -> PeerResult:
    """Registers ``src`` and ``dst``, loads the target's metadata, measures; undoes both after."""
    with contextlib.ExitStack() as stack:
        for buf in (src, dst):
            descs = agent.get_reg_descs(buf)
            agent.register_memory(descs)
            stack.callback(_quietly, "deregister_memory", functools.partial(agent.deregister_memory, descs))
        remote = agent.add_remote_agent(hello.metadata)
        stack.callback(_quietly, "remove_remote_agent", functools.partial(agent.remove_remote_agent, remote))
        x = _Initiator(agent, remote, hello, config.timeout)
        detail = (
            f"{nixl_version()}, {NIXL_BACKEND} backend, DRAM, two processes; this process polls each transfer "
            "(no progress thread), the target runs NIXL's"
        )
        result = PeerResult(PEER_NAME, detail=detail)
        result.sizes = _measure_sizes(x, config, src, dst, memcpy_gbps)
        result.latency = _measure_latency(x, config, src, dst)
        result.batch.append(_measure_batch(x, src, dst))
        return result


def measure(
    config: BenchConfig, src: torch.Tensor, dst: torch.Tensor, memcpy_gbps: dict[int, float], workdir: Path
) -> PeerResult:
    """Measures NIXL the way :mod:`benchmarks.p2p` measures a backend (blocking; starts and always
    joins the NIXL target process).

    Args:
        config: the run's configuration (sizes, iterations, timeout).
        src: this process's source buffer, at least ``config.region_bytes`` (pre-faulted).
        dst: this process's destination buffer, the same size.
        memcpy_gbps: the memcpy baseline per table size, for the put/memcpy columns.
        workdir: a private temporary directory (the socket and the target's log go there).

    Returns:
        The results; or, when NIXL is not installed or anything about it failed, a result whose
        ``unavailable`` says why (the message of what NIXL or its target printed).
    """
    args = ("--nbytes", str(config.region_bytes), "--timeout", str(config.timeout),
            "--lifetime", str(lifetime_bound(config)))

    def initiate(api: ModuleType, hello: TargetHello) -> PeerResult:
        return _initiate(api, config, src, dst, memcpy_gbps, hello)

    return measure_peer(PEER_NAME, load_api, INSTALL_HINT, nixl_version, f"{__package__}._nixl_target", args, workdir,
                        config, initiate)
