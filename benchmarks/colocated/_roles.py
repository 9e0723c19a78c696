"""What each process of the colocated benchmark does: one trainer and K generators on one device.

The K + 1 processes build their state dicts once (the trainer: random bf16 values; the
generators: zeros), then run the same steps in the same order, each ended by a barrier of all
of them (so no two steps overlap and each frees its memory before the next allocates):

1. the **floor**: the trainer copies the model's bytes K times with one ``copy_`` each (a flat
   source into a flat destination, one process, the generators idle);
2. one **phase per method** (:class:`Method`), each a schedule of versions (:class:`Step`):
   ``transport.weights`` with copying and with zero-copy apply (a Transport, Publisher and
   Subscribers of their own, on a store of their own, over ``ipc``), then the IPC-handle
   baseline; the copy phase ends with the straggler version and one more version;
3. after each phase, every process reports one checksum per tensor (untimed): the parent checks
   that every generator holds exactly the trainer's last version.

Timing (``time.clock_gettime(CLOCK_MONOTONIC)``: one clock for every process of this host), per
version, after a handshake outside the timed region (every generator is waiting for it):

* transport: the trainer's clock is read right before ``publish()``; the trainer is *blocked*
  for the call; a generator has the version *live* once ``await sub.wait_version(v)`` returned
  (applied: the device copies done, or the tensors re-pointed);
* IPC handles: the trainer's clock is read when the version is ready (its device work
  synchronized) and it tells the generators (a pipe message); a generator has it live once it
  copied every tensor from the trainer's and synchronized; the trainer is blocked until every
  generator said so (before that it may not touch its weights).

Messages go to the parent through a ``multiprocessing`` queue (plain dicts): ``state``,
``floor``, ``version`` (trainer), ``arrival`` (generator), ``sums`` (end of a phase), ``error``.
The trainer and each generator also share a pipe: the generator's pid (for ``SIGSTOP``), and
the IPC baseline's handles and doorbells. Every wait is bounded by ``Spec.timeout``.
"""

from __future__ import annotations

import enum
import gc
import logging
import os
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..common.errors import BenchError
from ..common.procs import output_to
from ..common.stats import median
from ..weight_sync._models import stamp_mismatches
from ._models import advance, build_state, model_bytes, placeholders, tensor_sums

TRAINER = "trainer"
CATCH_UP_S = 20.0  # the stopped generator's wait for its version after SIGCONT, before it pulls
FLOOR_WARMUP = 2

Emit = Callable[[dict[str, Any]], None]


def now() -> float:
    """Seconds on the host's monotonic clock, the same in every process."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


class Method(enum.Enum):
    """What one phase measures."""

    COPY = "transport/copy"  # Subscriber(..., device=<slots where the weights are>)
    ZERO_COPY = "transport/zero-copy"  # the same with zero_copy=True
    IPC_HANDLES = "ipc-handles"  # reduce_tensor once, the generators copy from the trainer's tensors

    @property
    def transport(self) -> bool:
        return self is not Method.IPC_HANDLES


class Kind(enum.Enum):
    """What one version of a phase is for."""

    WARMUP = "warmup"  # not timed
    TIMED = "timed"
    STRAGGLER = "straggler"  # the last generator is SIGSTOPped during it
    RECOVER = "recover"  # the version after the straggler one: every generator again


@dataclass(frozen=True)
class Step:
    version: int
    kind: Kind


@dataclass(frozen=True)
class Spec:
    """Everything the processes need (pickled to each spawned process)."""

    device: str  # "cuda" or "cpu"
    model: str
    k: int
    warmup: int
    versions: int
    straggler: bool
    stop_s: float
    timeout: float
    bucket_bytes: int
    floor_iters: int
    tmp: str
    methods: tuple[Method, ...] = (Method.COPY, Method.ZERO_COPY, Method.IPC_HANDLES)
    seed: int = 0
    run_timeout_s: float = 600.0  # the whole run (the parent's bound)

    @property
    def generators(self) -> list[str]:
        return [f"gen-{i}" for i in range(self.k)]

    @property
    def stopped(self) -> str | None:
        """The generator SIGSTOPped in the straggler version (the last), or None without one."""
        return self.generators[-1] if self.straggler and self.k >= 2 else None

    def torch_device(self) -> torch.device:
        return torch.device("cuda", 0) if self.device == "cuda" else torch.device("cpu")

    def steps(self, method: Method) -> list[Step]:
        """Versions 1, 2, ...: warm-up, timed, and (copy apply, with a straggler) one straggler
        version and one after it."""
        kinds = [Kind.WARMUP] * self.warmup + [Kind.TIMED] * self.versions
        if method is Method.COPY and self.stopped is not None:
            kinds += [Kind.STRAGGLER, Kind.RECOVER]
        return [Step(v, kind) for v, kind in enumerate(kinds, start=1)]

    def log_path(self, who: str) -> Path:
        return Path(self.tmp) / f"{who}.log"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class _Barrier:
    """The group's barrier, every wait bounded."""

    def __init__(self, barrier: Any, timeout: float, who: str) -> None:
        self._barrier, self._timeout, self._who = barrier, timeout, who

    def wait(self, where: str) -> None:
        import threading

        try:
            self._barrier.wait(self._timeout)
        except threading.BrokenBarrierError:
            raise BenchError(f"{self._who}: the other processes did not reach '{where}' within {self._timeout:g} s "
                             "(one failed or is stuck)") from None


