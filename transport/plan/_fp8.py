"""FP8 e4m3 weights with 128x128 block scales (the DeepSeek-V3 / Kimi-K2 serving format),
converted at the source.

A weight ``W`` of shape ``[..., R, C]`` is sent as FP8 plus ``W_scale_inv`` of shape
``[..., ceil(R/128), ceil(C/128)]`` (float32, ``W ~= fp8 * scale_inv`` block by block). Both are
planned like any other tensor: the FP8 values by ``W``'s own sharding, the scales by a derived
one, each scale block held by the trainer rank that holds the block's first element. A trainer
rank whose box cuts through blocks (FSDP's uneven row shards do) still quantizes its rows
exactly as a whole-block quantizer would: the block's absolute maximum is combined from every
rank's part of the block before any rank scales its rows (see ``transport.weights``).

Generator side, :func:`fp8_generator_rank` adds the ``weight_scale_inv`` tensor beside every FP8
weight, with one scale piece per weight piece; a piece must start and end on block boundaries
(or at the tensor's end), as vLLM's block-quantized layers require.
"""

from __future__ import annotations

from collections.abc import Callable

from .._errors import MeshLayoutError
from ._boxes import Box
from ._layouts import ExplicitSharding, GeneratorRank, LocalTensor, Piece, TensorSpec, TrainerLayout

FP8_BLOCK = 128  # the side of a square block that shares one scale, in elements
FP8_DTYPE = "float8_e4m3fn"  # the dtype name FP8 tensors carry in layouts
FP8_MAX = 448.0  # the largest finite e4m3 value


def fp8_scale_name(weight: str) -> str:
    """``a.b.weight`` -> ``a.b.weight_scale_inv`` (vLLM's name for block scales)."""
    return weight + "_scale_inv"


def fp8_blocks(n: int) -> int:
    """Blocks of ``FP8_BLOCK`` elements that cover ``n`` elements (the last one may be partial)."""
    return -(-n // FP8_BLOCK)


def scale_box(box: Box) -> Box:
    """The scale blocks whose first element lies in ``box`` (leading dims unchanged, the last
    two in blocks): the blocks a trainer rank holding ``box`` sends the scales of."""
    lead, rows, cols = box[:-2], box[-2], box[-1]
    return (*lead, (fp8_blocks(rows[0]), fp8_blocks(rows[1])), (fp8_blocks(cols[0]), fp8_blocks(cols[1])))


def _default_select(t: TensorSpec) -> bool:
    skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight")
    return len(t.shape) >= 2 and t.name.endswith(".weight") and not any(s in t.name for s in skip)


def fp8_trainer_layout(layout: TrainerLayout, select: Callable[[TensorSpec], bool] | None = None) -> TrainerLayout:
    """``layout`` with the selected weights sent as FP8 with 128x128 block scales.

    Args:
        layout: the trainer layout (any dtypes).
        select: which tensors to quantize (default: linear and expert weights, i.e. tensors of
            2+ dims named ``*.weight`` other than embeddings, lm_head, norms and the MoE router).

    Returns:
        The layout with those tensors at ``float8_e4m3fn`` and a ``*_scale_inv`` tensor
        (float32, ``scale_of`` set) beside each.
    """
    pick = select or _default_select
    out = []
    for t in layout.tensors:
        if t.scale_of is not None or not pick(t):
            out.append(t)
            continue
        if len(t.shape) < 2:
            raise MeshLayoutError(f"{t.name}: FP8 block scales need 2+ dimensions, shape {t.shape}")
        out.append(TensorSpec(t.name, t.shape, FP8_DTYPE, t.sharding))
        held = tuple((r, scale_box(b)) for r, b in sorted(t.sharding.boxes(t.shape).items()))
        shape = (*t.shape[:-2], fp8_blocks(t.shape[-2]), fp8_blocks(t.shape[-1]))
        out.append(TensorSpec(fp8_scale_name(t.name), shape, "float32", ExplicitSharding(held), scale_of=t.name))
    return TrainerLayout.of(out)


def _aligned(lo: int, hi: int, n: int, what: str) -> tuple[int, int]:
    if lo % FP8_BLOCK or (hi % FP8_BLOCK and hi != n):
        raise MeshLayoutError(f"{what}: [{lo}, {hi}) of {n} is not on {FP8_BLOCK}-element block boundaries")
    return lo // FP8_BLOCK, fp8_blocks(hi)


def fp8_generator_rank(rank: GeneratorRank, trainer: TrainerLayout) -> GeneratorRank:
    """``rank`` with a ``*_scale_inv`` local tensor beside every local tensor that is FP8 and
    fed from FP8 global tensors of ``trainer`` (one scale piece per weight piece).

    Raises:
        MeshLayoutError: a piece does not start and end on block boundaries, in the global
            tensor or in the local one.
    """
    specs = trainer.by_name()
    out = list(rank.tensors)
    for lt in rank.tensors:
        if lt.dtype != FP8_DTYPE or len(lt.shape) < 2 or not lt.pieces:
            continue
        pieces = []
        for p in lt.pieces:
            spec = specs.get(p.name)
            if spec is None or spec.dtype != FP8_DTYPE or fp8_scale_name(p.name) not in specs:
                raise MeshLayoutError(f"{lt.name}: FP8 but fed from {p.name}, which the trainer does not send as FP8")
            g_shape, where = spec.shape, f"{lt.name} <- {p.name}"
            gbox = (*p.box[:-2], _aligned(*p.box[-2], g_shape[-2], where), _aligned(*p.box[-1], g_shape[-1], where))
            lbox = (*p.local[:-2], _aligned(*p.local[-2], lt.shape[-2], where),
                    _aligned(*p.local[-1], lt.shape[-1], where))
            pieces.append(Piece(fp8_scale_name(p.name), gbox, lbox))
        shape = (*lt.shape[:-2], fp8_blocks(lt.shape[-2]), fp8_blocks(lt.shape[-1]))
        out.append(LocalTensor(fp8_scale_name(lt.name), shape, "float32", tuple(pieces)))
    return GeneratorRank.of(out)
