"""What each process of one benchmark group does: one trainer and K generators.

A *group* is one (state-dict size, K) point. Its K + 1 processes build their state dicts once
and then run the same *phases* in the same order, one per method: first ``transport.weights``
over each backend, then each broadcast baseline. A phase is a schedule of versions
(:func:`schedule`): warm-up versions, timed versions, then timed versions with one straggling
generator (when K >= 2).

Timing, per version (wall clock, ``time.time()``, shared by all processes of this host):

* the trainer takes the version's start timestamp right after a handshake that is outside the
  timed region (transport: every generator has rung ``ready.<name>`` with this version;
  broadcast: ``dist.barrier()``);
* the trainer is *blocked* for the duration of ``publish()`` (transport) or of its packing and
  broadcast calls (broadcast);
* a generator *has* the version when it is live in its tensors: after ``await
  sub.wait_version(v)`` returns (which applies it) or after its last broadcast call and unpack
  returns. It reports that timestamp; completion = arrival - start;
* the straggler (the last generator) blocks in ``time.sleep(delay)`` right after the handshake
  (its event loop does not run: it is "busy"), then waits for / takes part in the version.

Every process reports through a ``multiprocessing`` queue (plain dicts): ``version`` (trainer),
``arrival`` (generator), ``phase`` (end of a phase, with a checksum of the final weights),
``error``. Every wait is bounded by ``GroupSpec.timeout``.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import gc
import logging
import os
import resource
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from ..common.procs import leave_process_group
from ._broadcast import Baseline, BucketedBroadcast, broadcast_per_param
from ._models import DecoderConfig, checksum, make_state, stamp, stamp_mismatches

TRAINER = "trainer"
TRANSPORT_PREFIX = "transport/"
ZERO_COPY_SUFFIX = "/zero-copy"  # "transport/<backend>/zero-copy": Subscriber(..., zero_copy=True)

Emit = Callable[[dict[str, Any]], None]


class Role(enum.Enum):
    TRAINER = "trainer"
    GENERATOR = "generator"


@dataclass(frozen=True)
class Step:
    """One version of a phase's schedule."""

    version: int
    straggle: bool  # the straggler generator is delayed in this version
    warmup: bool  # not timed


@dataclass(frozen=True)
class GroupSpec:
    """Everything the processes of one group need (pickled to each spawned process)."""

    config: DecoderConfig
    k: int
    methods: tuple[str, ...]  # "transport/<backend>" or a Baseline value
    versions: int
    straggler_versions: int
    warmup: int
    straggler_delay: float
    bucket_bytes: int
    tmp: str
    timeout: float
    seed: int = 0

    @property
    def generators(self) -> list[str]:
        return [f"gen-{i}" for i in range(self.k)]

    @property
    def straggler(self) -> int | None:
        """Index of the straggling generator (the last one), or None when K < 2 (no 'others')."""
        return self.k - 1 if self.k >= 2 and self.straggler_versions > 0 else None

    def steps(self) -> list[Step]:
        return schedule(self.warmup, self.versions, self.straggler_versions if self.straggler is not None else 0)


def schedule(warmup: int, versions: int, straggler_versions: int) -> list[Step]:
    """Versions 1, 2, ...: ``warmup`` untimed, ``versions`` timed, ``straggler_versions`` timed with
    the straggler delayed."""
    kinds = [(False, True)] * warmup + [(False, False)] * versions + [(True, False)] * straggler_versions
    return [Step(v, straggle, warm) for v, (straggle, warm) in enumerate(kinds, start=1)]


def transport_method(backend: str, zero_copy: bool) -> str:
    """The label of ``transport.weights`` over ``backend``, copying or zero-copy apply."""
    return TRANSPORT_PREFIX + backend + (ZERO_COPY_SUFFIX if zero_copy else "")


def is_transport(method: str) -> bool:
    return method.startswith(TRANSPORT_PREFIX)


