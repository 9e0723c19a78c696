"""Which backend moves a transfer, and what is built once per peer record to move it fast.

:class:`Router` owns, for one Transport: the choice of backend for a peer's region from a kind
of local memory (first in preference order that can, with every refusal's reason when none
can); the synchronous routes (:class:`SyncRoute`, one per peer, key, direction and kind of
local memory, valid for one record of the peer) of small host transfers and of device copies
enqueued inside ``put()``; and how to build a prepared transfer's plan for one record
(:class:`BatchPlan`: its backends' reusable runners over their native descriptor lists), which
the transfer engine keeps. The engine asks; nothing here starts, waits for or settles a
transfer, and nothing here knows the engine or a prepared transfer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import _cuda, _pieces
from .._errors import BackendUnavailableError
from .._pieces import RunPiece
from .._staging import staging_kind
from .._tensors import MemoryKind, Runs, dtype_from_name
from .._wire import PeerRecord, RegionRecord, TransferOp
from ..backends import Backend, Runner
from ..backends._base import DeviceMover, Mover
from ..backends._control import WITHDRAWN_SEQ

log = logging.getLogger(__name__)

SYNC_ROUTES_MAX = 4096  # cached (peer, key, op) routes; the cache is reset past this


@dataclass(frozen=True)
class BatchPlan:
    """How one prepared transfer moves to one record of its peer (see :meth:`Router.plan`)."""

    backends: str  # the backends' names, "a,b" for two
    runners: list[Runner]  # each backend's reusable runner (Backend.prepare_runs)
    # Runs of memory their backend does not serve, each with its backend: moved run by run
    # through a bounce buffer at every start.
    staged: list[tuple[Backend, RunPiece]]
    one_sided: bool  # every backend of it moves bytes without the peer's process
    same_host: bool  # every backend of it moves bytes through this host's memory
    # each backend with the runs it serves (what its runner was built from; Backend.warm)
    served: list[tuple[Backend, list[tuple[Runs, RegionRecord]]]]


class SyncRoute:
    """What a synchronous transfer to one region needs, valid for one record of its peer: the
    region's facts for the per-transfer check (the rest of :func:`transport._regions.check`,
    existence, writability and whether it moved, was settled when the route was made), and the
    backend's synchronous path: a host copy (``move(address, offset, nbytes)``, ``Backend.mover``)
    or, with ``device``, a device copy enqueued now (``move(tensor, offset, nbytes)``,
    ``Backend.device_mover``; no size limit)."""

    __slots__ = ("backend", "device", "dtype", "itemsize", "limit", "move", "record")

    def __init__(self, record: PeerRecord, region: RegionRecord | None, backend: Backend | None,
                 move: Mover | DeviceMover | None, device: bool) -> None:
        self.record = record
        self.backend = backend
        self.move = move
        self.device = device
        self.dtype: torch.dtype | None = None
        self.itemsize = self.limit = 0
        if region is not None and move is not None:
            self.dtype = dtype_from_name(region.dtype)
            self.itemsize = self.dtype.itemsize
            self.limit = region.nbytes


class Router:
    """Backend choice, synchronous routes and prepared-transfer plans for one Transport.

    Args:
        name: the Transport's name (for messages).
        backends: the backends in preference order.
    """

    def __init__(self, name: str, backends: Sequence[Backend]) -> None:
        self.name = name
        self._backends = tuple(backends)
        self._fallbacks_logged: set[tuple[str, str]] = set()
        self._sync: dict[tuple[str, str, TransferOp, MemoryKind], SyncRoute] = {}

    def choose(self, record: PeerRecord, region: RegionRecord, kind: MemoryKind) -> Backend:
        """The first backend that can move bytes between ``kind`` memory here and ``region``.
        A host-memory backend serves local CUDA tensors through pinned staging, a device-memory
        backend (nccl) local host tensors through a device buffer.

        Raises:
            BackendUnavailableError: none can, with every backend's reason.
        """
        reasons = []
        for b in self._backends:
            # The memory it would touch here: the tensor itself, or a staging copy of it.
            touch = kind if kind in b.memory_kinds else staging_kind(kind)
            if b.name not in record.backends:
                reasons.append(f"{b.name}: {record.name} does not speak it")
            elif touch not in b.memory_kinds:
                reasons.append(f"{b.name}: does not serve {kind.value} memory")
            elif touch != kind and touch == MemoryKind.CUDA and (why := _cuda.unavailable_reason()) is not None:
                reasons.append(f"{b.name}: serves {kind.value} memory through a GPU buffer, but {why}")
            elif (why := b.unreachable_reason(record, region, touch)) is not None:
                reasons.append(f"{b.name}: {why}")
            else:
                if reasons and (record.name, b.name) not in self._fallbacks_logged:
                    self._fallbacks_logged.add((record.name, b.name))
                    log.warning("transport %s: using %s for %s because %s", self.name, b.name, record.name,
                                "; ".join(reasons))
                return b
        ours = ", ".join(b.name for b in self._backends) or "nothing"
        theirs = ", ".join(record.backends) or "nothing"
        raise BackendUnavailableError(
            f"no backend can reach {record.name}:{region.key!r} from {kind.value} memory "
            f"(we speak {ours}; it speaks {theirs}): " + "; ".join(reasons)
        )

    def sync_route(self, op: TransferOp, record: PeerRecord, key: str, kind: MemoryKind) -> SyncRoute:
        """The synchronous route of ``op`` between ``kind`` memory here and ``record``'s region
        ``key`` (made once per record)."""
        route = self._sync.get((record.name, key, op, kind))
        if route is None or route.record is not record:
            route = self._new_route(op, record, key, kind)
        return route

    def _new_route(self, op: TransferOp, record: PeerRecord, key: str, kind: MemoryKind) -> SyncRoute:
        region = record.regions.get(key)
        backend: Backend | None = None
        move: Mover | DeviceMover | None = None
        device = kind == MemoryKind.CUDA or (region is not None and region.device != "cpu")
        if region is not None and not region.moved and (op == TransferOp.GET or region.writable):
            try:
                backend = self.choose(record, region, kind)
            except BackendUnavailableError:
                backend = None
            if backend is not None and kind in backend.memory_kinds:  # a bounced transfer has none
                move = backend.device_mover(op, record, region, kind) if device else backend.mover(op, record, region)
        if len(self._sync) >= SYNC_ROUTES_MAX:
            self._sync.clear()
        route = self._sync[(record.name, key, op, kind)] = SyncRoute(record, region, backend, move, device)
        return route

    def current(self, record: PeerRecord) -> bool:
        """Whether a backend sees, cheaply, that ``record`` is still its peer's latest."""
        return any(b.live_seq(record) == record.seq for b in self._backends)

    def republished(self, record: PeerRecord) -> bool:
        """Whether a backend sees, cheaply, that the peer published a record after ``record``."""
        return any((seq := b.live_seq(record)) is not None and seq != record.seq for b in self._backends)

    def withdrawn(self, record: PeerRecord) -> bool:
        """Whether a backend sees, cheaply, that ``record``'s Transport has closed."""
        return any(b.live_seq(record) == WITHDRAWN_SEQ for b in self._backends)

    def forget(self, peer: str) -> None:
        """Drops the synchronous routes to ``peer`` (it restarted or was lost): what they hold,
        e.g. a mapping of its memory, goes with them."""
        for k in [k for k in self._sync if k[0] == peer]:
            del self._sync[k]
        self._fallbacks_logged = {k for k in self._fallbacks_logged if k[0] != peer}

    def plan(self, op: TransferOp, record: PeerRecord, bound: Sequence[tuple[Runs, RegionRecord]]) -> BatchPlan:
        """The plan of a prepared ``op`` whose runs were checked against ``record`` (``bound``:
        each with its region): a backend per (region, memory kind), and each backend's reusable
        runner over the runs it serves (``Backend.prepare_runs``, one call with all of them);
        runs of memory it does not serve go run by run through staging at every start.

        Raises:
            BackendUnavailableError: no backend reaches a region.
        """
        served: dict[str, tuple[Backend, list[tuple[Runs, RegionRecord]]]] = {}
        chosen: dict[tuple[str, MemoryKind], Backend] = {}
        staged: list[tuple[Backend, RunPiece]] = []
        for runs, region in bound:
            kind = runs.local.kind
            backend = chosen.get((runs.key, kind))
            if backend is None:
                backend = chosen[(runs.key, kind)] = self.choose(record, region, kind)
            mine = served.setdefault(backend.name, (backend, []))
            if kind in backend.memory_kinds:
                mine[1].append((runs, region))
            else:
                staged += [(backend, piece) for piece in _pieces.of_runs(record, [(runs, region)])]
        busy = [(backend, lists) for backend, lists in served.values() if lists]
        runners = [backend.prepare_runs(op, record, lists) for backend, lists in busy]
        backends = [b for b, _ in served.values()]
        return BatchPlan(",".join(served), runners, staged, all(b.one_sided for b in backends),
                         all(b.same_host for b in backends), busy)
