"""What one endpoint's agent serves (:class:`Routes`): signals, backends' own requests, and the
``tcp`` backend's byte ranges, each checked against the live region table first."""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from typing import Any

from ._agent import Conn
from ._errors import BackendUnavailableError
from ._native import Copier
from ._native.tcp import DirectServer
from ._regions import Region, RegionTable
from ._signals import Signals
from ._wire import FrameKind, RangeRequest, RangesRequest, RunsRequest, SignalRequest, TransferOp
from .backends import Backend
from .backends.tcp import DIRECT_MAX_CONNS, serve_ranges, serve_runs


class Routes:
    """What this endpoint's agent serves: signals, backends' own requests and tcp ranges."""

    def __init__(self, name: str, regions: RegionTable, backends: Sequence[Backend], signals: Signals,
                 timeout: float, copier: Copier) -> None:
        self._name = name
        self._copier = copier  # places staged runs (tcp PUTR / GETR)
        self._regions = regions
        self._backends = backends
        self._signals = signals
        self._timeout = timeout
        self._direct: DirectServer | None = None  # made on the first direct-lane connection

    def signal(self, request: SignalRequest) -> None:
        self._signals.deliver(request)

    async def backend_request(self, meta: Mapping[str, Any]) -> Mapping[str, Any]:
        name = meta.get("backend")
        for b in self._backends:
            if b.name == name:
                return await b.serve_request(meta, self._check)
        runs = ", ".join(b.name for b in self._backends)
        raise BackendUnavailableError(f"{self._name} does not run backend {name!r} (it runs {runs})")

    def _check(self, op: TransferOp, meta: Mapping[str, Any], nbytes: int) -> Region:
        return self._regions.check(op, meta.get("key"), meta.get("dtype"), meta.get("offset"), nbytes)

    async def range_request(self, conn: Conn, kind: FrameKind, rid: int, request: RangeRequest | RangesRequest,
                            payload_len: int) -> None:
        await serve_ranges(self._regions, conn, kind, rid, request.segments, payload_len)

    async def runs_request(self, conn: Conn, kind: FrameKind, rid: int, request: RunsRequest,
                           payload_len: int) -> None:
        await serve_runs(self._regions, conn, kind, rid, request, payload_len, self._copier)

    def adopt_direct(self, sock: socket.socket) -> bool:
        """Serves a tcp direct-lane connection on a native thread (``transport._native.tcp``):
        its requests are checked against the region table's native mirror."""
        if self._direct is None:
            self._direct = DirectServer(self._regions.mirror, self._name, self._timeout, DIRECT_MAX_CONNS)
        return self._direct.adopt(sock)

    def close(self) -> None:
        """Ends the direct-lane connections and joins their threads."""
        if self._direct is not None:
            self._direct.close()
