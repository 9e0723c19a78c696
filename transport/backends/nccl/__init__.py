"""``nccl``: GPU memory to GPU memory over NCCL point-to-point, one communicator per peer pair.

NCCL is what GPU clusters already tune for NVLink and InfiniBand (GPUDirect RDMA). This backend
uses its point-to-point operations without its collective coupling: every communicator holds
exactly two ranks, the two ends of one peer pair, so a dead or slow peer can only ever stall
the communicator it shares with its one partner.

Layers, top down (data flows down; nothing calls back up):

- :mod:`._backend`: :class:`NcclBackend`, the Backend: reachability, the initiator's put/get,
  the target's agent requests, transfers to self.
- :mod:`._comms`: :class:`Comms`, the table of one backend's communicators: opening (unique
  id through the store, the ``open`` request), serving opens, peer loss, close.
- :mod:`._comm`: :class:`Comm`, one communicator and everything it owns (stream, ack slots,
  issue order, abort); its methods post, accept, wait and abort.
- :mod:`._protocol` (the requests to a peer's agent), :mod:`._ids` (comm ids, GPU identities,
  unique ids in the store), :mod:`._endpoint` (the published descriptor),
  :mod:`._availability` (why not, and doctor's line).
- :mod:`transport._native.nccl`: libnccl through ctypes.

One-sided windows (NCCL >= 2.29: ``ncclCommWindowRegister`` + ``ncclPutSignal``): each endpoint
advertises whether its NCCL has them (a symbol probe), but transfers use send/recv: see
:func:`._endpoint.window_path_reason`.

Two ranks on one GPU: NCCL refuses them unless NCCL >= 2.30 runs with
``NCCL_MULTI_RANK_GPU_ENABLE=1`` on both ends; such pairs are reported unreachable (use ``ipc``).
"""

from ._availability import describe as describe
from ._backend import NcclBackend as NcclBackend

__all__ = ["NcclBackend", "describe"]
