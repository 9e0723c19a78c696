"""Records whose fields lie about each other, and bad records among good ones.

Weight-sync layouts are validated as a whole before anything is sized or copied from them
(``MalformedLayoutError``, a ``LayoutMismatchError``); a region whose size does not fit its
shape makes its whole peer record unusable; a mesh stream's bystander with a bad region is
left out of the scan while the legitimate members are still found; a ``tcp://`` store index
with holes and garbage still lists every real key at once.
"""

from __future__ import annotations

import dataclasses
import json

import anyio
import pytest
import torch

import transport
from transport._errors import WireError
from transport._errors import WireError as MalformedLayoutError
from transport._rendezvous import TCPStore, open_store
from transport._wire import PeerRecord
from transport.plan import GeneratorRank, LocalTensor, Piece, full_box, trainer_layout_from_state_dict
from transport.weights import LayoutMismatchError, MeshPublisher, MeshSubscriber, Publisher, Subscriber
from transport.weights._control import StreamKeys, encode_front
from transport.weights._layout import Layout, build_layout
from transport.weights._mesh_control import TCTL_WORDS, TRANK, MeshKeys, done_word
from transport.weights._mesh_peers import MeshPeers


def _layout_doc(total: int, entries: list, buckets: list | None = None) -> bytes:
    doc = {"format": "transport.weights.layout", "v": 1, "name": "policy", "total": total,
           "buckets": buckets if buckets is not None else [[0, total]] if total else [], "entries": entries}
    return json.dumps(doc).encode()


# --- layouts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [
    # 1,048,576 float32 elements claimed to be 64 bytes in a 64-byte version: apply() would have
    # copied 4 MiB out of a 4 KiB slot mapping.
    (64, [["w", [1048576], "float32", "float32", 0, 64, -1]]),
    (64, [["w", [4], "float32", "float32", 0, -16, -1]]),  # negative nbytes
    (128, [["w", [4], "float32", "float8_e4m3fn", 0, 4, 4096]]),  # fp8 scale outside the version
    (128, [["w", [4], "float32", "float8_e4m3fn", 0, 4, -1]]),  # converted without a scale
    (128, [["w", [4], "float32", "float32", 0, 16, 64]]),  # a scale for an unconverted entry
    (64, [["w", [4], "float32", "float32", 8, 16, -1]]),  # misaligned
    (64, [["w", [-4], "float32", "float32", 0, -16, -1]]),  # negative dimension
    (1 << 50, [["w", [1 << 48], "float32", "float32", 0, 1 << 50, -1]]),  # past any allocation
    (128, [["a", [4], "float32", "float32", 0, 16, -1], ["b", [4], "float32", "float32", 0, 16, -1]]),  # overlap
    (4096, [["w", [4], "float32", "float32", 0, 16, -1]]),  # total far past its entries
    (64, [["w", [4], "float32", "nosuchtype", 0, 16, -1]]),
    (64, [["w", [4], "float32", "float32", 0, True, -1]]),  # a bool is no size
])
def test_layouts_whose_fields_do_not_fit_are_typed_refusals(case):
    total, entries = case
    with pytest.raises(MalformedLayoutError) as info:
        Layout.decode(_layout_doc(total, entries))
    assert isinstance(info.value, LayoutMismatchError) and isinstance(info.value, WireError)


def test_buckets_outside_the_version_are_refused():
    with pytest.raises(MalformedLayoutError):
        Layout.decode(_layout_doc(64, [["w", [4], "float32", "float32", 0, 16, -1]], [[0, 128]]))
    with pytest.raises(MalformedLayoutError):
        Layout.decode(_layout_doc(64, [["w", [4], "float32", "float32", 0, 16, -1]], [[32, 64], [0, 32]]))


def test_every_layout_the_publisher_builds_decodes():
    tensors = {"a": torch.zeros(3, 5), "b": torch.zeros(0), "c": torch.zeros(1 << 19),
               "d": torch.zeros(7, dtype=torch.int8)}
    for fp8 in (None, lambda n, t: n in ("a", "c")):
        for bucket in (64, 4096, 1 << 20):
            layout = build_layout("policy", tensors, bucket_bytes=bucket, fp8=fp8)
            assert Layout.decode(layout.encode()) == layout


def _claim(store: str, name: str, key: str, nbytes: int) -> None:
    """Rewrites ``name``'s record in ``store``: its region ``key`` claims ``nbytes`` bytes."""
    s = open_store(store)
    record = PeerRecord.decode(s.get("peer/" + name))
    lie = dataclasses.replace(record.regions[key], shape=(nbytes,), nbytes=nbytes)
    s.set("peer/" + name, dataclasses.replace(record, regions={**record.regions, key: lie}).encode())


