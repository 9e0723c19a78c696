"""Layouts of the ``transport`` vLLM backend: what a trainer offers, read off its weights, and
what each vLLM worker receives."""

from __future__ import annotations

from collections.abc import Iterable

from ..plan import (
    ITEMSIZE,
    GeneratorRank,
    LocalTensor,
    MeshLayoutError,
    MeshSharding,
    Piece,
    Replicate,
    TensorSpec,
    TrainerLayout,
    full_box,
)


def dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def full_trainer_layout(specs: Iterable[tuple[str, tuple[int, ...], str]]) -> TrainerLayout:
    """The layout of one trainer rank that holds every tensor whole: ``(name, shape, dtype)``.

    Raises:
        MeshLayoutError: a duplicate name or an unknown dtype.
    """
    one = MeshSharding((1,), (Replicate(),), (0,))
    return TrainerLayout.of(TensorSpec(n, tuple(int(d) for d in s), d, one) for n, s, d in specs)


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
