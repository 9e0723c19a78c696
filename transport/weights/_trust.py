"""Whether a stream subscriber may take the version in its front word: the publisher's word on it.

Any peer may write a subscriber's control block, so a version past the newest one the
publisher's own (read-only) control block has vouched for is checked against that block before
it is applied (:meth:`Trust.ask`): through this process's mapping of it when the publisher is on
this host (:class:`~._control.LocalBlock`: no network, and still readable after the publisher
left), else over the network (the asynchronous calls only). A version the block does not cover
is refused; one that cannot be checked (the publisher has gone or does not answer, or, for the
synchronous ``apply()``, lives on another host) is applied as it is, and marked unasked: an
unasked live version never holds back another version.

:class:`Trust` owns what that judgement needs and changes: the live version (which version the
local weights hold, the front word it came from, whether it was taken unasked) and what the
publisher's block said last. The subscriber asks it before it claims a slot and tells it what it
made live (:meth:`Trust.made_live`).
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING

import torch

from .._errors import ClosedError, TransportError
from ._control import CTL_WORDS, DIFFING, LocalBlock, StreamKeys, publisher_latest, read_words

if TYPE_CHECKING:
    from .. import Peer, Transport

log = logging.getLogger(__name__)
# How long the asynchronous calls wait for the publisher's control block over the network before
# they take the publisher as not answering (the read takes a millisecond when it answers).
ASK_S = 2.0


class Vouch(enum.Enum):
    """What the publisher's control block says of a version (see :meth:`Trust.ask`)."""

    YES = "vouched"  # it has published (or begun to push) that version
    NO = "refused"  # read now, it has not: somebody else wrote our front word
    UNASKED = "unasked"  # it cannot be read now (the publisher left, or is not reachable this way)