def is_zero_copy(method: str) -> bool:
    return is_transport(method) and method.endswith(ZERO_COPY_SUFFIX)


def backend_of(method: str) -> str:
    return method[len(TRANSPORT_PREFIX):].removesuffix(ZERO_COPY_SUFFIX)


def _release(state: dict[str, torch.Tensor]) -> None:
    """Lets go of the tensors' storage, keeping their shapes (a zero-copy subscriber re-points
    them at its slot on the first apply, so their old contents are never read): the generator
    then holds three slots, as much as model + two slots in copy mode, instead of model + three
    slots until the first apply."""
    for t in state.values():
        t.set_(torch.zeros(1, dtype=t.dtype).untyped_storage(), 0, t.shape, (0,) * t.dim())
    _trim_heap()


def _trim_heap() -> None:
    """Returns freed heap memory to the OS (glibc keeps freed chunks that are not at the top of
    its heap, so the model's released storage would otherwise still count)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _own(state: dict[str, torch.Tensor]) -> None:
    """Gives tensors that live in a zero-copy subscriber's slot private storage again, so the
    slots can be freed before the next phase allocates its own."""
    for t in state.values():
        private = t.clone(memory_format=torch.contiguous_format)
        t.set_(private.untyped_storage(), 0, private.shape, private.stride())


# -- transport.weights ---------------------------------------------------------------------------


def _store(spec: GroupSpec, method: str) -> str:
    return f"file://{os.path.join(spec.tmp, 'store-' + method.replace('/', '-'))}"


async def _transport_trainer(spec: GroupSpec, method: str, state: dict[str, torch.Tensor], emit: Emit) -> None:
    import transport
    from transport.weights import Publisher

    backend = backend_of(method)
    steps = spec.steps()
    # The publish deadline is the operation timeout: every version reaches every generator within
    # its own publish (a straggler is waited for, not caught up later), which is what we time.
    async with (
        transport.Transport(TRAINER, store=_store(spec, method), backends=(backend,), timeout=spec.timeout) as t,
        Publisher(t, state, deadline=spec.timeout) as pub,
    ):
        for step in steps:
            stamp(state, step.version)
            for g in spec.generators:  # handshake, outside the timed region
                await t.wait_signal(f"ready.{g}", at_least=step.version, timeout=spec.timeout)
            t_start = time.time()
            p0 = time.perf_counter()
            report = await pub.publish(step.version)
            blocked = time.perf_counter() - p0
            emit({
                "kind": "version", "method": method, "version": step.version, "straggle": step.straggle,
                "warmup": step.warmup, "t_start": t_start, "blocked_s": blocked,
                "snapshot_s": report.snapshot_seconds,
                "data_complete_s": {g: r.seconds for g, r in report.results.items()},
                "status": {g: r.status.value for g, r in report.results.items()},
            })
        for g in spec.generators:  # they have applied the last version
            await t.wait_signal(f"ready.{g}", at_least=steps[-1].version + 1, timeout=spec.timeout)


async def _transport_generator(
    spec: GroupSpec, method: str, index: int, state: dict[str, torch.Tensor], emit: Emit
) -> None:
    import transport
    from transport.weights import Subscriber

    backend = backend_of(method)
    name = spec.generators[index]
    steps = spec.steps()
    zero_copy = is_zero_copy(method)
    if zero_copy:
        _release(state)
    async with (
        transport.Transport(name, store=_store(spec, method), backends=(backend,), timeout=spec.timeout) as t,
        Subscriber(t, state, publisher=TRAINER, zero_copy=zero_copy) as sub,
    ):
        for step in steps:
            await t.signal(TRAINER, f"ready.{name}", step.version, timeout=spec.timeout)
            straggling = step.straggle and index == spec.straggler
            if straggling:
                time.sleep(spec.straggler_delay)  # on purpose: busy, its event loop does not run
            await sub.wait_version(step.version, timeout=spec.timeout)
            arrival = time.time()
            emit({
                "kind": "arrival", "method": method, "version": step.version, "generator": name,
                "arrival": arrival, "straggler": straggling, "mismatches": stamp_mismatches(state, step.version),
            })
        await t.signal(TRAINER, f"ready.{name}", steps[-1].version + 1, timeout=spec.timeout)
    if zero_copy:
        del sub, t  # the slots the tensors do not live in go now, before the copy below
        gc.collect()
        _own(state)


# -- broadcast -----------------------------------------------------------------------------------


def _broadcast_phase(spec: GroupSpec, method: str, rank: int, state: dict[str, torch.Tensor], emit: Emit) -> None:
    import torch.distributed as dist

    baseline = Baseline(method)
    tensors = list(state.values())
    bucketed = BucketedBroadcast(tensors, spec.bucket_bytes) if baseline == Baseline.BUCKETED else None
    name = TRAINER if rank == 0 else spec.generators[rank - 1]
    for step in spec.steps():
        if rank == 0:
            stamp(state, step.version)
        dist.barrier()  # handshake, outside the timed region
        straggling = step.straggle and rank - 1 == spec.straggler
        if straggling:
            time.sleep(spec.straggler_delay)  # it joins the collective late
        t_start = time.time()
        p0 = time.perf_counter()
        if bucketed is not None:
            bucketed(rank)
        else:
            broadcast_per_param(tensors)
        blocked = time.perf_counter() - p0
        if rank == 0:
            emit({"kind": "version", "method": method, "version": step.version, "straggle": step.straggle,
                  "warmup": step.warmup, "t_start": t_start, "blocked_s": blocked})
        else:
            emit({"kind": "arrival", "method": method, "version": step.version, "generator": name,
                  "arrival": time.time(), "straggler": straggling, "mismatches": stamp_mismatches(state, step.version)})
    dist.barrier()


# -- process entry point -------------------------------------------------------------------------


def run_process(role: Role, index: int, spec: GroupSpec, queue: Any) -> None:
    """Entry point of one spawned process: the trainer (``index`` 0) or generator ``index``.

    Builds its state dict (the trainer: random values; generators: zeros), runs every phase of
    ``spec.methods`` in order, and reports through ``queue``. On any failure it reports an
    ``error`` message with the traceback and exits with status 1.
    """
    import trio

    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {role.value}-{index} %(name)s: %(message)s")
    torch.set_num_threads(1)  # K + 1 processes share this host's cores; no intra-op oversubscription
    who = TRAINER if role == Role.TRAINER else spec.generators[index]
    rank = 0 if role == Role.TRAINER else index + 1

    def emit(msg: dict[str, Any]) -> None:
        queue.put({"who": who, **msg})

    pg_ready = False
    try:
        state = make_state(spec.config, seed=spec.seed if role == Role.TRAINER else None)
        emit({"kind": "state", "nbytes": sum(t.numel() * t.element_size() for t in state.values())})
        for method in spec.methods:
            if is_transport(method):
                if role == Role.TRAINER:
                    trio.run(_transport_trainer, spec, method, state, emit)
                else:
                    trio.run(_transport_generator, spec, method, index, state, emit)
            else:
                import torch.distributed as dist

                if not pg_ready:
                    dist.init_process_group(
                        "gloo", init_method=f"file://{os.path.join(spec.tmp, 'gloo-init')}", rank=rank,
                        world_size=spec.k + 1, timeout=timedelta(seconds=spec.timeout),
                    )
                    pg_ready = True
                _broadcast_phase(spec, method, rank, state, emit)
            gc.collect()  # the phase's staging memory goes before the next phase allocates its own
            emit({"kind": "phase", "method": method, "checksum": checksum(state),
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
        emit({"kind": "exit", "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
    except BaseException as exc:  # noqa: BLE001 - report anything, then fail: the launcher kills the group
        emit({"kind": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        sys.exit(1)
    finally:
        if pg_ready:
            leave_process_group()
