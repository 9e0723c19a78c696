"""Layouts of the ``transport`` vLLM backend: what each vLLM worker receives (whole tensors or
its TP slices), how it hands them to ``load_weights``, and the names a vLLM model loads."""

from __future__ import annotations

from typing import Any

from ..plan import (
    ITEMSIZE,
    GeneratorRank,
    LocalTensor,
    MeshLayoutError,
    Piece,
    TrainerLayout,
    full_box,
)


def whole_tensors(trainer: TrainerLayout) -> GeneratorRank:
    """A worker that receives every tensor the trainer offers, whole and at the trainer's dtype
    (Hugging Face names and shapes: what ``model.load_weights`` takes, on every TP rank; the
    model slices and fuses them itself). Derived tensors (FP8 block scales) are left out.

    Raises:
        MeshLayoutError: the trainer offers no tensor.
    """
    tensors = []
    for t in trainer.tensors:
        if t.scale_of is not None:
            continue
        if t.dtype not in ITEMSIZE:
            raise MeshLayoutError(f"{t.name}: unknown dtype {t.dtype!r}")
        box = full_box(t.shape)
        tensors.append(LocalTensor(t.name, t.shape, t.dtype, (Piece(t.name, box, box),)))
    if not tensors:
        raise MeshLayoutError("the trainer layout offers no tensor")
    return GeneratorRank.of(tensors)


def checkpoint_names(model: object) -> set[str] | None:
    """The Hugging Face names ``model.load_weights`` takes, read off a vLLM model: its parameter
    names with each fused module (``packed_modules_mapping``, e.g. ``qkv_proj``) expanded into
    the checkpoint's parts (``q_proj``, ``k_proj``, ``v_proj``). None when the model declares no
    mapping (the names cannot be known without loading)."""
    packed = getattr(model, "packed_modules_mapping", None)
    named = getattr(model, "named_parameters", None)
    if not isinstance(packed, dict) or named is None:
        return None
    out: set[str] = set()
    for name, _ in named():
        parts = name.split(".")
        for i, p in enumerate(parts):
            if p in packed:
                out.update(".".join([*parts[:i], sub, *parts[i + 1:]]) for sub in packed[p])
                break
        else:
            out.add(name)
    return out


def tp_slices(trainer: TrainerLayout, hf_config: object, *, tp: int, rank: int) -> GeneratorRank:
    """A worker of TP rank ``rank`` of ``tp`` that receives only the box of each Hugging Face
    tensor its rank reads: the one box around the pieces ``transport.plan.generator_rank`` gives
    that rank (vLLM's own TP split: heads, rows or columns, padded vocab), the whole tensor for
    names the plan does not know. Loading then hands ``load_weights`` a full-shaped tensor with
    that box filled (:func:`full_shaped`), of which vLLM's loader reads only the box.

    Raises:
        MeshLayoutError: the architecture is unknown to ``transport.plan`` (use whole tensors).
    """
    from ..plan import generator_rank, model_config
    from ..plan._boxes import volume

    cfg = model_config(hf_config)
    dtypes = [t.dtype for t in trainer.tensors if t.scale_of is None]
    dtype = max(set(dtypes), key=dtypes.count) if dtypes else "bfloat16"
    boxes: dict[str, list[tuple[tuple[int, int], ...]]] = {}
    for lt in generator_rank(cfg, tp=tp, rank=rank, dtype=dtype).tensors:
        for p in lt.pieces:
            boxes.setdefault(p.name, []).append(p.box)
    tensors = []
    for t in trainer.tensors:
        if t.scale_of is not None:
            continue
        got = boxes.get(t.name)
        if got is None or any(len(b) != len(t.shape) for b in got):
            box = full_box(t.shape)
        else:
            box = tuple((min(b[d][0] for b in got), max(b[d][1] for b in got)) for d in range(len(t.shape)))
        shape = tuple(hi - lo for lo, hi in box)
        if volume(box) == 0:
            continue
        tensors.append(LocalTensor(t.name, shape, t.dtype, (Piece(t.name, box, full_box(shape)),)))
    return GeneratorRank.of(tensors)


def full_shaped(trainer: TrainerLayout, layout: GeneratorRank, views: dict[str, Any]) -> Any:
    """``(name, tensor)`` for ``load_weights``: each received box placed in a zeroed tensor of the
    Hugging Face shape (made one at a time, as the loader asks for them)."""
    import torch

    shapes = {t.name: t.shape for t in trainer.tensors}
    for lt in layout.tensors:
        view = views[lt.name]
        (piece,) = lt.pieces
        whole = shapes[lt.name]
        if piece.box == full_box(whole):
            yield lt.name, view
            continue
        out = torch.zeros(whole, dtype=view.dtype)
        out[tuple(slice(lo, hi) for lo, hi in piece.box)] = view
        yield lt.name, out