class Trust:
    """The live version of one subscriber and the publisher's word on the versions it is offered.

    Args:
        transport: the subscriber's Transport (its name is the subscriber's in the logs).
        publisher: the publisher's Transport name.
        name: the stream name.

    The synchronous calls (:meth:`here`, :meth:`newer`, :meth:`made_live`) run on the
    subscriber's apply thread, under its apply lock; the asynchronous ones on the event loop.
    """

    def __init__(self, transport: Transport, publisher: str, name: str) -> None:
        self.t, self.publisher, self.name = transport, publisher, name
        self._keys = StreamKeys.of(name)
        self.live: int | None = None  # the version the local weights hold (None: none yet)
        self._live_word = 0  # the front word the live version came from (0: pulled, or none)
        self._unasked = False  # the live version was applied without the publisher's word on it
        self.latest = 0  # the newest version the publisher's own control block vouched for
        self.diffs = True  # its block's DIFFING word, last read: deltas may come
        self._refused: int | None = None  # the last unvouched version logged
        self._unasked_logged: int | None = None  # the last version taken unasked that was logged
        self._block: LocalBlock | None = None  # the publisher's control block mapped here (same host)

    def map(self, peer: Peer) -> None:
        """Maps the control block ``peer`` (the publisher, as found at start) publishes, when
        it is on this host."""
        self._block = LocalBlock.of(self.t, peer, self._keys.pubctl, CTL_WORDS)

    def unmap(self) -> None:
        """Lets the mapping of the publisher's block go (the subscriber closed)."""
        self._block = None

    def newer(self, word: int, version: int) -> bool:
        """Whether ``version`` (from our front word ``word``) should replace the live one: it
        is newer, or the live one was taken unasked and this is another word (so a version
        nobody could vouch for never holds back the publisher's next one)."""
        if self.live is None or version > self.live:
            return True
        return self._unasked and word != self._live_word

    def made_live(self, version: int, word: int, verdict: Vouch) -> None:
        """The local weights hold ``version`` now, from front word ``word`` (0: pulled from
        the publisher's own snapshot), taken on ``verdict``."""
        self.live, self._live_word, self._unasked = version, word, verdict is Vouch.UNASKED

    def live_at_least(self, version: int) -> int | None:
        """The live version when it is ``version`` or later and not known to be unvouched
        (vouched for, or taken unasked); else None."""
        live = self.live
        return live if live is not None and live >= version and (self._unasked or live <= self.latest) else None

    def heard(self, words: torch.Tensor, authoritative: bool = True) -> None:
        """Notes what the publisher's control block ``words`` vouches for (``authoritative``:
        read now from the current publisher; else what a publisher that left wrote last, which
        lowers nothing)."""
        latest = publisher_latest(words)
        self.latest = latest if authoritative else max(self.latest, latest)
        self.diffs = int(words[DIFFING]) != 0

    def judge(self, version: int, words: torch.Tensor, authoritative: bool) -> Vouch:
        """What the publisher's control block ``words`` says of ``version``.

        ``authoritative``: the block is the current publisher's (read now over the network, or
        through a mapping of a block it still publishes): a version past it is refused, and a
        live version past it is forgotten (written by a third peer, or the publisher restarted
        since), so that the publisher's next version is applied. Otherwise the block is what a
        publisher that has gone wrote last: it still vouches for what it covers, and cannot
        refuse the rest."""
        self.heard(words, authoritative)
        if self.live is not None and self.live > self.latest and authoritative:
            log.warning("subscriber %s: live version %d of %r is past what %s has published (%d): not "
                        "trusted; the next version it publishes is applied", self.t.name, self.live,
                        self.name, self.publisher, self.latest)
            self.live = None
            self._unasked = False
        elif self._unasked and self.live is not None and self.live <= self.latest:
            self._unasked = False  # vouched for after all
        if version <= self.latest:
            return Vouch.YES
        if not authoritative:
            return Vouch.UNASKED
        if version != self._refused:
            self._refused = version
            log.warning("subscriber %s: version %d in %r's front word is past what %s has published (%d): "
                        "someone else wrote it; ignored", self.t.name, version, self.name, self.publisher,
                        self.latest)
        return Vouch.NO

    def _past(self, version: int) -> bool:
        """Whether ``version``, or the live version, is past the newest one vouched for (the
        publisher's block must be read again)."""
        return version > self.latest or (self.live is not None and self.live > self.latest)

    def here(self, version: int) -> Vouch:
        """:meth:`ask` without the network, on any thread: the last word seen, then the
        publisher's block through the mapping here (same host); UNASKED where there is none."""
        if not self._past(version):
            return Vouch.YES
        block = self._block
        words = block.read() if block is not None else None
        if words is None or block is None:
            return self._take_unasked(version, "its control block cannot be read here without the network")
        if (verdict := self.judge(version, words, block.current())) is Vouch.UNASKED:
            return self._take_unasked(version, "it no longer publishes the control block mapped here")
        return verdict

    async def ask(self, version: int) -> Vouch:
        """Whether the publisher's own control block (only it writes it) vouches for
        ``version``: any peer can write our FRONT, so a version past what the publisher has
        begun to push is refused, and never becomes the live one (see :meth:`judge`).

        The block is read through the mapping here while the publisher still publishes it,
        else over the network (at most ``ASK_S`` seconds), else through the mapping of the block
        a publisher that left wrote last. When none can be read (the publisher has exited,
        crashed, is restarting or does not answer, and is not on this host), the version is
        UNASKED: taken as it is, as the synchronous ``apply()`` takes it. Never raises for the
        publisher (only ClosedError, for our own Transport).

        Cancellation: nothing here changes (a read in flight is abandoned).
        """
        if not self._past(version):
            return Vouch.YES
        block = self._block
        if block is not None and block.current() and (words := block.read()) is not None:
            return self.judge(version, words, True)
        why = ""
        try:
            ctl = await read_words(self.t, self.publisher, self._keys.pubctl, CTL_WORDS,
                                   timeout=min(self.t.timeout, ASK_S))
        except ClosedError:
            raise
        except TransportError as exc:  # gone, restarting, not answering
            why = f"{type(exc).__name__}: {exc}"
        else:
            if block is not None:
                await self._map_block()  # a publisher back on this host: its new block
            return self.judge(version, ctl, True)
        if block is not None and (words := block.read()) is not None:
            if (verdict := self.judge(version, words, False)) is not Vouch.UNASKED:
                return verdict  # what the publisher wrote last covers it
        return self._take_unasked(version, why)

    def _take_unasked(self, version: int, why: str) -> Vouch:
        """UNASKED (logged once per version) for a version past the newest one vouched for."""
        if version <= self.latest:
            return Vouch.YES  # (the block was to be read for the live version's sake)
        if version != self._unasked_logged:
            self._unasked_logged = version
            log.info("subscriber %s: cannot ask %s whether it published version %d of %r (%s): taken as it "
                     "is", self.t.name, self.publisher, version, self.name, why)
        return Vouch.UNASKED

    async def _map_block(self) -> None:
        """Maps the control block of the publisher now in the store (when it is on this host),
        unless the one mapped is still current. Keeps the old one when the new one cannot be
        mapped: what a publisher that left wrote last still vouches for what it covers."""
        if self._block is not None and self._block.current():
            return
        try:
            peer = await self.t.lookup(self.publisher)
        except ClosedError:
            raise
        except TransportError:
            return
        if peer is not None:
            self._block = LocalBlock.of(self.t, peer, self._keys.pubctl, CTL_WORDS) or self._block
