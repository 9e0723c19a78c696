"""The error tree. Every failure the library reports is one of these.

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
    │   └── MeshLayoutError      (transport.plan) a mesh layout that cannot be planned (also a ValueError)
    ├── BackendUnavailableError  no backend can serve this peer / memory kind (says what to install)
    ├── PeerNotFoundError        no peer of that name appeared within the timeout
    ├── AuthenticationError      a peer or connection did not present the shared token
    ├── CommitError              (transport.weights) a mesh replica cannot commit: not its leader, a rank missing
    ├── DeltaRefusedError        (transport.weights) a delta that does not apply to the weights held; nothing written
    ├── StoreError               (transport._rendezvous) the rendezvous store failed or is untrusted
    │   └── RecordTooLargeError  a record in the store is larger than any record is read
    └── TransportInternalError   a bug, an unexpected native failure, or bytes that do not decode
        └── WireError            (transport._wire) bytes from a peer or the store that do not decode

Errors about bad input are raised before any byte moves; the remote memory is then unchanged.
"""

from __future__ import annotations

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