@pytest.mark.parametrize("claim", [1 << 40, 0])
async def test_a_subscriber_allocates_nothing_from_a_layout_region_that_lies(memory_store, claim):
    """The publisher's record claims a 1 TiB (or empty) layout region: start() refuses it
    before any allocation, with a typed error."""
    keys = StreamKeys.of("policy")
    async with (transport.Transport("trainer", store=memory_store) as tt,
                transport.Transport("gen", store=memory_store) as tg):
        tt.register(keys.layout, torch.zeros(64, dtype=torch.uint8), writable=False)
        tt.register(keys.pubctl, torch.zeros(8, dtype=torch.int64))
        _claim(memory_store, "trainer", keys.layout, claim)
        with pytest.raises(LayoutMismatchError):
            await Subscriber(tg, {"w": torch.zeros(4)}, publisher="trainer").start(timeout=5)


async def test_a_subscriber_refuses_a_poisoned_layout_before_it_registers_anything(memory_store):
    keys = StreamKeys.of("policy")
    poisoned = _layout_doc(64, [["w", [1048576], "float32", "float32", 0, 64, -1]])
    async with (transport.Transport("trainer", store=memory_store) as tt,
                transport.Transport("gen", store=memory_store) as tg):
        tt.register(keys.layout, torch.frombuffer(bytearray(poisoned), dtype=torch.uint8), writable=False)
        tt.register(keys.pubctl, torch.zeros(8, dtype=torch.int64))
        with pytest.raises(MalformedLayoutError):
            await Subscriber(tg, {"w": torch.zeros(1048576)}, publisher="trainer").start(timeout=5)
        me = await tt.peer("gen")
        assert not any(k.startswith("wsync.") for k in me.regions), me.regions  # no slot, no control block


# --- peer records ------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes, shape", [(-1, [4]), (1 << 40, [4]), (12, [4]), (4, [-4]), (16, [0])])
def test_a_region_whose_size_does_not_fit_its_shape_makes_the_record_malformed(nbytes, shape):
    doc = {"format": "transport.peer", "v": 1, "name": "x", "incarnation": "i", "seq": 1, "pid": 1, "pid_start": 1,
           "host": ["h", "b", 1], "agent": ["127.0.0.1", 1], "backends": {},
           "regions": [{"key": "w", "dtype": "float32", "shape": shape, "nbytes": nbytes, "writable": True,
                        "desc": {}}]}
    with pytest.raises(WireError):
        PeerRecord.decode(json.dumps(doc).encode())


# --- mesh scans --------------------------------------------------------------------------------


async def test_a_bad_bystander_never_fails_a_mesh_scan(memory_store):
    """A trainer rank next to a bystander whose tctl region is one word and one whose generator
    layout is garbage: the scan finds the trainer and leaves both bystanders out, every time."""
    keys = MeshKeys.of("m")
    async with (transport.Transport("trainer", store=memory_store) as tr,
                transport.Transport("one-word", store=memory_store) as bad1,
                transport.Transport("garbage", store=memory_store) as bad2,
                transport.Transport("scanner", store=memory_store) as me):
        tctl = tr.empty(keys.tctl, TCTL_WORDS, torch.int64)
        tctl[TRANK] = 1  # trainer rank 0
        bad1.register(keys.tctl, torch.ones(1, dtype=torch.int64))
        bad2.register(keys.rank, torch.full((64,), 0xFF, dtype=torch.uint8))
        bad2.register(keys.ctl, torch.zeros(8, dtype=torch.int64))
        peers = MeshPeers(me, keys)
        for _ in range(3):
            with anyio.fail_after(30):
                members = await peers.scan()
            assert {r: p.name for r, p in members.trainers.items()} == {0: "trainer"}
            assert members.generators == {}
        events = [e for e in me.flight_record()["events"] if e.get("event") == "mesh-peer-refused"]
        assert {e["peer"] for e in events} == {"one-word"}, events  # garbage: its layout is logged, not an error


# --- tcp:// store index ------------------------------------------------------------------------


def test_a_tcp_store_index_with_holes_and_garbage_still_lists_at_once():
    host = TCPStore("127.0.0.1", 0, is_host=True, timeout=20)
    try:
        joiner = TCPStore("127.0.0.1", host.port, is_host=False, timeout=20)
        joiner.set("peer/a", b"1")
        raw = joiner._store
        raw.add("__index_n", 1)  # a hole: what a writer killed between add and set leaves behind
        n = raw.add("__index_n", 1)
        raw.set(f"__index/{n}", b"\xff\xfe not utf-8")  # garbage
        joiner.set("peer/b", b"2")
        for store in (host, joiner, TCPStore("127.0.0.1", host.port, is_host=False, timeout=20)):
            assert store.keys("peer/") == ["peer/a", "peer/b"]
        raw.add("__index_n", 10**12)  # a jump far past anything real: bounded, and later keys still show
        joiner.set("peer/c", b"3")
        fresh = TCPStore("127.0.0.1", host.port, is_host=False, timeout=20)
        assert fresh.keys("peer/") == ["peer/a", "peer/b", "peer/c"]
    finally:
        host.close()



