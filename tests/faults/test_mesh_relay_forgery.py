"""Forged mesh relay orders: a generator rank's relay block is writable by any peer (trainer
ranks write their orders there), so a third peer can order it to copy from anywhere. Nothing it
forges becomes committed weights, crashes the rank's relay task, or stops the next real version.

The forger is a real Transport posing as a relay: it registers a relay block and slots of the
rank's size and writes orders into the victim's section of trainer rank 0. Cases: a slot that
is not the version's, a name no peer can have, runs whose fingerprint is not the victim's, a
piece count past what the runs cut into, a delta whose payload reaches outside the victim's
area, and a well-formed order whose bytes are garbage (copied into the slot and acknowledged,
but its done word is never written: only the trainer rank does that, for an order of its own).
"""

from __future__ import annotations

import pytest
import torch

import transport
from tests._support.relay_words import acked
from transport.plan import GeneratorRank, LocalTensor, MeshSharding, Piece, Shard, TensorSpec, TrainerLayout
from transport.weights import MeshPublisher, MeshSubscriber, SyncStatus
from transport.weights import _relay_block as rb
from transport.weights._mesh_control import MeshKeys, done_word
from transport.weights._mesh_push import runs_fingerprint

KEYS = MeshKeys.of("m")
SHAPE = (256, 128)
LAYOUT = TrainerLayout.of([TensorSpec("w", SHAPE, "float32", MeshSharding((1,), (Shard(0),), (0,)))])
GEN = GeneratorRank.of([LocalTensor("w", SHAPE, "float32",
                                    (Piece("w", ((0, SHAPE[0]), (0, SHAPE[1])), ((0, SHAPE[0]), (0, SHAPE[1]))),))])


@pytest.fixture
async def world(file_store):
    """Trainer rank 0, a one-rank replica (the victim, version 0 committed and applied) and a
    forger posing as a relay."""
    async with (transport.Transport("trainer", store=file_store) as tt,
                transport.Transport("victim", store=file_store) as tv,
                transport.Transport("forger", store=file_store) as tf):
        w = torch.full(SHAPE, 1.0)
        async with MeshPublisher(tt, "m", {"w": w}, LAYOUT, rank=0, deadline=10.0) as pub:
            async with MeshSubscriber(tv, "m", replica="R", rank=0, size=1, layout=GEN, timeout=20) as sub:
                assert (await pub.publish(0)).results["R/0"].status == SyncStatus.DONE
                assert await sub.commit() == 0 and sub.apply() == 0
                fake = tf.empty(KEYS.relay, rb.mesh_block_words(), torch.int64)
                slots = [tf.empty(k, sub._slots[0].numel(), torch.uint8) for k in KEYS.slots]
                areas = [tf.empty(k, 4096, torch.uint8) for k in KEYS.deltas]
                for s in (*slots, *areas):
                    s.fill_(0xAB)  # garbage
                yield w, pub, sub, tf, fake


async def forge(tf: transport.Transport, order: rb.Order, raw: dict[int, int] | None = None) -> None:
    for words, offset in rb.order_spans(order, rb.section(0)):
        await tf.put(words, "victim", key=KEYS.relay, offset=offset)
    for word, value in (raw or {}).items():
        await tf.put(torch.tensor([value], dtype=torch.int64), "victim", key=KEYS.relay, offset=8 * word)
    await tf.signal("victim", KEYS.relay_wake, 1 << 62)


def log(fake: torch.Tensor, epoch: int, count: int, end: rb.End) -> None:
    fake[rb.S_EPOCH], fake[rb.S_COUNT], fake[rb.S_END] = epoch, count, int(end)


async def test_forged_mesh_orders_commit_nothing(world):
    w, pub, sub, tf, fake = world
    words = sub._relay._sections[0]  # the victim's section of trainer rank 0
    runs, _ = await sub._relay_source(0)
    fingerprint = runs_fingerprint(runs)
    good = rb.MeshOrder(fingerprint, 1 << 15).words()  # version 2 goes in slot 0

    # A slot that is not the version's, and a name no peer can have.
    await forge(tf, rb.Order(101, 2, "forger", 1, 1, good))
    assert await acked(words, 101) is rb.Ack.FAILED
    await forge(tf, rb.Order(102, 2, "no/such", 0, 0, good))
    assert await acked(words, 102) is rb.Ack.FAILED
    # Runs that are not the victim's: refused before any copy.
    await forge(tf, rb.Order(103, 2, "forger", 0, 0, rb.MeshOrder(fingerprint ^ 1, 1 << 15).words()))
    assert await acked(words, 103) is rb.Ack.FAILED
    # A log that counts more pieces than the runs cut into.
    log(fake, 104, 10_000, rb.End.DENSE)
    await forge(tf, rb.Order(104, 2, "forger", 0, 0, good))
    assert await acked(words, 104) is rb.Ack.FAILED
    # A delta whose payload reaches past the victim's delta area (or it takes none yet).
    log(fake, 105, 1, rb.End.DELTA)
    await forge(tf, rb.Order(105, 2, "forger", 0, 0, rb.MeshOrder(fingerprint, 1 << 15, 0, 1 << 40, 64).words()))
    assert await acked(words, 105) is rb.Ack.FAILED

    # Well formed, garbage bytes: copied into slot 0 and acknowledged, never committed (the
    # victim's done word for trainer rank 0 there still names version 0).
    pieces = -(-int(runs[:, 2].sum()) // (1 << 15))
    log(fake, 106, pieces, rb.End.DENSE)
    await forge(tf, rb.Order(106, 2, "forger", 0, 0, good))
    assert await acked(words, 106) is rb.Ack.DONE
    assert int(sub._c[done_word(0, 0)]) == 1
    assert await sub.commit() == 0 and sub.apply() == 0
    assert bool((sub.tensors["w"] == 1.0).all())

    # The relay task lives on, and the next real versions are committed whole (version 2 into
    # the slot the forger scribbled on: every byte of it is written again).
    for v in (1, 2):
        w.fill_(float(v + 1))
        assert (await pub.publish(v)).results["R/0"].status == SyncStatus.DONE
        assert await sub.commit() == v and sub.apply() == v
        assert bool((sub.tensors["w"] == float(v + 1)).all())
    assert sub._relay.followed == 1  # the forged well-formed order: copied, never committed
