"""The tcp backend's frames: its kinds in the agent's protocol (``Backend.frames``) and the typed
requests they carry, validated on arrival. The agent routes these kinds to the tcp backend and
knows nothing else of them."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..._errors import WireError
from ..._wire import field_int, field_str


class TcpFrame(enum.IntEnum):
    """The tcp backend's frame kinds (numbers from ``transport._wire.BACKEND_KINDS``)."""

    PUT = 2  # one range of one region: the bytes follow the metadata
    GET = 3
    PUTR = 8  # many runs of one or more regions (a prepared transfer): a binary run table leads the payload
    GETR = 9


@dataclass(frozen=True)
class RangeRequest:
    """A PUT or GET of ``nbytes`` ``dtype`` bytes at byte ``offset`` of region ``key``."""

    key: str
    dtype: str
    offset: int
    nbytes: int

    def to_meta(self) -> dict[str, Any]:
        return {"key": self.key, "dtype": self.dtype, "offset": self.offset, "nbytes": self.nbytes}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> RangeRequest:
        """Raises WireError for a missing or mistyped field."""
        return cls(field_str(meta, "key"), field_str(meta, "dtype"), field_int(meta, "offset"),
                   field_int(meta, "nbytes"))


MAX_SEGMENTS = 65536  # runs in one PUTR / GETR frame


RUN_ROW = 16  # one run in a PUTR / GETR table: remote byte offset, nbytes (little-endian int64)


MAX_RUN_GROUPS = 4096  # regions in one PUTR / GETR frame


@dataclass(frozen=True)
class RunsRequest:
    """A PUTR or GETR: runs of one or more regions, ``groups`` of ``(key, dtype, count)`` in
    table order. The payload starts with the run table (one row of :data:`RUN_ROW` bytes per
    run, the groups' runs one after another), then, for PUTR, the runs' bytes back to back;
    the target reads and checks the whole table, every group, before it takes a data byte, so
    a frame lands whole or not at all."""

    groups: tuple[tuple[str, str, int], ...]
    # The runs' bytes are packed back to back and copied to (from) their places natively, in
    # one job, at most MAX_STAGED_BYTES of them: small runs, where a system-call buffer per run
    # would cost more than the copy.
    staged: bool = False

    @property
    def count(self) -> int:
        return sum(g[2] for g in self.groups)

    @property
    def table_bytes(self) -> int:
        return self.count * RUN_ROW

    def to_meta(self) -> dict[str, Any]:
        return {"groups": [list(g) for g in self.groups], "staged": self.staged}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> RunsRequest:
        """Raises WireError for a missing or mistyped field, no group or more than
        MAX_RUN_GROUPS, a group without runs, or more than MAX_SEGMENTS runs in all."""
        groups = meta.get("groups")
        if not isinstance(groups, list) or not 0 < len(groups) <= MAX_RUN_GROUPS:
            raise WireError(f"request field 'groups' must be a list of 1 to {MAX_RUN_GROUPS} groups")
        out = []
        for g in groups:
            if not (isinstance(g, list) and len(g) == 3):
                raise WireError("a run group must be [key, dtype, count]")
            fields = dict(zip(("key", "dtype", "count"), g, strict=True))
            key, dtype, count = field_str(fields, "key"), field_str(fields, "dtype"), field_int(fields, "count")
            if count <= 0:
                raise WireError(f"a run group of {key!r} must have at least one run, got {count}")
            out.append((key, dtype, count))
        staged = meta.get("staged", False)
        if not isinstance(staged, bool):
            raise WireError("request field 'staged' must be a bool")
        request = cls(tuple(out), staged)
        if request.count > MAX_SEGMENTS:
            raise WireError(f"a frame of {request.count} runs (at most {MAX_SEGMENTS})")
        return request


MAX_STAGED_BYTES = 4 << 20  # data bytes of one staged PUTR / GETR frame
