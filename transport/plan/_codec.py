"""Layouts on the wire: JSON, bounded and checked field by field.

A layout read from a peer's region is hostile until checked: its size is bounded before it is
parsed, every field is type-checked here, and the result is validated as a layout
(:meth:`TrainerLayout.validate`, :meth:`Replica.validate`) before anything is planned from it.
Every failure is a :class:`MeshLayoutError` naming what was wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .._errors import MeshLayoutError
from ._boxes import Box
from ._layouts import (
    ExplicitSharding,
    GeneratorRank,
    LocalTensor,
    MeshSharding,
    Piece,
    Placement,
    Replicate,
    Shard,
    Sharding,
    TensorSpec,
    TrainerLayout,
)

MAX_LAYOUT_BYTES = 64 << 20  # a layout region larger than this is refused unread
_FORMAT = 1


def _box(b: Box) -> list[list[int]]:
    return [[lo, hi] for lo, hi in b]


def _sharding(s: Sharding) -> dict[str, Any]:
    if isinstance(s, MeshSharding):
        return {"mesh": list(s.mesh_shape), "ranks": list(s.ranks),
                "placements": [["S", p.dim] if isinstance(p, Shard) else ["R"] for p in s.placements]}
    return {"boxes": [[r, _box(b)] for r, b in s.boxes_by_rank]}


def encode_trainer(layout: TrainerLayout) -> bytes:
    """The layout as JSON bytes."""
    doc = {"format": _FORMAT, "kind": "trainer",
           "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "sharding": _sharding(t.sharding),
                        **({"scale_of": t.scale_of} if t.scale_of is not None else {})}
                       for t in layout.tensors]}
    if layout.balance != "replica":
        doc["balance"] = layout.balance
    return json.dumps(doc, separators=(",", ":")).encode()


@dataclass(frozen=True)
class RankLayout:
    """What one generator rank publishes: its replica, its place in it, and its needs."""

    replica: str
    rank: int
    size: int
    layout: GeneratorRank


def encode_rank(r: RankLayout) -> bytes:
    """The rank's layout as JSON bytes."""
    doc = {"format": _FORMAT, "kind": "generator", "replica": r.replica, "rank": r.rank, "size": r.size,
           "tensors": [{"name": lt.name, "shape": list(lt.shape), "dtype": lt.dtype,
                        "pieces": [[p.name, _box(p.box), _box(p.local)] for p in lt.pieces]}
                       for lt in r.layout.tensors]}
    return json.dumps(doc, separators=(",", ":")).encode()


def _load(data: bytes, kind: str) -> dict[str, Any]:
    if len(data) > MAX_LAYOUT_BYTES:
        raise MeshLayoutError(f"a {kind} layout of {len(data)} bytes exceeds {MAX_LAYOUT_BYTES}")
    try:
        doc = json.loads(bytes(data).rstrip(b"\0").decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise MeshLayoutError(f"a {kind} layout that is not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT or doc.get("kind") != kind:
        raise MeshLayoutError(f"not a format-{_FORMAT} {kind} layout")
    return doc


def _int(x: Any, what: str, lo: int = 0) -> int:
    if type(x) is not int or x < lo:
        raise MeshLayoutError(f"{what}: expected an integer >= {lo}, got {x!r}")
    return x


def _str(x: Any, what: str) -> str:
    if not isinstance(x, str) or not x or len(x) > 1024:
        raise MeshLayoutError(f"{what}: expected a name, got {x!r}")
    return x


def _list(x: Any, what: str) -> list[Any]:
    if not isinstance(x, list):
        raise MeshLayoutError(f"{what}: expected a list, got {type(x).__name__}")
    return x


def _shape(x: Any, what: str) -> tuple[int, ...]:
    return tuple(_int(n, what) for n in _list(x, what))


def _read_box(x: Any, what: str) -> Box:
    out = []
    for iv in _list(x, what):
        pair = _list(iv, what)
        if len(pair) != 2:
            raise MeshLayoutError(f"{what}: an interval needs two bounds, got {pair!r}")
        out.append((_int(pair[0], what), _int(pair[1], what)))
    return tuple(out)


def _read_sharding(x: Any, what: str) -> Sharding:
    if not isinstance(x, dict):
        raise MeshLayoutError(f"{what}: expected a sharding object")
    if "mesh" in x:
        placements: list[Placement] = []
        for p in _list(x.get("placements"), what):
            p = _list(p, what)
            if p == ["R"]:
                placements.append(Replicate())
            elif len(p) == 2 and p[0] == "S":
                placements.append(Shard(_int(p[1], what)))
            else:
                raise MeshLayoutError(f"{what}: unknown placement {p!r}")
        ranks = tuple(_int(r, what) for r in _list(x.get("ranks"), what))
        return MeshSharding(_shape(x.get("mesh"), what), tuple(placements), ranks)
    pairs = []
    for item in _list(x.get("boxes"), what):
        item = _list(item, what)
        if len(item) != 2:
            raise MeshLayoutError(f"{what}: expected [rank, box]")
        pairs.append((_int(item[0], what), _read_box(item[1], what)))
    return ExplicitSharding(tuple(pairs))


def decode_trainer(data: bytes) -> TrainerLayout:
    """The trainer layout in ``data``, checked.

    Raises:
        MeshLayoutError: not a well-formed, valid trainer layout.
    """
    doc = _load(data, "trainer")
    specs = []
    for t in _list(doc.get("tensors"), "tensors"):
        if not isinstance(t, dict):
            raise MeshLayoutError("tensors: expected objects")
        name = _str(t.get("name"), "tensor name")
        scale_of = t.get("scale_of")
        specs.append(TensorSpec(name, _shape(t.get("shape"), name), _str(t.get("dtype"), name),
                                _read_sharding(t.get("sharding"), name),
                                _str(scale_of, name) if scale_of is not None else None))
    return TrainerLayout.of(specs, _str(doc.get("balance", "replica"), "balance"))


def decode_rank(data: bytes) -> RankLayout:
    """The generator rank layout in ``data``, checked for form (validate it against the trainer
    layout with :meth:`Replica.validate` before planning).

    Raises:
        MeshLayoutError: not a well-formed generator rank layout.
    """
    doc = _load(data, "generator")
    size = _int(doc.get("size"), "size", 1)
    rank = _int(doc.get("rank"), "rank")
    if rank >= size:
        raise MeshLayoutError(f"rank {rank} of a replica of {size}")
    tensors = []
    for t in _list(doc.get("tensors"), "tensors"):
        if not isinstance(t, dict):
            raise MeshLayoutError("tensors: expected objects")
        name = _str(t.get("name"), "local tensor name")
        pieces = []
        for p in _list(t.get("pieces"), name):
            p = _list(p, name)
            if len(p) != 3:
                raise MeshLayoutError(f"{name}: a piece is [name, box, local box]")
            pieces.append(Piece(_str(p[0], name), _read_box(p[1], name), _read_box(p[2], name)))
        tensors.append(LocalTensor(name, _shape(t.get("shape"), name), _str(t.get("dtype"), name), tuple(pieces)))
    return RankLayout(_str(doc.get("replica"), "replica"), rank, size, GeneratorRank.of(tensors))
