"""Layouts on the wire: round trips, and hostile bytes refused with MeshLayoutError only."""

from __future__ import annotations

import json
import random

import pytest

from tests.plan._cases import random_case
from transport.plan import MeshLayoutError, Planner, Replica
from transport.plan._codec import RankLayout, decode_rank, decode_trainer, encode_rank, encode_trainer


@pytest.mark.parametrize("seed", range(10))
def test_layouts_round_trip(seed):
    trainer, replicas = random_case(seed)
    assert decode_trainer(encode_trainer(trainer)) == trainer
    for rep in replicas:
        for k, g in enumerate(rep.ranks):
            back = decode_rank(encode_rank(RankLayout(rep.id, k, len(rep.ranks), g)))
            assert back == RankLayout(rep.id, k, len(rep.ranks), g)


def _valid_rank() -> bytes:
    _, replicas = random_case(1)
    return encode_rank(RankLayout(replicas[0].id, 0, len(replicas[0].ranks), replicas[0].ranks[0]))


BAD_DOCS = [
    b"", b"\xff\xfe", b"[]", b"null", b'{"format": 1, "kind": "trainer"}', b'{"format": 2, "kind": "generator"}',
    b"[" * 100_000,  # nesting bomb
    json.dumps({"format": 1, "kind": "generator", "replica": "r", "rank": 3, "size": 2, "tensors": []}).encode(),
    json.dumps({"format": 1, "kind": "generator", "replica": "r", "rank": 0, "size": 1,
                "tensors": [{"name": "x", "shape": [2, -1], "dtype": "float32", "pieces": []}]}).encode(),
    json.dumps({"format": 1, "kind": "generator", "replica": "r", "rank": 0, "size": 1,
                "tensors": [{"name": "x", "shape": [2], "dtype": "float32", "pieces": [["a", [[0, 1, 2]], [[0, 1]]]]}]}
               ).encode(),
    json.dumps({"format": 1, "kind": "generator", "replica": "", "rank": 0, "size": 1, "tensors": []}).encode(),
    json.dumps({"format": 1, "kind": "generator", "replica": "r", "rank": True, "size": 1, "tensors": []}).encode(),
]


@pytest.mark.parametrize("doc", BAD_DOCS)
def test_malformed_rank_layouts_are_refused(doc):
    with pytest.raises(MeshLayoutError):
        decode_rank(doc)


def test_malformed_trainer_layouts_are_refused():
    def doc(sharding: dict, dtype: str = "float32") -> bytes:
        tensor = {"name": "a", "shape": [4], "dtype": dtype, "sharding": sharding}
        return json.dumps({"format": 1, "kind": "trainer", "tensors": [tensor]}).encode()

    bad = [
        doc({"mesh": [2], "ranks": [0], "placements": [["S", 0]]}),  # 2 mesh positions, 1 rank
        doc({"mesh": [1], "ranks": [0], "placements": [["S", 5]]}),  # no dim 5
        doc({"boxes": [[0, [[0, 9]]]]}),  # outside the tensor
        doc({"boxes": [[0, [[0, 4]]]]}, dtype="nope"),
    ]
    for data in bad:
        with pytest.raises(MeshLayoutError):
            decode_trainer(data)


def test_random_corruptions_never_raise_anything_but_a_layout_error():
    trainer, _ = random_case(2)
    good = _valid_rank()
    rng = random.Random(0)
    for _ in range(400):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.choice(b'0123456789[]{}",:-ae ')
        try:
            rl = decode_rank(bytes(data))
        except MeshLayoutError:
            continue
        # Decoded: then validating and planning it refuses it cleanly, or plans it.
        try:
            Planner(trainer).plan([Replica(rl.replica, (rl.layout,))])
        except MeshLayoutError:
            pass
