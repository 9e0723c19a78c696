"""A third peer (a real process, tests/peers/word_forger.py) writes a consumer's control word
with version 2**60 (its control block is writable by design: the publisher writes it). Nothing
it writes wedges a consumer.

Stream sync, a consumer that only ever calls the synchronous ``apply()`` (sync code, threads),
the forged word being its FRONT:

* on the publisher's host (``ipc``) ``apply()`` reads the publisher's own control block through
  this process's mapping of it (no network) and refuses the forged version outright;
* where that block cannot be read without the network (``tcp`` here: no mapping), ``apply()``
  takes the forged version as it is, but such an unchecked version holds back nothing: the
  publisher's next version is applied by the next ``apply()``.

Before the fix, ``apply()`` took 2**60 in both cases and then returned None for every later
version (``version`` stayed 2**60) until an asynchronous call.

Mesh sync, the forged word being the COMMIT word of a replica's leader: its next commit
replaces it with the newest version complete at every rank that the trainer ranks vouch for.
Before, the leader kept returning 2**60 and never committed again.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

import transport
from tests._support import PYTHON, ROOT, python_env
from transport.plan import GeneratorRank, LocalTensor, MeshSharding, Piece, Shard, TensorSpec, TrainerLayout, full_box
from transport.weights import MeshPublisher, MeshSubscriber, Publisher, Subscriber, SyncStatus
from transport.weights._control import FRONT, StreamKeys, encode_front
from transport.weights._mesh_control import COMMIT, MeshKeys

FORGED = 1 << 60


@pytest.fixture
def forger(tmp_path, file_store):
    """``forger(backend, victim, key, offset)`` starts tests/peers/word_forger.py, which writes
    ``encode_front(2**60, 0)`` there on each ``forge`` signal and answers ``forged`` to
    ``trainer``."""
    procs: list[tuple[subprocess.Popen[bytes], object]] = []

    def start(backend: str, victim: str, key: str, offset: int) -> None:
        spec = {"name": "forger", "store": file_store, "backends": [backend], "victim": victim, "key": key,
                "offset": offset, "word": encode_front(FORGED, 0), "notify": "trainer"}
        log = open(tmp_path / "forger.log", "wb")
        procs.append((subprocess.Popen([PYTHON, "-m", "tests.peers.word_forger", json.dumps(spec)],
                                       env=python_env(), cwd=ROOT, stderr=log), log))

    yield start
    for proc, log in procs:
        proc.kill()
        proc.wait(timeout=30)
        log.close()


async def _forge(t: transport.Transport, n: int) -> None:
    """Has the forger write its word (its n-th time) and waits until it has."""
    await t.peer("forger", timeout=60)
    await t.signal("forger", "forge", n)
    await t.wait_signal("forged", at_least=n, timeout=60)


@pytest.mark.parametrize("backend", ["ipc", "tcp"])
async def test_a_sync_only_consumer_is_never_wedged_by_a_forged_front_word(forger, file_store, backend):
    src = {"w": torch.zeros(4096)}
    dst = {"w": torch.zeros(4096)}
    async with (transport.Transport("trainer", store=file_store, backends=(backend,), timeout=20) as tt,
                transport.Transport("gen", store=file_store, backends=(backend,), timeout=20) as tg):
        forger(backend, "gen", StreamKeys.of("policy").ctl, FRONT * 8)
        async with Publisher(tt, src, deadline=20) as pub, Subscriber(tg, dst, publisher="trainer") as sub:
            src["w"].fill_(1)
            assert (await pub.publish(1)).done == ["gen"]
            assert sub.apply() == 1 and sub.version == 1

            await _forge(tt, 1)
            assert sub.latest == FORGED
            if backend == "ipc":  # the publisher's block, mapped here, does not vouch for it
                assert sub.apply() is None and sub.version == 1 and bool((dst["w"] == 1).all())
            else:  # no block to read without the network: taken unchecked
                assert sub.apply() == FORGED
            src["w"].fill_(3)
            assert (await pub.publish(3)).done == ["gen"]
            assert sub.apply() == 3 and sub.version == 3 and bool((dst["w"] == 3).all())  # never wedged

            await _forge(tt, 2)  # again, once the publisher has moved on
            if backend == "ipc":
                assert sub.apply() is None and sub.version == 3
            else:
                assert sub.apply() == FORGED
            src["w"].fill_(4)
            assert (await pub.publish(4)).done == ["gen"]
            assert sub.apply() == 4 and sub.version == 4 and bool((dst["w"] == 4).all())
            assert sub.apply() is None  # nothing newer
            assert await sub.wait_version(4, timeout=20) == 4 and await sub.apply_async() is None  # they agree


async def test_a_forged_commit_word_never_wedges_a_mesh_leader(forger, file_store):
    shape = (64, 32)
    layout = TrainerLayout.of([TensorSpec("w", shape, "float32", MeshSharding((1,), (Shard(0),), (0,)))])
    need = GeneratorRank.of([LocalTensor("w", shape, "float32", (Piece("w", full_box(shape), full_box(shape)),))])
    w = torch.zeros(shape)
    async with (transport.Transport("trainer", store=file_store, backends=("ipc",), timeout=20) as tt,
                transport.Transport("gen", store=file_store, backends=("ipc",), timeout=20) as tg):
        forger("ipc", "gen", MeshKeys.of("m").ctl, COMMIT * 8)
        async with (MeshPublisher(tt, "m", {"w": w}, layout, rank=0, deadline=20) as pub,
                    MeshSubscriber(tg, "m", replica="A", rank=0, size=1, layout=need, timeout=20) as sub):
            w.fill_(1)
            assert (await pub.publish(1)).results["A/0"].status is SyncStatus.DONE
            assert await sub.commit() == 1 and sub.apply() == 1

            await _forge(tt, 1)
            assert sub.committed() == FORGED
            assert await sub.commit() == 1  # the trainer rank vouches for 1, not 2**60: committed again
            w.fill_(2)
            assert (await pub.publish(2)).results["A/0"].status is SyncStatus.DONE
            assert await sub.commit() == 2 and sub.apply() == 2 and bool((sub.tensors["w"] == 2).all())
