"""Forged relay orders: a subscriber's relay block is writable by any peer (the publisher writes
its orders there), so a third peer can order it to copy from anywhere. Nothing it forges
becomes live weights, crashes the subscriber's relay task, or stops the next real version.

The forger is a real Transport that poses as a relay: it registers a relay block and slots of
the stream's size, writes an order into the victim's block and rings its wake signal. Cases:
an order whose fields do not fit (a slot index out of range, an overlong name, a name no peer
can have), a "delta" from a relay without delta headers, a log whose rows reach outside the
slot, and a well-formed one whose "version" is garbage bytes
(copied into a free slot and acknowledged, but never made the front: only the publisher does
that, for an order of its own).
"""

from __future__ import annotations

import pytest
import torch

import transport
from tests._support.relay_words import acked
from transport.weights import Publisher, Subscriber, SyncStatus
from transport.weights import _relay_block as rb
from transport.weights._control import StreamKeys

KEYS = StreamKeys.of("policy")


def state() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(256, 256), "b": torch.zeros(1000)}


@pytest.fixture
async def world(file_store):
    """A publisher, a relay-capable subscriber (the victim) and a forger posing as a relay."""
    async with (transport.Transport("pub", store=file_store) as tp,
                transport.Transport("victim", store=file_store) as tv,
                transport.Transport("forger", store=file_store) as tf):
        model = state()
        async with Publisher(tp, model, bucket_bytes=64 << 10) as pub:
            local = state()
            async with Subscriber(tv, local, publisher="pub") as sub:
                for x in model.values():
                    x.fill_(1.0)
                assert (await pub.publish(1)).results["victim"].status == SyncStatus.DONE
                assert await sub.apply_async() == 1
                fake_block = tf.empty(KEYS.relay, rb.block_words(sub.layout), torch.int64)
                fake_slots = [tf.empty(KEYS.slots[i], sub.layout.total, torch.uint8) for i in (0, 1)]
                for s in fake_slots:
                    s.fill_(0xAB)  # garbage: bf16/fp32 NaN-ish bytes
                yield model, pub, sub, local, tf, fake_block


async def forge(tf: transport.Transport, order: rb.Order, raw: dict[int, int] | None = None) -> None:
    for words, offset in rb.order_spans(order):
        await tf.put(words, "victim", key=KEYS.relay, offset=offset)
    for word, value in (raw or {}).items():
        await tf.put(torch.tensor([value], dtype=torch.int64), "victim", key=KEYS.relay, offset=8 * word)
    await tf.signal("victim", KEYS.relay_wake, 1 << 62)


async def test_forged_orders_change_no_live_weights(world):
    model, pub, sub, local, tf, fake_block = world
    block = sub._relay._block  # the victim's own block
    before = {k: v.clone() for k, v in local.items()}

    # Fields that do not fit: refused without a copy.
    await forge(tf, rb.Order(101, 2, "forger", 0, 1), {rb.M_SRC: 7})
    assert await acked(block, 101) is rb.Ack.FAILED
    await forge(tf, rb.Order(102, 2, "forger", 0, 1), {rb.M_NAME_LEN: 10_000})
    assert await acked(block, 102) is rb.Ack.FAILED

    # A name no peer can have (it killed the relay task: the lookup raised ValueError).
    await forge(tf, rb.Order(105, 2, "no/such", 0, 1))
    assert await acked(block, 105) is rb.Ack.FAILED
    # A "delta" from a relay without delta headers (it killed the relay task: KeyError).
    fake_block[rb.S_EPOCH], fake_block[rb.S_COUNT], fake_block[rb.S_END] = 106, 0, int(rb.End.DELTA)
    await forge(tf, rb.Order(106, 2, "forger", 0, 1))
    assert await acked(block, 106) is rb.Ack.FAILED

    # A log whose rows reach outside the slot: refused before any row is copied.
    fake_block[rb.S_EPOCH], fake_block[rb.S_END] = 103, 0
    fake_block[rb.ROWS], fake_block[rb.ROWS + 1] = sub.layout.total - 8, 64
    fake_block[rb.S_COUNT] = 1
    await forge(tf, rb.Order(103, 2, "forger", 0, 1))
    assert await acked(block, 103) is rb.Ack.FAILED

    # Well formed, garbage bytes: copied into the free slot and acknowledged, never made live.
    fake_block[rb.S_EPOCH], fake_block[rb.S_END] = 104, 0
    fake_block[rb.ROWS], fake_block[rb.ROWS + 1] = 0, sub.layout.total
    fake_block[rb.S_COUNT] = 1
    fake_block[rb.S_END] = int(rb.End.DENSE)
    await forge(tf, rb.Order(104, 2, "forger", 0, 1))
    assert await acked(block, 104) is rb.Ack.DONE
    assert await sub.apply_async() is None and sub.version == 1
    assert all(torch.equal(local[k], before[k]) for k in local)

    # The relay task lives on, and the next real version is applied whole.
    for x in model.values():
        x.fill_(2.0)
    r = await pub.publish(2)
    assert r.results["victim"].status == SyncStatus.DONE
    assert await sub.wait_version(2, timeout=20) == 2
    assert all(bool((v == 2.0).all()) for v in local.values())
    assert sub._relay.followed == 1  # the forged well-formed order: copied, never live
