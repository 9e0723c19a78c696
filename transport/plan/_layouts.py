"""Layouts: what each trainer rank offers and what each generator rank needs.

Trainer side: every global tensor (a name in the trainer's state dict) has a global shape, a
dtype and a *sharding* that says which box of it each trainer rank holds, contiguous and
row-major in that rank's memory. :class:`MeshSharding` is DTensor's model (a device mesh and one
``Shard(dim)`` / ``Replicate()`` per mesh dimension, shards cut as ``torch.chunk`` cuts them, so
uneven); :class:`ExplicitSharding` lists the boxes (Megatron style). Ranks that hold the same box
are duplicates (DP/HSDP replicas, replicated tensors): the planner takes each byte from one.

Generator side: every generator rank lists its local tensors (vLLM names, often fused), and for
each the :class:`Piece` s it is made of: a box of a global tensor, and where that box lands in the
local tensor. A :class:`Replica` is the ranks of one inference engine, which apply a version
together.

Layouts are plain frozen data: built from any rank's view, compared and hashed, validated once
(:meth:`TrainerLayout.validate`, :meth:`Replica.validate`) so that a careless or hostile layout
is refused with a :class:`MeshLayoutError` before anything is planned from it.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .._errors import MeshLayoutError
from ._boxes import Box, Shape, box_shape, chunk, contains, full_box, volume

#: Bytes per element of the dtypes a layout may name (torch names without the ``torch.``).
ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


@dataclass(frozen=True)
class Shard:
    """The mesh dimension cuts tensor dimension ``dim`` (``torch.chunk`` sizes)."""

    dim: int


@dataclass(frozen=True)
class Replicate:
    """Every rank along the mesh dimension holds the same data."""


Placement = Shard | Replicate


@dataclass(frozen=True)
class MeshSharding:
    """DTensor's sharding: ``mesh_shape`` ranks arranged row-major as ``ranks`` (the global
    trainer rank of each mesh position), one placement per mesh dimension. Several mesh
    dimensions that shard one tensor dimension cut it in mesh-dimension order, as DTensor does."""

    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.mesh_shape) != len(self.placements) or not self.mesh_shape:
            raise MeshLayoutError(f"a mesh of shape {self.mesh_shape} needs one placement per dimension, "
                              f"got {len(self.placements)}")
        if any(n < 1 for n in self.mesh_shape) or int(np.prod(self.mesh_shape)) != len(self.ranks):
            raise MeshLayoutError(f"mesh of shape {self.mesh_shape} cannot hold ranks {self.ranks}")
        if len(set(self.ranks)) != len(self.ranks) or any(r < 0 for r in self.ranks):
            raise MeshLayoutError(f"mesh ranks must be distinct and non-negative, got {self.ranks}")

    def boxes(self, shape: Shape) -> dict[int, Box]:
        """The box of a tensor of ``shape`` that each rank of the mesh holds (maybe empty)."""
        for p in self.placements:
            if isinstance(p, Shard) and not 0 <= p.dim < len(shape):
                raise MeshLayoutError(f"Shard({p.dim}) of a {len(shape)}-d tensor")
        out = {}
        for rank, coords in zip(self.ranks, itertools.product(*(range(n) for n in self.mesh_shape)), strict=True):
            box = list(full_box(shape))
            for p, n, c in zip(self.placements, self.mesh_shape, coords, strict=True):
                if isinstance(p, Shard):
                    lo, hi = box[p.dim]
                    a, b = chunk(hi - lo, n, c)
                    box[p.dim] = (lo + a, lo + b)
            out[rank] = tuple(box)
        return out


@dataclass(frozen=True)
class ExplicitSharding:
    """The box each rank holds, listed (``(rank, box)`` pairs; a rank holds at most one box of a
    tensor)."""

    boxes_by_rank: tuple[tuple[int, Box], ...]

    def boxes(self, shape: Shape) -> dict[int, Box]:
        """The listed boxes, by rank."""
        out = dict(self.boxes_by_rank)
        if len(out) != len(self.boxes_by_rank):
            raise MeshLayoutError("a rank is listed twice")
        return out


Sharding = MeshSharding | ExplicitSharding


@dataclass(frozen=True)
class TensorSpec:
    """One global tensor of the trainer's state. ``scale_of``: this tensor is not in the state
    but derived from that one, its FP8 block scales (see ``transport.plan.fp8_trainer_layout``)."""

    name: str
    shape: Shape
    dtype: str
    sharding: Sharding
    scale_of: str | None = None


BALANCES = ("replica", "host", "all")


@dataclass(frozen=True)
class TrainerLayout:
    """Every global tensor the trainer ranks offer, by name (sorted: equal layouts compare and
    hash equal on every rank).

    ``balance``: how the planner breaks ties between trainer ranks that hold the same part
    (:data:`BALANCES`): ``"replica"`` differently for each replica (by its id: the trainer
    ranks' links share the load), ``"host"`` alike for the replicas of one host (by
    :attr:`Replica.balance`: they get the very same bytes from each trainer rank, so they can
    share a relay), ``"all"`` alike for every replica (a chain of relays across hosts). The
    trainer ranks publish it with the layout, so generator ranks plan the same.
    """

    tensors: tuple[TensorSpec, ...]
    balance: str = "replica"

    @classmethod
    def of(cls, tensors: Iterable[TensorSpec], balance: str = "replica") -> TrainerLayout:
        """The layout of ``tensors``, in canonical (name) order, validated.

        Raises:
            MeshLayoutError: a duplicate name, an unknown dtype, a box outside its tensor, or a
                ``balance`` not in :data:`BALANCES`.
        """
        layout = cls(tuple(sorted(tensors, key=lambda t: t.name)), balance)
        layout.validate()
        return layout

    def validate(self) -> None:
        """Raises MeshLayoutError unless every tensor is well formed and every rank's box lies in it."""
        if self.balance not in BALANCES:
            raise MeshLayoutError(f"balance must be one of {BALANCES}, not {self.balance!r}")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise MeshLayoutError("a tensor name is offered twice")
        for t in self.tensors:
            if t.dtype not in ITEMSIZE:
                raise MeshLayoutError(f"{t.name}: unknown dtype {t.dtype!r}")
            if any(n < 0 for n in t.shape):
                raise MeshLayoutError(f"{t.name}: negative dimension in shape {t.shape}")
            whole = full_box(t.shape)
            for rank, box in t.sharding.boxes(t.shape).items():
                if len(box) != len(t.shape) or any(lo > hi for lo, hi in box) or not contains(whole, box):
                    raise MeshLayoutError(f"{t.name}: rank {rank}'s box {box} is not inside shape {t.shape}")

    def cast(self, dtype: str, *, floating_only: bool = True) -> TrainerLayout:
        """The same layout sent at ``dtype`` (e.g. ``"bfloat16"`` from a float32 trainer): the
        publisher casts while it packs. Integer and bool tensors keep theirs unless
        ``floating_only`` is False.

        Raises:
            MeshLayoutError: an unknown dtype.
        """
        if dtype not in ITEMSIZE:
            raise MeshLayoutError(f"unknown dtype {dtype!r}")
        floating = {"float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"}
        return TrainerLayout.of(replace(t, dtype=dtype) if t.dtype in floating or not floating_only else t
                                for t in self.tensors)

    def by_name(self) -> dict[str, TensorSpec]:
        """The tensors by name."""
        return {t.name: t for t in self.tensors}

    def ranks(self) -> list[int]:
        """Every trainer rank that holds some box, sorted."""
        out: set[int] = set()
        for t in self.tensors:
            out.update(t.sharding.boxes(t.shape))
        return sorted(out)

    def fingerprint(self) -> str:
        """A short hash of the layout (equal on every rank that built the same layout)."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]


def trainer_layout_from_state_dict(state: Mapping[str, Any], *, rank: int | None = None,
                                   boxes: Mapping[str, tuple[Shape, Box]] | None = None) -> TrainerLayout:
    """The trainer layout read off one rank's state dict.

    DTensors (``torch.distributed.tensor``) carry the whole sharding, so every rank derives the
    same layout from its own state. Plain tensors need their place given in ``boxes``
    (``name -> (global shape, this rank's box)``): their sharding lists this rank only, and the
    layouts of all ranks are joined with :func:`merge_trainer_layouts`.

    Args:
        state: name -> tensor (DTensor or plain).
        rank: this rank (needed when ``boxes`` is given).
        boxes: the global shape and this rank's box of each plain tensor.

    Returns:
        The layout.

    Raises:
        MeshLayoutError: a plain tensor without a box, a box whose shape is not the tensor's, or a
            placement other than Shard/Replicate (e.g. Partial: reduce it first).
    """
    specs = []
    for name, value in state.items():
        dtype = str(value.dtype).removeprefix("torch.")
        mesh = getattr(value, "device_mesh", None)
        if mesh is not None:
            placements: list[Placement] = []
            for p in value.placements:
                kind = type(p).__name__
                if kind == "Shard":
                    placements.append(Shard(int(p.dim)))
                elif kind == "Replicate":
                    placements.append(Replicate())
                else:
                    raise MeshLayoutError(f"{name}: placement {p!r} is not supported (only Shard and Replicate)")
            sharding: Sharding = MeshSharding(tuple(mesh.shape), tuple(placements),
                                              tuple(int(r) for r in mesh.mesh.flatten().tolist()))
            specs.append(TensorSpec(name, tuple(value.shape), dtype, sharding))
            continue
        if boxes is None or name not in boxes or rank is None:
            raise MeshLayoutError(f"{name}: a plain tensor needs its global shape and box (boxes=..., rank=...)")
        shape, box = boxes[name]
        if box_shape(box) != tuple(value.shape):
            raise MeshLayoutError(f"{name}: box {box} has shape {box_shape(box)}, the tensor {tuple(value.shape)}")
        specs.append(TensorSpec(name, tuple(shape), dtype, ExplicitSharding(((rank, box),))))
    return TrainerLayout.of(specs)


def merge_trainer_layouts(layouts: Iterable[TrainerLayout]) -> TrainerLayout:
    """Joins the layouts that ranks derived on their own: mesh shardings must agree, explicit
    boxes are pooled.

    Raises:
        MeshLayoutError: two ranks disagree on a tensor's shape, dtype or mesh sharding.
    """
    merged: dict[str, TensorSpec] = {}
    for layout in layouts:
        for t in layout.tensors:
            have = merged.get(t.name)
            if have is None:
                merged[t.name] = t
                continue
            if (have.shape, have.dtype) != (t.shape, t.dtype):
                raise MeshLayoutError(f"{t.name}: ranks disagree on shape/dtype ({have.shape} {have.dtype} "
                                  f"against {t.shape} {t.dtype})")
            if isinstance(have.sharding, ExplicitSharding) and isinstance(t.sharding, ExplicitSharding):
                pooled = dict(have.sharding.boxes_by_rank)
                for r, b in t.sharding.boxes_by_rank:
                    if pooled.get(r, b) != b:
                        raise MeshLayoutError(f"{t.name}: rank {r} offers two boxes")
                    pooled[r] = b
                merged[t.name] = TensorSpec(t.name, t.shape, t.dtype, ExplicitSharding(tuple(sorted(pooled.items()))))
            elif have.sharding != t.sharding:
                raise MeshLayoutError(f"{t.name}: ranks disagree on its sharding")
    return TrainerLayout.of(merged.values())


@dataclass(frozen=True)
class Piece:
    """``box`` of global tensor ``name`` lands at ``local`` in a generator's local tensor."""

    name: str
    box: Box
    local: Box


@dataclass(frozen=True)
class LocalTensor:
    """One tensor of a generator rank (e.g. ``model.layers.0.self_attn.qkv_proj.weight``)."""

    name: str
    shape: Shape
    dtype: str
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return volume(full_box(self.shape)) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class GeneratorRank:
    """What one generator rank needs: its local tensors (sorted by name)."""

    tensors: tuple[LocalTensor, ...]

    @classmethod
    def of(cls, tensors: Iterable[LocalTensor]) -> GeneratorRank:
        return cls(tuple(sorted(tensors, key=lambda t: t.name)))


@dataclass(frozen=True)
class Replica:
    """One generator replica (an inference engine): an id unique in the job and its ranks, in
    TP rank order. All of its ranks apply a version together.

    ``balance``: what the planner breaks ties between duplicate holders by (empty: the id).
    Replicas of one balance key take a part several trainer ranks hold from the same one, so
    that they get the very same bytes from each trainer rank: mesh sync gives the host of a
    replica's rank 0, so that the replicas of one host can share a relay.
    """

    id: str
    ranks: tuple[GeneratorRank, ...]
    meta: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    balance: str = ""

    def validate(self, trainer: TrainerLayout) -> None:
        """Raises MeshLayoutError unless every piece names an offered tensor, lies inside it and
        inside its local tensor with the same shape, and no two pieces of a local tensor
        overlap."""
        offered = trainer.by_name()
        if not self.id:
            raise MeshLayoutError("a replica needs an id")
        for r, g in enumerate(self.ranks):
            names = [t.name for t in g.tensors]
            if len(set(names)) != len(names):
                raise MeshLayoutError(f"replica {self.id} rank {r}: a local tensor name appears twice")
            for lt in g.tensors:
                where = f"replica {self.id} rank {r} {lt.name}"
                if lt.dtype not in ITEMSIZE:
                    raise MeshLayoutError(f"{where}: unknown dtype {lt.dtype!r}")
                whole = full_box(lt.shape)
                for p in lt.pieces:
                    spec = offered.get(p.name)
                    if spec is None:
                        raise MeshLayoutError(f"{where}: piece of {p.name!r}, which no trainer rank offers")
                    if (len(p.box) != len(spec.shape) or len(p.local) != len(lt.shape)
                            or not contains(full_box(spec.shape), p.box) or not contains(whole, p.local)):
                        raise MeshLayoutError(f"{where}: piece {p.box} of {p.name} -> {p.local} lies outside a tensor")
                    if volume(p.box) != volume(p.local) or _squeeze(box_shape(p.box)) != _squeeze(box_shape(p.local)):
                        raise MeshLayoutError(f"{where}: piece {p.box} of {p.name} and its place {p.local} "
                                              "differ in shape")
                _check_disjoint(where, lt.pieces)

    def fingerprint(self) -> str:
        return hashlib.sha256(repr((self.id, self.ranks, self.balance)).encode()).hexdigest()[:16]


def _squeeze(shape: Shape) -> Shape:
    return tuple(n for n in shape if n != 1)


def _check_disjoint(where: str, pieces: Sequence[Piece]) -> None:
    """No two pieces of one local tensor share an element (sweep over their first dimension)."""
    if len(pieces) < 2 or not pieces[0].local:
        if len(pieces) > 1:
            raise MeshLayoutError(f"{where}: several pieces fill one 0-d tensor")
        return
    order = sorted(pieces, key=lambda p: p.local[0][0])
    active: list[Piece] = []
    for p in order:
        active = [a for a in active if a.local[0][1] > p.local[0][0]]
        for a in active:
            if all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a.local, p.local, strict=True)):
                raise MeshLayoutError(f"{where}: pieces {a.name}{a.box} and {p.name}{p.box} overlap at the destination")
        active.append(p)
