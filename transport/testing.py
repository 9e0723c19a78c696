"""Tools for testing backends: the conformance suite and a fault-injecting backend wrapper.

:func:`check_backend` runs the checks every backend must pass (the library's own conformance
suite, made public): a third-party backend registered with :func:`transport.register_backend`
passes them before anyone relies on it::

    transport.register_backend("nixl", NixlBackend)
    await transport.testing.check_backend(transport.testing.pair_factory("nixl"))

:func:`faulty` wraps a real backend class so that a chosen put/get fails, stalls, drops its
connection or kills its target at a chosen byte; :func:`temporary_backend` registers such a
class for a ``with`` block (here under the built-in name, so peers run the plain backend)::

    stall = Fault(FaultKind.STALL, at_byte=1 << 20, peer="gen-1")
    with temporary_backend(faulty(backend_class("tcp"), stall), replace=True):
        async with transport.Transport("trainer", backends=("tcp",)) as t:
            ...  # the first put to gen-1 moves 1 MiB, then hangs until its timeout

The conformance checks themselves live in :mod:`transport._conformance`.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import inspect
import logging
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import anyio

from . import PeerLostError, TransferOp, TransportError, TransportInternalError
from ._conformance import CHECKS, PairFactory, check_backend, pair_factory
from ._host import host_id, process_alive
from ._public import rehome
from ._wire import PeerRecord, RegionRecord
from .backends import (
    Backend,
    BackendContext,
    LocalBuffer,
    RemoteTarget,
    Runner,
    Runs,
    register_backend,
    registered_backends,
    unregister_backend,
)

log = logging.getLogger(__name__)

_DEATH_POLL_S = 0.005
# The FaultyBackend whose base backend the current task is running (see FaultyBackend.put).
_DELEGATING: contextvars.ContextVar[FaultyBackend | None] = contextvars.ContextVar("_DELEGATING", default=None)


class FaultKind(enum.Enum):
    """What an injected fault does once the bytes before its position have moved."""

    FAIL = "fail"  # the call raises ``Fault.error``
    STALL = "stall"  # the call blocks until cancelled: the transfer's timeout must fire
    DROP = "drop"  # the base backend forgets the peer (connections, mappings) and the call
    #               fails with PeerLostError, as a transfer whose connection breaks does
    KILL = "kill"  # the target process is SIGKILLed; the rest of the transfer then goes through
    #               the base backend, which meets a dead peer


@dataclass(frozen=True)
class Fault:
    """One fault to inject into a :func:`faulty` backend.

    A backend call is one put or get the Transport asks of the backend (a transfer staged
    through a bounce buffer makes one call per piece). Calls are counted per backend instance
    (that is, per Transport), and only those that match ``op`` and ``peer``; the fault strikes
    once, at call number ``at_call``.

    Attributes:
        kind: what happens (:class:`FaultKind`).
        at_call: the 1-based number of the matching call that is hit.
        at_byte: where in that call's bytes the fault strikes: the bytes before it (rounded down
            to a whole element) move for real through the base backend first; ``0`` strikes
            before any byte moves, a value past the end after all of them.
        op: count only puts or only gets (None: both).
        peer: count only calls to this peer (None: any).
        error: the TransportError subclass a ``FAIL`` raises.
    """

    kind: FaultKind
    at_call: int = 1
    at_byte: int = 0
    op: TransferOp | None = None
    peer: str | None = None
    error: type[TransportError] = TransportInternalError

    def __post_init__(self) -> None:
        """Validates the fields (they may come from untyped code).

        Raises:
            TypeError: a field of the wrong type.
            ValueError: ``at_call`` < 1 or ``at_byte`` < 0.
        """
        fields: dict[str, object] = vars(self)
        if not isinstance(fields["kind"], FaultKind):
            raise TypeError(f"kind must be a FaultKind, got {self.kind!r}")
        for name, least in (("at_call", 1), ("at_byte", 0)):
            value = fields[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        op, error = fields["op"], fields["error"]
        if op is not None and not isinstance(op, TransferOp):
            raise TypeError(f"op must be a TransferOp or None, got {op!r}")
        if not (isinstance(error, type) and issubclass(error, TransportError)):
            raise TypeError(f"error must be a TransportError subclass, got {error!r}")

    def matches(self, op: TransferOp, peer: str) -> bool:
        """Whether a call of ``op`` to ``peer`` counts towards this fault."""
        return (self.op is None or self.op == op) and (self.peer is None or self.peer == peer)


@dataclass(frozen=True)
class Injection:
    """A fault that struck: which call, and how many of its bytes had moved for real."""

    fault: Fault
    op: TransferOp
    peer: str
    key: str
    offset: int  # the call's byte offset in the remote region
    nbytes: int  # the call's size
    moved: int  # bytes moved through the base backend before the fault


class FaultyBackend(Backend):
    """The fault-injecting layer that :func:`faulty` puts in front of a real backend class.

    Everything except ``put``/``get``/``move`` is the base backend's own code (this class comes
    first in the method resolution order and delegates with ``super()``; its own helpers have
    mangled names so that they cannot shadow the base backend's). Its shortcuts are turned off
    so that every byte passes a fault: no synchronous path (``mover`` is None), and a prepared
    transfer's runs go one ``move`` each (the default ``prepare_runs``).

    Attributes:
        faults: the faults this class injects (set by :func:`faulty`).
        injected: every fault that struck, in order, across the class's instances.
    """

    faults: ClassVar[tuple[Fault, ...]] = ()
    injected: ClassVar[list[Injection]]

    def __init__(self, ctx: BackendContext) -> None:
        """As the base backend's, plus this instance's count of matching calls per fault."""
        super().__init__(ctx)
        self.__calls = [0] * len(self.faults)

    def mover(self, op: TransferOp, peer: PeerRecord, region: RegionRecord) -> Callable[[int, int, int], bool] | None:
        """None: every transfer takes ``put``/``get``, where the faults are."""
        return None

    def prepare_runs(self, op: TransferOp, peer: PeerRecord, lists: Sequence[tuple[Runs, RegionRecord]]) -> Runner:
        """The default runner (each run one ``move``, where the faults are)."""
        return Backend.prepare_runs(self, op, peer, lists)

    # A base backend may implement put/get on top of move or the other way round, so the
    # entry points that its own code calls while this class delegates to it pass straight
    # through (``_DELEGATING``: per task, so concurrent transfers do not see each other's).

    async def put(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        """As the base backend's put, with the faults of this class injected."""
        if _DELEGATING.get() is self:
            await super().put(local, remote)  # type: ignore[safe-super]  # (the base's: see __move)
        else:
            await self.__inject(TransferOp.PUT, local, remote)

    async def get(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        """As the base backend's get, with the faults of this class injected."""
        if _DELEGATING.get() is self:
            await super().get(local, remote)  # type: ignore[safe-super]  # (the base's: see __move)
        else:
            await self.__inject(TransferOp.GET, local, remote)

    async def move(self, op: TransferOp, local: LocalBuffer, remote: RemoteTarget) -> None:
        """As the base backend's move (its put or get), with the faults of this class injected."""
        if _DELEGATING.get() is self:
            await super().move(op, local, remote)
        else:
            await self.__inject(op, local, remote)

    def __due(self, op: TransferOp, peer: str) -> Fault | None:
        due = None
        for i, fault in enumerate(self.faults):
            if fault.matches(op, peer):
                self.__calls[i] += 1
                if self.__calls[i] == fault.at_call and due is None:
                    due = fault
        return due

    async def __inject(self, op: TransferOp, local: LocalBuffer, remote: RemoteTarget) -> None:
        fault = self.__due(op, remote.peer.name)
        if fault is None:
            await self.__move(op, local, remote, 0, remote.nbytes)
            return
        itemsize = local.tensor.element_size()
        at = min(fault.at_byte, remote.nbytes) // itemsize * itemsize
        await self.__move(op, local, remote, 0, at)
        struck = Injection(fault, op, remote.peer.name, remote.region.key, remote.offset, remote.nbytes, at)
        type(self).injected.append(struck)
        what = f"{op.value} of {remote.nbytes} bytes to {remote.peer.name}:{remote.region.key!r}"
        log.info("transport %s: injecting %s into the %s after %d bytes", self.ctx.name, fault.kind.value, what, at)
        if fault.kind == FaultKind.FAIL:
            raise fault.error(f"injected fault: {what} failed after {at} bytes")
        if fault.kind == FaultKind.DROP:
            self.forget_peer(remote.peer.name)
            raise PeerLostError(
                f"connection to {remote.peer.name} dropped (injected fault) after {at} bytes of the {what}"
            )
        if fault.kind == FaultKind.STALL:
            await anyio.sleep_forever()  # until the transfer's deadline (or a cancel) ends it
        else:  # KILL
            await _kill(remote.peer)
            await self.__move(op, local, remote, at, remote.nbytes)

    async def __move(self, op: TransferOp, local: LocalBuffer, remote: RemoteTarget, start: int, stop: int) -> None:
        """Moves bytes ``[start, stop)`` of the call through the base backend."""
        if stop <= start:
            return
        if (start, stop) != (0, remote.nbytes):
            itemsize = local.tensor.element_size()
            flat = local.tensor.reshape(-1)[start // itemsize : stop // itemsize]
            local = LocalBuffer(flat, local.kind, ready=local.ready)
            remote = RemoteTarget(remote.peer, remote.region, remote.offset + start, stop - start)
        # super() is the real backend: faulty() puts this class first in the bases of a subclass
        # of it. Its move runs its own put/get (or is its implementation); they pass through.
        token = _DELEGATING.set(self)
        try:
            await super().move(op, local, remote)
        finally:
            _DELEGATING.reset(token)


async def _kill(peer: PeerRecord) -> None:
    """SIGKILLs ``peer``'s process and waits until it has exited (or the caller's deadline)."""
    if peer.host != host_id() or peer.pid == os.getpid():
        raise TransportInternalError(
            f"injected kill: {peer.name} (pid {peer.pid}) is not another process on this host; a kill fault needs one"
        )
    if process_alive(peer.pid, peer.pid_start):  # never signal a process that reused the pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(peer.pid, signal.SIGKILL)
    while process_alive(peer.pid, peer.pid_start):
        await anyio.sleep(_DEATH_POLL_S)


def faulty(base: type[Backend], *faults: Fault, name: str | None = None) -> type[FaultyBackend]:
    """A backend class that behaves as ``base`` except for the injected ``faults``.

    Register it to use it: under a new name (both ends must then speak that name) or, with
    :func:`temporary_backend` and ``replace=True``, under ``base.name`` so that peers running
    the plain base backend (e.g. in other processes) serve it unchanged.

    Args:
        base: a concrete backend class (``TcpBackend``, ``IpcBackend``, ``UcxBackend``, ...).
        faults: the faults to inject; none gives a plain copy of ``base``.
        name: the backend name of the new class (default ``base.name``).

    Returns:
        A subclass of ``base`` and :class:`FaultyBackend`; its ``injected`` list records the
        faults that struck.

    Raises:
        TypeError: ``base`` is not a concrete Backend subclass, or a fault is not a Fault.
    """
    _check_faulty_args(base, faults)
    namespace = {
        "name": name or base.name,
        "faults": tuple(faults),
        "injected": [],
        "__module__": __name__,
        "__doc__": f"{base.__qualname__} with injected faults: {', '.join(f.kind.value for f in faults) or 'none'}.",
    }
    return type(f"Faulty{base.__name__}", (FaultyBackend, base), namespace)


def _check_faulty_args(base: object, faults: tuple[object, ...]) -> None:
    """Raises TypeError unless ``base`` is a concrete Backend class and ``faults`` are Faults."""
    if not (isinstance(base, type) and issubclass(base, Backend)) or inspect.isabstract(base):
        raise TypeError(f"base must be a concrete Backend subclass, got {base!r}")
    for f in faults:
        if not isinstance(f, Fault):
            raise TypeError(f"faults must be Fault objects, got {f!r}")


@contextlib.contextmanager
def temporary_backend(cls: type[Backend], *, replace: bool = False) -> Iterator[type[Backend]]:
    """Registers ``cls`` under ``cls.name`` for the ``with`` block, then restores what that
    name meant before (or forgets it).

    Args:
        cls: the backend class.
        replace: allow swapping a name that is already registered (a built-in one included).

    Yields:
        ``cls``.

    Raises:
        As :func:`transport.register_backend`.
    """
    previous = registered_backends().get(cls.name)
    register_backend(cls.name, cls, replace=replace)
    try:
        yield cls
    finally:
        if previous is None:
            unregister_backend(cls.name)
        else:
            register_backend(cls.name, previous, replace=True)


__all__ = [
    "CHECKS",
    "Fault",
    "FaultKind",
    "FaultyBackend",
    "Injection",
    "PairFactory",
    "check_backend",
    "faulty",
    "pair_factory",
    "temporary_backend",
]

rehome(globals(), __all__, __name__)
