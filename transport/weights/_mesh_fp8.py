"""FP8 block quantization at the source, for trainer ranks whose shards cut through blocks.

A 128x128 block's scale is its absolute maximum / 448. Under FSDP a block's rows are often
spread over several trainer ranks, so each rank computes the maxima of its part of every block
(*partial* maxima), publishes them in its ``amax<v % 2>`` region, reads the partial maxima of
the other ranks that share its blocks (one-sided gets, each checked against that rank's
``AMAXVER`` word before and after the read), and scales its own rows with the combined maxima:
exactly what a quantizer holding the whole block would produce. The rank holding a block's first
element sends its scale (see ``transport.plan.fp8_trainer_layout``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import torch

from .._errors import TransferTimeoutError
from ..plan import (
    FP8_BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    Box,
    TrainerLayout,
    box_shape,
    fp8_blocks,
    fp8_scale_name,
    intersect,
    volume,
)
from ._control import memory_barrier
from ._mesh_control import AMAXVER0, TCTL_WORDS, MeshKeys, slot_of
from ._polling import PENDING, Pending, poll, seqlock_read

if TYPE_CHECKING:
    from .. import Transport


def block_range(box: Box) -> Box:
    """The blocks ``box`` touches: leading dims as they are, the last two in blocks."""
    lead, (r0, r1), (c0, c1) = box[:-2], box[-2], box[-1]
    return (*lead, (r0 // FP8_BLOCK, fp8_blocks(r1)), (c0 // FP8_BLOCK, fp8_blocks(c1)))


def _local(region: Box, origin: Box) -> tuple[slice, ...]:
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(region, origin, strict=True))


def partial_layout(layout: TrainerLayout, rank: int) -> tuple[dict[str, tuple[int, Box]], int]:
    """Where trainer ``rank`` keeps the partial maxima of each FP8 tensor in its ``amax``
    arrays (float32 elements): name -> (offset, the block range it covers); and the total."""
    out, at = {}, 0
    for spec in layout.tensors:
        if spec.dtype != FP8_DTYPE:
            continue
        box = spec.sharding.boxes(spec.shape).get(rank)
        if box is None or any(hi <= lo for lo, hi in box):
            continue
        rng = block_range(box)
        out[spec.name] = (at, rng)
        at += volume(rng)
    return out, max(at, 1)


def _block_view(x: torch.Tensor, box: Box) -> torch.Tensor:
    """``x`` (the local shard of ``box``) zero-padded to whole blocks and shaped
    ``[*lead, nbr, FP8_BLOCK, nbc, FP8_BLOCK]``."""
    (r0, r1), (c0, c1) = box[-2], box[-1]
    top, left = r0 % FP8_BLOCK, c0 % FP8_BLOCK
    nbr, nbc = fp8_blocks(r1) - r0 // FP8_BLOCK, fp8_blocks(c1) - c0 // FP8_BLOCK
    padded = x.new_zeros((*x.shape[:-2], nbr * FP8_BLOCK, nbc * FP8_BLOCK))
    padded[..., top : top + x.shape[-2], left : left + x.shape[-1]] = x
    return padded.view(*x.shape[:-2], nbr, FP8_BLOCK, nbc, FP8_BLOCK)


class BlockQuantizer:
    """One trainer rank's FP8 quantization of its shards (see the module docstring).

    Args:
        transport: the trainer rank's Transport.
        keys: the stream's region names.
        layout: the trainer layout (FP8 tensors and their ``*_scale_inv`` beside them).
        rank: this trainer rank.
    """

    def __init__(self, transport: Transport, keys: MeshKeys, layout: TrainerLayout, rank: int) -> None:
        self.t, self.keys, self.layout, self.rank = transport, keys, layout, rank
        self.specs = layout.by_name()
        self.mine, total = partial_layout(layout, rank)
        # This rank's box of each FP8 tensor, and the scale blocks it sends (worked out once).
        self._boxes = {n: self.specs[n].sharding.boxes(self.specs[n].shape)[rank] for n in self.mine}
        self._scale_boxes = {}
        for n in self.mine:
            sname = fp8_scale_name(n)
            sbox = self.specs[sname].sharding.boxes(self.specs[sname].shape).get(rank)
            if sbox is not None and volume(sbox) > 0:
                self._scale_boxes[n] = sbox
        self._arrays: list[torch.Tensor] = []
        self._total = total
        self._others: dict[int, dict[str, tuple[int, Box]]] = {}

    @property
    def active(self) -> bool:
        return any(s.dtype == FP8_DTYPE for s in self.layout.tensors)

    def start(self) -> None:
        if self.active:
            self._arrays = [self.t.empty(k, self._total, torch.float32, writable=False) for k in self.keys.amax]

    async def quantize(self, version: int, shards: dict[str, torch.Tensor], tctl: torch.Tensor,
                       trainer_peers: dict[int, str], deadline: float) -> dict[str, torch.Tensor]:
        """FP8 values of this rank's shards and the scale blocks it sends, for ``version``.

        Args:
            version: the version being published.
            shards: name -> this rank's local shard (high precision) of every FP8 tensor it holds.
            tctl: this rank's control words (AMAXVER is set here).
            trainer_peers: trainer rank -> peer name (all of them).
            deadline: seconds to wait for the other ranks' partial maxima.

        Returns:
            name -> tensor to pack: the FP8 shard of each FP8 tensor, the scale shard of each
            ``*_scale_inv`` this rank holds blocks of.

        Raises:
            TransferTimeoutError: a rank sharing a block did not publish its partial maxima for
                this version within ``deadline`` (the version then fails on this rank).
        """
        s = slot_of(version)
        tctl[AMAXVER0 + s] = 0
        memory_barrier()
        amax: dict[str, torch.Tensor] = {}
        arr = self._arrays[s]
        for name, (off, _) in self.mine.items():
            part = _block_view(shards[name].detach().float(), self._boxes[name]).abs().amax(dim=(-3, -1))
            arr[off : off + part.numel()].copy_(part.reshape(-1))
            amax[name] = part.clone()
        memory_barrier()
        tctl[AMAXVER0 + s] = version + 1
        with anyio.fail_after(deadline):
            try:
                await self._combine(version, amax, trainer_peers)
            except TimeoutError as exc:
                raise TransferTimeoutError(f"trainer rank {self.rank}: the partial FP8 block maxima of version "
                                           f"{version} did not all arrive within {deadline:g}s") from exc
        out: dict[str, torch.Tensor] = {}
        for name, (_, rng) in self.mine.items():
            box = self._boxes[name]
            scale = (amax[name] / FP8_MAX).clamp(min=1e-12)
            x = _block_view(shards[name].detach().float(), box)
            q = (x / scale[..., :, None, :, None]).view(*x.shape[:-4], x.shape[-4] * FP8_BLOCK, x.shape[-2] * FP8_BLOCK)
            (r0, r1), (c0, c1) = box[-2], box[-1]
            top, left = r0 % FP8_BLOCK, c0 % FP8_BLOCK
            out[name] = q[..., top : top + r1 - r0, left : left + c1 - c0].to(torch.float8_e4m3fn)
            sbox = self._scale_boxes.get(name)
            if sbox is not None:
                out[fp8_scale_name(name)] = scale[_local(sbox, rng)].contiguous()
        return out

    async def _combine(self, version: int, amax: dict[str, torch.Tensor], trainer_peers: dict[int, str]) -> None:
        """Folds in the partial maxima of every other rank that shares a block with this one."""
        for other, peer in sorted(trainer_peers.items()):
            if other == self.rank:
                continue
            theirs = self._others.get(other)
            if theirs is None:
                theirs = self._others[other] = partial_layout(self.layout, other)[0]
            shared: list[tuple[str, Box]] = []
            for n, (_, rng) in self.mine.items():
                common = intersect(rng, theirs[n][1]) if n in theirs else None
                if common is not None:
                    shared.append((n, common))
            if not shared:
                continue
            got = await self._read_partials(version, other, peer, theirs, shared)
            for n, (theirs_arr, region, rng) in got.items():
                mine = amax[n][_local(region, self.mine[n][1])]
                torch.maximum(mine, theirs_arr[_local(region, rng)], out=mine)

    async def _read_partials(self, version: int, other: int, peer: str, theirs: dict[str, tuple[int, Box]],
                             shared: list[tuple[str, Box]]) -> dict[str, tuple[torch.Tensor, Box, Box]]:
        """Trainer rank ``other``'s partial maxima of ``version`` for the ``shared`` regions,
        read once its ``AMAXVER`` word says they are complete, and kept only if that word did
        not change during the read (it is the seqlock of its ``amax`` arrays: 0 while written).
        Waits as long as the caller's deadline lets it.

        Returns:
            name -> (their partial maxima of its block range, the shared region, that range).

        Raises:
            TransferTimeoutError: ``other`` is past ``version`` already, or overwrote its
                partial maxima while they were read.
        """
        s = slot_of(version)
        word = torch.empty(TCTL_WORDS, dtype=torch.int64)

        async def amax_version() -> int:
            await self.t.get(word, peer, key=self.keys.tctl)
            return int(word[AMAXVER0 + s])

        async def published() -> int | Pending:
            v = await amax_version()
            if v > version + 1:
                raise TransferTimeoutError(f"trainer rank {other} is past version {version} already")
            return v if v == version + 1 else PENDING

        async def read() -> dict[str, tuple[torch.Tensor, Box, Box]]:
            got = {}
            for n, region in shared:
                off, rng = theirs[n]
                buf = torch.empty(volume(rng), dtype=torch.float32)
                await self.t.get(buf, peer, key=self.keys.amax[s], offset=off * 4)
                got[n] = (buf.view(box_shape(rng)), region, rng)
            return got

        seen = await poll(published, timeout=None, what=f"trainer rank {other}'s partial maxima of {version}")
        got = await seqlock_read(amax_version, read, stable=lambda v: v == version + 1, seen=seen)
        if got is PENDING:
            raise TransferTimeoutError(f"trainer rank {other} overwrote its partial maxima while they were read")
        return got
