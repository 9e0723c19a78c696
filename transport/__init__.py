"""transport: asynchronous, one-sided tensor movement between processes.

The public surface is what this module re-exports; everything else is private
(underscored modules) and may change.
"""

from ._errors import AuthenticationError as AuthenticationError
from ._errors import BackendUnavailableError as BackendUnavailableError
from ._errors import BoundsError as BoundsError
from ._errors import ClosedError as ClosedError
from ._errors import DTypeMismatchError as DTypeMismatchError
from ._errors import LayoutError as LayoutError
from ._errors import PeerLostError as PeerLostError
from ._errors import PeerNotFoundError as PeerNotFoundError
from ._errors import ReadOnlyRegionError as ReadOnlyRegionError
from ._errors import RecordTooLargeError as RecordTooLargeError
from ._errors import RegistrationError as RegistrationError
from ._errors import StoreError as StoreError
from ._errors import TransferAbortedError as TransferAbortedError
from ._errors import TransferTimeoutError as TransferTimeoutError
from ._errors import TransportError as TransportError
from ._errors import TransportInternalError as TransportInternalError
from ._errors import WireError as WireError
from ._peers import Peer as Peer
from ._public import rehome
from ._regions import Region as Region
from ._rendezvous import serve_store as serve_store
from ._support import available_backends as available_backends
from ._support import cuda_unavailable_reason as cuda_unavailable_reason
from ._transfers import PreparedTransfer as PreparedTransfer
from ._transfers import Transfer as Transfer
from ._transfers import gather as gather
from ._transport import Transport as Transport
from ._wire import TransferOp as TransferOp
from .backends import register_backend as register_backend

__version__ = "0.1.0"

__all__ = [
    "Transport",
    "Transfer",
    "PreparedTransfer",
    "TransferOp",
    "gather",
    "serve_store",
    "register_backend",
    "available_backends",
    "cuda_unavailable_reason",
    "Peer",
    "Region",
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
    "StoreError",
    "RecordTooLargeError",
    "TransportInternalError",
    "WireError",
]

rehome(globals(), __all__, __name__)
