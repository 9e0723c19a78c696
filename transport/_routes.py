"""What one endpoint's agent serves (:class:`Routes`): signals, backends' own requests, and the
``tcp`` backend's byte ranges, each checked against the live region table first."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._agent import Conn
from ._errors import BackendUnavailableError
from ._regions import Region, RegionTable
from ._signals import Signals
from ._wire import FrameKind, RangeRequest, RangesRequest, SignalRequest, TransferOp
from .backends import Backend
from .backends.tcp import serve_ranges


class Routes:
    """What this endpoint's agent serves: signals, backends' own requests and tcp ranges."""

    def __init__(self, name: str, regions: RegionTable, backends: Sequence[Backend], signals: Signals) -> None:
        self._name = name
        self._regions = regions
        self._backends = backends
        self._signals = signals

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
