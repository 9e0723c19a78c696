"""What an nccl endpoint publishes in its peer record: its NCCL version and whether that NCCL
has one-sided windows (``ncclCommWindowRegister`` / ``ncclPutSignal`` / ``ncclWaitSignal``)."""

from __future__ import annotations

import dataclasses
import json

from ..._errors import WireError
from ..._native.nccl import WINDOW_VERSION, Library
from ..._wire import loads_bounded

ENDPOINT_FORMAT = "transport.nccl"
ENDPOINT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class EndpointInfo:
    """What a peer's nccl endpoint publishes."""

    version: tuple[int, int, int]
    windows: bool  # its NCCL has ncclCommWindowRegister / ncclPutSignal / ncclWaitSignal


def encode_endpoint(lib: Library) -> bytes:
    """This endpoint's descriptor."""
    doc = {"format": ENDPOINT_FORMAT, "v": ENDPOINT_VERSION, "nccl": list(lib.version), "windows": lib.has_windows}
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_endpoint(data: bytes, peer: str) -> EndpointInfo:
    """A peer's descriptor.

    Raises:
        WireError: anything but a valid descriptor.
    """
    doc = loads_bounded(data, max_bytes=4096, max_depth=4, what=f"{peer}: unreadable nccl endpoint descriptor")
    try:
        if not isinstance(doc, dict):
            raise TypeError("not a JSON object")
        if doc.get("format") != ENDPOINT_FORMAT or doc.get("v") != ENDPOINT_VERSION:
            raise ValueError("not an nccl endpoint descriptor of a known version")
        v = doc["nccl"]
        if not (isinstance(v, list) and len(v) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)):
            raise ValueError(f"bad NCCL version {v!r}")
        if not isinstance(doc["windows"], bool):
            raise TypeError("bad windows flag")
        return EndpointInfo((v[0], v[1], v[2]), doc["windows"])
    except (ValueError, TypeError, KeyError) as exc:
        raise WireError(f"{peer}: unreadable nccl endpoint descriptor: {exc}") from None


def window_path_reason(lib: Library, info: EndpointInfo) -> str:
    """Why a transfer to this peer uses send/recv rather than a one-sided window put (for the log)."""
    if not (lib.has_windows and info.windows):
        need = ".".join(map(str, WINDOW_VERSION))
        return f"one-sided windows need NCCL >= {need} on both ends"
    # Both ends could. Not done: window registration is collective (both ranks, in the same
    # order as their other operations), accepts only VMM allocations (ncclMemAlloc, or torch's
    # expandable segments), and delivery is only known after the target's ncclWaitSignal, so it
    # would still need the agent's post and the ack; to be validated on GPUs first.
    return "the window path is not enabled yet (send/recv is used)"
