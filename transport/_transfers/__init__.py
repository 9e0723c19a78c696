"""One transfer's life, from the public call to a settled outcome: a one-way package.

Inside it, each module imports only the ones listed before it::

    handle    Transfer (the awaitable handle) and gather
    ordering  the ordering rule between transfers to one region (Ranges)
    runs      RunList: a prepared transfer's runs, checked, as a value (no engine, no backend),
              and the subset of them one start moves
    prepared  PreparedTransfer: the public handle over one RunList; knows the engine only as
              the Protocol of the two calls it forwards (Starter)
    routing   Router: backend choice, synchronous routes, how a prepared plan is built
    engine    TransferEngine: starts, runs and settles transfers; makes prepared transfers and
              owns their plans (one per peer record and local memory placement)

Below it: backends, staging (``transport._staging``), the piece schedule and ready events
(``transport._pieces``), regions, tensors, the wire vocabulary.
Above it: only the Transport front (``transport._transport``) and the agent's dispatch
(``transport._signals``).
"""

from .engine import SYNC_MAX_BYTES as SYNC_MAX_BYTES
from .engine import TransferEngine as TransferEngine
from .handle import Transfer as Transfer
from .handle import gather as gather
from .prepared import PreparedTransfer as PreparedTransfer

__all__ = ["SYNC_MAX_BYTES", "PreparedTransfer", "Transfer", "TransferEngine", "gather"]
