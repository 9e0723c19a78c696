"""What one endpoint's agent serves (:class:`Routes`): signals, backends' control requests, and
every other frame, each to the backend that serves its kind (``Backend.serve_frame``; ``tcp``'s
PUT / GET frames among them) or its lane (``Backend.adopt_lane``)."""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from typing import Any

from ._agent import Conn
from ._errors import BackendUnavailableError
from ._regions import Region, RegionTable
from ._signals import Signals
from ._wire import FrameKind, SignalRequest, TransferOp
from .backends import Backend


class Routes:
    """What this endpoint's agent serves: signals, and its backends' target sides."""

    def __init__(self, name: str, regions: RegionTable, backends: Sequence[Backend], signals: Signals) -> None:
        self._name = name
        self._regions = regions
        self._backends = backends
        self._signals = signals
        self._by_kind: dict[int, Backend] = {}
        for b in backends:  # the first backend (in preference order) that serves a kind serves it
            for kind in b.frames:
                self._by_kind.setdefault(kind, b)

    def signal(self, request: SignalRequest) -> None:
        self._signals.deliver(request)

    async def backend_request(self, meta: Mapping[str, Any]) -> Mapping[str, Any]:
        return await self._named(meta).serve_request(meta, self._check)

    def _named(self, meta: Mapping[str, Any]) -> Backend:
        name = meta.get("backend")
        for b in self._backends:
            if b.name == name:
                return b
        runs = ", ".join(b.name for b in self._backends)
        raise BackendUnavailableError(f"{self._name} does not run backend {str(name)[:100]!r} (it runs {runs})")

    def _check(self, op: TransferOp, meta: Mapping[str, Any], nbytes: int) -> Region:
        return self._regions.check(op, meta.get("key"), meta.get("dtype"), meta.get("offset"), nbytes)

    def serves(self, kind: int, meta: Mapping[str, Any]) -> bool:
        if kind == FrameKind.BACKEND_DATA:
            return any(b.name == meta.get("backend") for b in self._backends)
        return kind in self._by_kind

    async def frame(self, conn: Conn, kind: int, rid: int, meta: Mapping[str, Any], payload_len: int) -> None:
        backend = self._named(meta) if kind == FrameKind.BACKEND_DATA else self._by_kind[kind]
        await backend.serve_frame(conn, kind, rid, meta, payload_len)

    def takes_lane(self, lane: str) -> bool:
        return any(lane in b.lanes for b in self._backends)

    def adopt_lane(self, lane: str, sock: socket.socket) -> bool:
        for b in self._backends:
            if lane in b.lanes:
                return b.adopt_lane(lane, sock)
        return False
