"""The error tree: every error the library reports, defined here and nowhere else.

The public packages re-export them (``transport``; ``transport.weights``, ``transport.plan``,
``transport.vllm`` for their own); tests/api/test_exports.py checks that the README draws this
tree and that no public error class is defined in another module.

::

    TransportError
    ├── ClosedError              you closed the Transport (or it is closing)
    ├── PeerLostError            an outside failure: the peer died, its link broke (__cause__ set)
    ├── TransferTimeoutError     the operation did not finish within its timeout (also a TimeoutError)
    ├── TransferAbortedError     cancelled (or excluded) after it started
    ├── RegistrationError        a region cannot be registered, or no such region / key, or it moved
    │   └── ReadOnlyRegionError  a put into a region registered with writable=False
    ├── BoundsError              offset + nbytes outside the remote region, or misaligned
    ├── DTypeMismatchError       local and remote dtypes differ
    ├── LayoutError              a tensor layout the operation cannot serve (non-contiguous dst)
    │   ├── LayoutMismatchError  (transport.weights) publisher and subscriber tensors do not match
    │   │   └── MalformedLayoutError  (internal) a layout from a peer that does not decode (also a WireError)
    │   └── MeshLayoutError      (transport.plan) a mesh layout that cannot be planned (also a ValueError)
    ├── BackendUnavailableError  no backend can serve this peer / memory kind (says what to install)
    ├── PeerNotFoundError        no peer of that name appeared within the timeout
    ├── AuthenticationError      a peer or connection did not present the shared token
    ├── CommitError              (transport.weights) a mesh replica cannot commit: not its leader, a rank missing
    ├── DeltaRefusedError        (transport.weights) a delta that does not apply to the weights held; nothing written
    ├── EngineSyncError          (transport.vllm) an engine could not load a version; it keeps the one it had
    ├── StoreError               the rendezvous store failed or is untrusted
    │   └── RecordTooLargeError  a record in the store is larger than any record is read
    └── TransportInternalError   a bug, an unexpected native failure, or bytes that do not decode
        ├── WireError            bytes from a peer or the store that do not decode
        │   └── MalformedRegionError  (internal) a peer's stream region of the wrong size
        └── CudaError            (internal) the CUDA driver refused a call

Errors about bad input are raised before any byte moves; the remote memory is then unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "TransportError",
    "ClosedError",
    "PeerLostError",
    "TransferTimeoutError",
    "TransferAbortedError",
    "RegistrationError",
    "ReadOnlyRegionError",
    "BoundsError",
    "DTypeMismatchError",
    "LayoutError",
    "BackendUnavailableError",
    "PeerNotFoundError",
    "AuthenticationError",
    "TransportInternalError",
    "WireError",
    "CudaError",
    "StoreError",
    "RecordTooLargeError",
    "LayoutMismatchError",
    "MalformedLayoutError",
    "MeshLayoutError",
    "MalformedRegionError",
    "CommitError",
    "DeltaRefusedError",
    "EngineSyncError",
]


class TransportError(Exception):
    """Root of every error raised by ``transport``."""


class ClosedError(TransportError):
    """The Transport was closed by its owner; the operation did not (fully) run."""


class PeerLostError(TransportError):
    """The peer went away or its connection broke. ``__cause__`` holds the underlying error."""


class TransferTimeoutError(TransportError, TimeoutError):
    """The operation did not complete within its timeout; it was aborted.

    It is also a builtin :class:`TimeoutError`, so ``except TimeoutError`` catches it.

    Attributes:
        partial: True when some bytes may already have reached the remote region (a put whose
            bytes had started to move); its contents are then undefined until the next
            complete write. False when nothing moved.
    """

    def __init__(self, message: str, *, partial: bool = False) -> None:
        super().__init__(message)
        self.partial = partial


class TransferAbortedError(TransportError):
    """A transfer was cancelled after it started.

    Attributes:
        partial: True when some bytes may already have reached the remote region; its
            contents are then undefined until the next complete write.
    """

    def __init__(self, message: str, *, partial: bool = False) -> None:
        super().__init__(message)
        self.partial = partial


class RegistrationError(TransportError):
    """A region cannot be registered, or the named region / key does not exist."""


class ReadOnlyRegionError(RegistrationError):
    """The remote region was registered with ``writable=False``; puts into it are refused."""


class BoundsError(TransportError):
    """``offset + nbytes`` falls outside the remote region, or the offset is misaligned."""


class DTypeMismatchError(TransportError):
    """The local tensor's dtype differs from the remote region's dtype."""


class LayoutError(TransportError):
    """The tensor's layout cannot be served (e.g. a non-contiguous destination for ``get``)."""


class BackendUnavailableError(TransportError):
    """No backend can serve the request; the message says why and what to install."""


class PeerNotFoundError(TransportError):
    """No peer of that name is visible in the rendezvous store (within the timeout)."""


class AuthenticationError(TransportError):
    """A peer record or connection did not carry a valid HMAC of the shared token."""


class TransportInternalError(TransportError):
    """An unexpected failure inside the library or its native core."""


# -- wire and store ---------------------------------------------------------------------------


class WireError(TransportInternalError):
    """Bytes from another process that do not decode as what they claim to be."""


class CudaError(TransportInternalError):
    """The CUDA driver refused a call; the message names the call and the driver's error."""


class StoreError(TransportError):
    """The rendezvous store could not be reached or used."""


class RecordTooLargeError(StoreError):
    """A value in the store is larger than ``transport._rendezvous.MAX_VALUE_BYTES``; it was not read (a file
    store) or not used (a TCP store)."""


# -- weight sync, mesh planning, vLLM (re-exported by their packages) --------------------------


class LayoutMismatchError(LayoutError):
    """Publisher and subscriber disagree about the weights (names, shapes, conversions).

    A ``LayoutError``: the subscriber's tensors are a layout the publisher's stream cannot
    serve, so ``except LayoutError`` catches every "these tensors do not fit" refusal.

    Attributes:
        not_received: wire names the publisher sends that no local tensor receives.
        not_sent: local tensor names the publisher's layout does not send.
    """

    def __init__(self, message: str, *, not_received: Iterable[str] = (), not_sent: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.not_received = tuple(not_received)
        self.not_sent = tuple(not_sent)


class MalformedLayoutError(LayoutMismatchError, WireError):
    """A weights layout read from a peer that is not one: its bytes do not decode, or its
    fields do not fit together (sizes, offsets, bounds). Nothing was sized from it."""


class MalformedRegionError(WireError):
    """A peer's record names a stream region whose size is not the one its kind has."""


class MeshLayoutError(LayoutError, ValueError):
    """A layout that cannot be planned from: a box outside its tensor, overlapping pieces, an
    unknown tensor or dtype, a sharding that does not fit its mesh. The message names the
    tensor and the rank. A LayoutError of the error tree, and a ValueError (what it was first)."""


class CommitError(TransportError):
    """A replica-level operation that cannot proceed: not the leader, a rank of the replica or a
    trainer rank is missing, or ``apply(version)`` asked for a version that is not committed."""


class DeltaRefusedError(TransportError):
    """A delta that does not apply to the live weights: their checksum is not the base's (a
    wrong base, e.g. a control word that claimed a version the subscriber does not hold), or
    the payload fails a bounds or integrity check. The live weights stay on their version
    (whatever the apply stored was undone first), and ``pull()`` (or the next dense version)
    catches up."""


class EngineSyncError(TransportError):
    """A vLLM engine could not load a version (not complete at every rank in time, or the
    load failed); the engine keeps serving the version it had."""