# --- control words -----------------------------------------------------------------------------


async def _scribble(t: transport.Transport, word: int) -> None:
    """What any peer may do: write the subscriber's FRONT word (its control block is writable)."""
    await t.put(torch.tensor([word], dtype=torch.int64), "gen", key=StreamKeys.of("policy").ctl, offset=0)


async def test_control_words_from_a_third_peer_never_break_or_wedge_a_subscriber(memory_store):
    """A FRONT naming slot 3 of a copy-mode subscriber is ignored (no IndexError); a version of
    2**60 is never applied by the async calls, nor by the sync apply(), which reads the
    same-host publisher's control block through its mapping (tests/faults/test_forged_front.py
    has a publisher it cannot read that way); wait_version and pull() stay on the publisher's
    own versions."""
    src = {"w": torch.zeros(1024)}
    async with (transport.Transport("trainer", store=memory_store) as tt,
                transport.Transport("gen", store=memory_store) as tg,
                transport.Transport("scribbler", store=memory_store) as ts):
        async with (Publisher(tt, src) as pub,
                    Subscriber(tg, dst := {"w": torch.zeros(1024)}, publisher="trainer") as sub):
            src["w"].fill_(1)
            await pub.publish(1)
            assert await sub.wait_version(1, timeout=30) == 1

            await _scribble(ts, encode_front(5, 3))  # a slot this subscriber does not have
            assert sub.latest is None and sub.apply() is None and await sub.apply_async() is None
            assert sub.version == 1

            await _scribble(ts, encode_front(1 << 60, 0))  # far past anything published
            assert await sub.apply_async() is None and sub.version == 1
            with pytest.raises(transport.TransferTimeoutError):
                await sub.wait_version(2, timeout=0.5)  # nothing new: it must not return 2**60
            src["w"].fill_(3)
            await pub.publish(3)
            assert await sub.wait_version(3, timeout=30) == 3 and bool((dst["w"] == 3).all())

            await _scribble(ts, encode_front(1 << 60, 0))
            assert sub.apply() is None and sub.version == 3  # the publisher's block, mapped here, refuses it
            src["w"].fill_(4)
            await pub.publish(4)
            assert await sub.wait_version(4, timeout=30) == 4 and bool((dst["w"] == 4).all())

            await _scribble(ts, encode_front(1 << 60, 0))
            assert sub.apply() is None and sub.version == 4
            assert await sub.pull(timeout=30) == 4 and sub.version == 4 and bool((dst["w"] == 4).all())


async def test_done_words_from_a_third_peer_never_wedge_a_mesh_replica(memory_store):
    """A scribbler marks slot 0 of a generator rank done at version 2**60 for the trainer rank
    (its ctl is writable by design): the leader's commit refuses a version no trainer rank has
    snapshotted, and the replica goes on committing the trainer's real versions."""
    state = {"w": torch.zeros(256)}
    layout = trainer_layout_from_state_dict(state, rank=0, boxes={"w": ((256,), full_box((256,)))})
    keys = MeshKeys.of("m")
    async with (transport.Transport("trainer", store=memory_store) as tt,
                transport.Transport("gen", store=memory_store) as tg,
                transport.Transport("scribbler", store=memory_store) as ts):
        pub = MeshPublisher(tt, "m", state, layout, rank=0, deadline=10)
        sub = MeshSubscriber(tg, "m", replica="r", rank=0, size=1, layout=whole_generator_rank(layout), timeout=30)
        await pub.start()
        await sub.start()
        try:
            state["w"].fill_(1)
            await pub.publish(2)
            assert await sub.commit(timeout=30) == 2 and sub.apply() == 2  # (slot 0 free for 4 again)

            forged = 1 << 60  # even: slot 0, as the protocol puts it
            await ts.put(torch.tensor([forged + 1], dtype=torch.int64), "gen", key=keys.ctl,
                         offset=8 * done_word(0, 0))
            assert await sub.commit(timeout=30) == 2, "committed a version no trainer rank has"
            state["w"].fill_(4)
            await pub.publish(4)
            assert await sub.commit(timeout=30) == 4
            assert sub.apply() == 4 and bool((sub.tensors["w"] == 4).all())
        finally:
            sub.close()
            pub.close()


def whole_generator_rank(layout):
    """One generator rank that takes every tensor whole (as transport.vllm's default does)."""
    return GeneratorRank.of([LocalTensor(t.name, t.shape, t.dtype, (Piece(t.name, full_box(t.shape),
                                                                         full_box(t.shape)),))
                             for t in layout.tensors])