def _recv(conn: Any, expect: str, version: int | None, timeout: float, who: str) -> Any:
    """The next pipe message, which must be ``(expect, version, ...)``; bounded."""
    if not conn.poll(timeout):
        raise BenchError(f"{who}: no '{expect}' message within {timeout:g} s")
    msg = conn.recv()
    if msg[0] != expect or (version is not None and msg[1] != version):
        raise BenchError(f"{who}: expected ({expect!r}, {version}), got {msg[:2]!r}")
    return msg


# -- the floor -------------------------------------------------------------------------------------


def measure_floor(nbytes: int, k: int, device: torch.device, iters: int) -> dict[str, Any]:
    """K copies of ``nbytes`` with one ``copy_`` each, from one flat buffer into another, in this
    process (every page touched first): the least K generators' copies of the model can take.
    Median of ``iters`` after ``FLOOR_WARMUP``, each timed from a synchronize to a synchronize.
    The buffers are freed before it returns."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(2)
    times = []
    try:
        for i in range(FLOOR_WARMUP + iters):
            _sync(device)
            t0 = now()
            for _ in range(k):
                dst.copy_(src)
            _sync(device)
            if i >= FLOOR_WARMUP:
                times.append(now() - t0)
        if not bool(torch.equal(dst[: 1 << 20], src[: 1 << 20])):
            raise BenchError("floor: the copy's destination differs from its source")
    finally:
        del src, dst
        _release_memory(device)
    seconds = median(times)
    return {"seconds": seconds, "all_s": times, "copies": k, "nbytes": nbytes, "gbps": k * nbytes / seconds / 1e9,
            "iters": iters, "threads": torch.get_num_threads() if device.type == "cpu" else None}


# -- transport.weights -----------------------------------------------------------------------------


def _store(spec: Spec, method: Method) -> str:
    return "file://" + os.path.join(spec.tmp, "store-" + method.value.replace("/", "-"))


async def _transport_trainer(spec: Spec, method: Method, state: dict[str, torch.Tensor], pids: dict[str, int],
                             emit: Emit) -> None:
    import anyio

    import transport
    from transport.weights import Publisher

    device = spec.torch_device()
    steps = spec.steps(method)
    gens = spec.generators
    async with (
        transport.Transport(TRAINER, store=_store(spec, method), backends=("ipc",), timeout=spec.timeout) as t,
        Publisher(t, state, deadline=spec.timeout, bucket_bytes=spec.bucket_bytes, delta=False) as pub,
    ):
        with anyio.fail_after(spec.timeout):
            while len(await pub.subscribers()) < spec.k:
                await anyio.sleep(0.02)
        await pub.warm()  # every slot's push prepared and its mapping made, as a long-running trainer has
        for step in steps:
            advance(state, step.version)
            _sync(device)
            for g in gens:  # handshake, outside the timed region: every generator waits for this version
                await t.wait_signal(f"ready.{g}", at_least=step.version, timeout=spec.timeout)
            stopped = spec.stopped if step.kind is Kind.STRAGGLER else None
            extra: dict[str, Any] = {}
            if stopped is not None:
                os.kill(pids[stopped], signal.SIGSTOP)
            try:
                t_start = now()
                report = await pub.publish(step.version)
                blocked = now() - t_start
                if stopped is not None:
                    for g in gens:
                        if g != stopped:
                            await t.wait_signal(f"live.{g}", at_least=step.version, timeout=spec.timeout)
                    await anyio.sleep(max(0.0, spec.stop_s - (now() - t_start)))
            finally:
                if stopped is not None:
                    extra = {"stopped": stopped, "t_cont": now()}
                    os.kill(pids[stopped], signal.SIGCONT)
            status = {g: r.status.value for g, r in report.results.items()}
            late = [g for g in gens if g != stopped and status.get(g) != "done"]
            if late:
                raise BenchError(f"{method.value} version {step.version}: not done on {', '.join(late)}: "
                                 f"{ {g: report.results[g].error for g in late if g in report.results} }")
            f0 = now()  # the snapshot pull() reads is filled in the background: kept out of the next version
            await pub.wait_snapshot(timeout=spec.timeout)
            emit({
                "kind": "version", "method": method.value, "version": step.version, "step": step.kind.value,
                "t_start": t_start, "blocked_s": blocked, "snapshot_fill_s": now() - f0, "status": status,
                "data_complete_s": {g: r.seconds for g, r in report.results.items()},
                "phases": report.phases, **extra,
            })
        for g in gens:  # they have applied the last version
            await t.wait_signal(f"ready.{g}", at_least=steps[-1].version + 1, timeout=spec.timeout)


async def _transport_generator(spec: Spec, method: Method, index: int, state: dict[str, torch.Tensor],
                               emit: Emit) -> None:
    import transport
    from transport.weights import Subscriber

    name = spec.generators[index]
    steps = spec.steps(method)
    device = spec.torch_device()
    zero_copy = method is Method.ZERO_COPY
    if zero_copy:
        placeholders(state)
        _release_memory(device)
    async with (
        transport.Transport(name, store=_store(spec, method), backends=("ipc",), timeout=spec.timeout) as t,
        Subscriber(t, state, publisher=TRAINER, device=device, zero_copy=zero_copy, delta=False) as sub,
    ):
        for step in steps:
            await t.signal(TRAINER, f"ready.{name}", step.version, timeout=spec.timeout)
            stopped = step.kind is Kind.STRAGGLER and name == spec.stopped
            via = "slot"
            if stopped:
                # SIGSTOPped in here by the trainer; once continued, its version is in a slot, or
                # (had the publisher given up on it) in the publisher's snapshot.
                try:
                    await sub.wait_version(step.version, timeout=min(spec.timeout, CATCH_UP_S))
                except transport.TransferTimeoutError:
                    via = "pull"
                    await sub.pull(timeout=spec.timeout)
            else:
                await sub.wait_version(step.version, timeout=spec.timeout)
            t_live = now()
            if step.kind is Kind.STRAGGLER and not stopped:
                await t.signal(TRAINER, f"live.{name}", step.version, timeout=spec.timeout)
            emit({"kind": "arrival", "method": method.value, "version": step.version, "generator": name,
                  "t_live": t_live, "applied": sub.version, "stopped": stopped, "via": via,
                  "mismatches": stamp_mismatches(state, step.version)})
        await t.signal(TRAINER, f"ready.{name}", steps[-1].version + 1, timeout=spec.timeout)


# -- the baseline: IPC handles ---------------------------------------------------------------------


def _ipc_trainer(spec: Spec, state: dict[str, torch.Tensor], conns: Sequence[Any], emit: Emit) -> None:
    """vLLM's ``ipc`` weight transfer, reduced to its mechanism: ``reduce_tensor`` on every
    tensor once (a CUDA IPC handle of its allocation; on the CPU, its storage moved to shared
    memory), the handles sent once, and each version announced with a message."""
    from torch.multiprocessing.reductions import reduce_tensor

    device = spec.torch_device()
    with warnings.catch_warnings():  # reduce_tensor touches TypedStorage, deprecated
        warnings.simplefilter("ignore", UserWarning)
        handles = [(name, *reduce_tensor(t)) for name, t in state.items()]
        for c in conns:
            c.send(("handles", 0, handles))
    for g, c in zip(spec.generators, conns, strict=True):
        _recv(c, "opened", 0, spec.timeout, f"trainer <- {g}")
    steps = spec.steps(Method.IPC_HANDLES)
    for step in steps:
        advance(state, step.version)
        _sync(device)
        for g, c in zip(spec.generators, conns, strict=True):  # handshake, outside the timed region
            _recv(c, "ready", step.version, spec.timeout, f"trainer <- {g}")
        t_start = now()
        for c in conns:
            c.send(("go", step.version))
        for g, c in zip(spec.generators, conns, strict=True):
            _recv(c, "done", step.version, spec.timeout, f"trainer <- {g}")
        blocked = now() - t_start
        emit({"kind": "version", "method": Method.IPC_HANDLES.value, "version": step.version,
              "step": step.kind.value, "t_start": t_start, "blocked_s": blocked})
    for c in conns:
        c.send(("end", 0))
    for g, c in zip(spec.generators, conns, strict=True):  # their imports are closed before ours may go
        _recv(c, "released", 0, spec.timeout, f"trainer <- {g}")


def _ipc_generator(spec: Spec, index: int, state: dict[str, torch.Tensor], conn: Any, emit: Emit) -> None:
    name = spec.generators[index]
    device = spec.torch_device()
    who = f"{name} <- trainer"
    handles = _recv(conn, "handles", 0, spec.timeout, who)[2]
    src = {n: rebuild(*args) for n, rebuild, args in handles}  # opens each allocation's handle once
    if list(src) != list(state) or any(src[n].shape != state[n].shape for n in state):
        raise BenchError(f"{name}: the trainer's tensors do not match this generator's")
    pairs = [(state[n], src[n]) for n in state]
    _sync(device)
    conn.send(("opened", 0))
    for step in spec.steps(Method.IPC_HANDLES):
        conn.send(("ready", step.version))
        _recv(conn, "go", step.version, spec.timeout, who)
        with torch.no_grad():
            for dst, s in pairs:
                dst.copy_(s)
        _sync(device)
        t_live = now()
        conn.send(("done", step.version))
        emit({"kind": "arrival", "method": Method.IPC_HANDLES.value, "version": step.version, "generator": name,
              "t_live": t_live, "applied": step.version, "stopped": False, "via": "copy",
              "mismatches": stamp_mismatches(state, step.version)})
    _recv(conn, "end", 0, spec.timeout, who)
    del src, pairs, handles
    _release_memory(device)
    conn.send(("released", 0))


# -- process entry points --------------------------------------------------------------------------


def _phases(spec: Spec, barrier: _Barrier, emit: Emit, run: Callable[[Method], None],
            state: dict[str, torch.Tensor]) -> None:
    device = spec.torch_device()
    for method in spec.methods:
        run(method)
        _release_memory(device)  # the phase's slots (or mappings) go before the next phase allocates
        _sync(device)
        emit({"kind": "sums", "method": method.value, "sums": tensor_sums(state)})
        barrier.wait(f"the end of {method.value}")


def run_trainer(spec: Spec, q: Any, barrier: Any, conns: Sequence[Any]) -> None:
    """Entry point of the trainer process (see the module docstring)."""
    import trio

    def emit(msg: dict[str, Any]) -> None:
        q.put({"who": TRAINER, **msg})

    _run(spec, TRAINER, emit, lambda: _trainer(spec, emit, _Barrier(barrier, spec.timeout, TRAINER), conns, trio))


def _trainer(spec: Spec, emit: Emit, barrier: _Barrier, conns: Sequence[Any], trio: Any) -> None:
    device = spec.torch_device()
    pids = {g: _recv(c, "pid", 0, spec.timeout, f"trainer <- {g}")[2] for g, c in zip(spec.generators, conns,
                                                                                        strict=True)}
    state = build_state(spec.model, device, seed=spec.seed)
    _sync(device)
    emit({"kind": "state", "nbytes": sum(t.numel() * t.element_size() for t in state.values()),
          "tensors": len(state)})
    barrier.wait("every state dict built")
    floor = measure_floor(model_bytes(spec.model), spec.k, device, spec.floor_iters)
    emit({"kind": "floor", **floor})
    barrier.wait("the floor measured")

    def run(method: Method) -> None:
        if method.transport:
            trio.run(_transport_trainer, spec, method, state, pids, emit)
        else:
            _ipc_trainer(spec, state, conns, emit)

    _phases(spec, barrier, emit, run, state)


def run_generator(spec: Spec, index: int, q: Any, barrier: Any, conn: Any) -> None:
    """Entry point of generator ``index`` (see the module docstring)."""
    import trio

    name = spec.generators[index]

    def emit(msg: dict[str, Any]) -> None:
        q.put({"who": name, **msg})

    def body() -> None:
        conn.send(("pid", 0, os.getpid()))
        device = spec.torch_device()
        if device.type == "cpu":  # the K generators copy at once: each its share of the cores (torch's
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.k))  # threads spin, oversubscribed)
        state = build_state(spec.model, device, seed=None)
        _sync(device)
        emit({"kind": "state", "nbytes": sum(t.numel() * t.element_size() for t in state.values()),
              "tensors": len(state)})
        group = _Barrier(barrier, spec.timeout, name)
        group.wait("every state dict built")
        group.wait("the floor measured")

        def run(method: Method) -> None:
            if method.transport:
                trio.run(_transport_generator, spec, method, index, state, emit)
            else:
                _ipc_generator(spec, index, state, conn, emit)

        _phases(spec, group, emit, run, state)

    _run(spec, name, emit, body)


def _run(spec: Spec, who: str, emit: Emit, body: Callable[[], None]) -> None:
    """Runs a process's body with its output (native code's too) in its log; reports any failure
    with its traceback, then exits 1."""
    output_to(spec.log_path(who))
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {who} %(name)s: %(message)s")
    try:
        if spec.device == "cuda":
            torch.cuda.set_device(0)
        body()
        emit({"kind": "exit"})
    except BaseException as exc:  # noqa: BLE001 - report anything, then fail: the parent stops the group
        # The traceback goes to the parent; the log keeps what else the process wrote.
        emit({"kind": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        sys.exit(1)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
