"""The parts the subscribers sequence, each on its own, without a publisher process: the stream
subscriber's trust in the publisher's word (:mod:`transport.weights._trust`), the reader's slot
claim both subscribers make (:func:`transport.weights._control.claim`), and the mesh delta
areas' ``MAT0`` words (:mod:`transport.weights._mesh_delta_intake`)."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

import numpy as np
import pytest
import torch

import transport
from transport import ClosedError
from transport.weights._control import CTL_WORDS, DIFFING, FRONT, LATEST, NO_SLOT, READING, StreamKeys, claim, release
from transport.weights._mesh_control import CTL_WORDS as MESH_CTL_WORDS
from transport.weights._mesh_control import MAT0, MeshKeys
from transport.weights._mesh_delta_intake import SlotDeltas
from transport.weights._trust import Trust, Vouch


def _block(latest: int, diffing: bool = False) -> torch.Tensor:
    words = torch.zeros(CTL_WORDS, dtype=torch.int64)
    words[LATEST] = latest
    words[DIFFING] = int(diffing)
    return words


@contextlib.asynccontextmanager
async def _subscriber_side() -> AsyncIterator[transport.Transport]:
    """A real Transport for the subscriber's side, alone in its store (no publisher)."""
    async with transport.Transport("gen-0", store=f"memory://{uuid.uuid4().hex}", backends=("tcp",)) as t:
        yield t


def _trust(t: transport.Transport) -> Trust:
    return Trust(t, "trainer", "policy")


# -- the trust in the publisher's word ---------------------------------------------------------


async def test_the_current_publishers_block_vouches_for_what_it_covers_and_refuses_the_rest(caplog):
    async with _subscriber_side() as t:
        trust = _trust(t)
        caplog.set_level(logging.WARNING, logger="transport.weights")
        assert trust.judge(3, _block(3, diffing=True), True) is Vouch.YES and trust.diffs
        assert trust.judge(4, _block(3), True) is Vouch.NO and not trust.diffs
        assert trust.judge(4, _block(3), True) is Vouch.NO
        assert sum("someone else wrote it" in r.getMessage() for r in caplog.records) == 1  # once per version


async def test_a_gone_publishers_last_block_vouches_but_cannot_refuse_and_lowers_nothing():
    async with _subscriber_side() as t:
        trust = _trust(t)
        assert trust.judge(5, _block(5), True) is Vouch.YES
        assert trust.judge(6, _block(2), False) is Vouch.UNASKED
        assert trust.latest == 5  # what a publisher that left wrote last does not lower the bound
        assert trust.judge(5, _block(2), False) is Vouch.YES


async def test_a_live_version_past_the_publishers_block_is_forgotten():
    async with _subscriber_side() as t:
        trust = _trust(t)
        trust.made_live(9, word=37, verdict=Vouch.UNASKED)
        assert trust.live_at_least(9) == 9  # taken unasked: it stands until the block is read
        assert trust.judge(2, _block(2), True) is Vouch.YES
        assert trust.live is None and trust.newer(1, 1) and trust.live_at_least(1) is None


async def test_an_unasked_live_version_never_holds_back_another_front_word():
    async with _subscriber_side() as t:
        trust = _trust(t)
        trust.made_live(4, word=17, verdict=Vouch.UNASKED)
        assert not trust.newer(17, 4)  # the same word: nothing new
        assert trust.newer(13, 3)  # another word, even of an older version, replaces it
        trust.made_live(4, word=17, verdict=Vouch.YES)
        assert not trust.newer(13, 3)


async def test_a_publisher_that_cannot_be_asked_leaves_the_version_unasked_once_logged(caplog):
    """No publisher in the store: its block cannot be read, so the version is taken as it is
    (logged once per version)."""
    async with _subscriber_side() as t:
        trust = _trust(t)
        caplog.set_level(logging.INFO, logger="transport.weights")
        assert await trust.ask(2) is Vouch.UNASKED
        assert await trust.ask(2) is Vouch.UNASKED
        assert trust.here(2) is Vouch.UNASKED  # no mapping of the block here: no word without the network
        assert sum("cannot ask trainer" in r.getMessage() for r in caplog.records) == 1


async def test_asking_reads_the_block_only_past_the_bound_and_closed_is_ours():
    """The publisher's real block over the network: read for a version past the bound seen,
    not for one it covers (the block changed meanwhile: a read would have seen it); a closed
    Transport of ours raises."""
    store = f"memory://{uuid.uuid4().hex}"
    async with transport.Transport("trainer", store=store, backends=("tcp",)) as pub:
        block = pub.empty(StreamKeys.of("policy").pubctl, CTL_WORDS, torch.int64, writable=False)
        block.copy_(_block(7))
        async with transport.Transport("gen-0", store=store, backends=("tcp",)) as t:
            trust = _trust(t)
            assert await trust.ask(6) is Vouch.YES and trust.latest == 7
            block.copy_(_block(3))  # not read while the bound covers the version asked
            assert await trust.ask(7) is Vouch.YES and trust.latest == 7
            assert await trust.ask(8) is Vouch.NO and trust.latest == 3  # read now
        with pytest.raises(ClosedError):  # our own Transport is closed
            await trust.ask(8)


# -- the reader's claim on a slot ---------------------------------------------------------------


def test_a_claim_holds_while_the_front_stays_and_is_withdrawn_when_it_moved():
    ctl = torch.zeros(CTL_WORDS, dtype=torch.int64)
    ctl[READING] = NO_SLOT
    ctl[FRONT] = 21
    assert claim(ctl, READING, 1, FRONT, 21) and int(ctl[READING]) == 1
    release(ctl, READING)
    assert int(ctl[READING]) == NO_SLOT
    assert not claim(ctl, READING, 1, FRONT, 17)  # the writer moved on: choose again
    assert int(ctl[READING]) == NO_SLOT


# -- the mesh delta areas -----------------------------------------------------------------------


def test_the_mat_words_say_which_version_a_slot_holds_whole():
    ctl = torch.zeros(MESH_CTL_WORDS, dtype=torch.int64)
    deltas = SlotDeltas(None, MeshKeys.of("m"), wanted=True)  # type: ignore[arg-type]
    deltas.writing(ctl, 1)
    assert int(ctl[MAT0 + 1]) == 0
    deltas.whole(ctl, 6, 0)
    assert int(ctl[MAT0]) == 7
    deltas.materialize(ctl, 6, 0)  # no areas yet: nothing to apply, the words stay
    assert int(ctl[MAT0]) == 7 and deltas.last == (0, 0)


@pytest.mark.parametrize("runs", [{}, {0: np.array([[0, 0, 3]], dtype=np.int64)}], ids=["fed-by-none", "odd-runs"])
def test_no_delta_areas_where_the_plan_leaves_no_room_for_them(runs):
    deltas = SlotDeltas(None, MeshKeys.of("m"), wanted=True)  # type: ignore[arg-type]
    assert deltas.awaiting_plan
    deltas.make([], runs)  # registers nothing: it would need the Transport
    assert not deltas.awaiting_plan
