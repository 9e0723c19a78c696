"""Control pages: the word where a Transport keeps the seq of its latest published record.

Each backend that moves bytes without the peer's help (``ipc``, ``ucx``) publishes one page in
a memfd, sealed against the peers' writes. An initiator on the same host maps the peer's page
read-only, once per peer incarnation, and reads the word with one load before every synchronous
transfer (``Backend.live_seq``). That is how it notices a (un)registration before it writes.
A peer's page is mapped only if it is a size-sealed memfd covering the mapping, and carries the
published inode where one was published (:class:`PeerMapping` checks both). So a hostile peer
cannot make these loads fault.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .._native import PeerMapping, SharedBuffer, shared_buffer
from .._wire import PeerRecord

log = logging.getLogger(__name__)

PAGE_BYTES = 4096
SEQ_OFFSET = 0  # byte offset in the page of the published record's seq (a u64)
# The seq word of a Transport that closed: peers on its host forget it at once, although its
# process lives on (``PeerDirectory`` checks the word each heartbeat interval).
WITHDRAWN_SEQ = (1 << 64) - 1


def control_page(owner: str, what: str) -> SharedBuffer:
    """A new control page of Transport ``owner`` (``what`` names it in ``/proc/<pid>/fd``), sealed
    against other processes' writes."""
    return shared_buffer(PAGE_BYTES, f"transport:{owner}:{what}", read_only=True)


# Where a peer's page is: its memfd's number and inode (0: not checked) in the peer's process,
# or None when it has none that can be mapped here (another host, no descriptor).
Locate = Callable[[PeerRecord], "tuple[int, int] | None"]


class PeerControlPages:
    """This process's read-only mappings of same-host peers' control pages, one per peer
    incarnation (None where one cannot be mapped: the caller reads the word another way)."""

    def __init__(self, owner: str, locate: Locate) -> None:
        self._owner = owner
        self._locate = locate
        self._pages: dict[tuple[str, str], PeerMapping | None] = {}

    def read(self, peer: PeerRecord) -> int | None:
        """The seq in ``peer``'s control page, or None when that page cannot be mapped. Called
        before every synchronous transfer: a dictionary lookup and a load once it is mapped."""
        key = (peer.name, peer.incarnation)
        page = self._pages.get(key)
        if page is None:
            if key in self._pages:
                return None
            page = self._pages[key] = self._map(peer)
            if page is None:
                return None
        return page.read_u64(SEQ_OFFSET)

    def _map(self, peer: PeerRecord) -> PeerMapping | None:
        where = self._locate(peer)
        if where is None:
            return None
        fd, inode = where
        try:
            return PeerMapping(peer.pid, fd, PAGE_BYTES, False, inode)
        except RuntimeError as exc:
            log.debug("transport %s: cannot map the control page of %s (%s)", self._owner, peer.name, exc)
            return None

    def forget(self, peer: str) -> None:
        """Drops (unmaps) the pages of every incarnation of ``peer``."""
        self._pages = {k: v for k, v in self._pages.items() if k[0] != peer}

    def clear(self) -> None:
        self._pages.clear()
