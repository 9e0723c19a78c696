"""A stream subscriber's intake of delta versions.

A subscriber takes deltas only when its slots are copied from host memory and every tensor
that can travel as one lands as it is in a contiguous host tensor of its wire dtype
(:meth:`DeltaIntake.of`). It then registers a delta index beside each of its two slots; the
publisher writes a delta version's index there and its payload into the slot.
:meth:`DeltaIntake.take` applies one, checked against per-tensor checksums before anything is
written (:class:`~._codec.apply.DeltaApplier`), or refuses it whole and remembers its front
word, so that it is not tried again: ``pull()`` or the next dense version catches up.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from .._errors import DeltaRefusedError
from .._tensors import dtype_name
from ._codec.apply import DeltaApplier
from ._codec.checksum import deltable
from ._codec.format import index_bytes
from ._codec.patch import overlapping
from ._layout import Layout

if TYPE_CHECKING:
    from .. import Transport
    from ._target import Target

log = logging.getLogger(__name__)


class DeltaIntake:
    """The delta applier of one subscriber, its index regions, and the deltas it refused.

    Args:
        applier: applies a delta into the local tensors, checked.
    """

    def __init__(self, applier: DeltaApplier) -> None:
        self.applier = applier
        self.indexes: list[torch.Tensor] = []  # the delta index beside slot 0 and 1 (once registered)
        self.refused_word = 0  # the front word of the last delta refused (not tried again)
        self.refusals = 0

    @classmethod
    def of(cls, layout: Layout, target: Target, *, zero_copy: bool, threads: int, who: str = "subscriber"
           ) -> DeltaIntake | None:
        """The intake, when the slots are copied (not ``zero_copy``) from host memory and
        every tensor that can travel as a delta lands as it is in a contiguous host tensor of
        its wire dtype (a conversion has no bits to patch), no two of them in the same memory;
        None when the subscriber takes dense versions only. ``who`` names it in the log."""
        if zero_copy or not target.host:
            return None
        local: dict[int, torch.Tensor] = {}
        index = {e.name: i for i, e in enumerate(layout.entries)}
        spans: list[tuple[int, int]] = []
        for e, dst in target.matched:
            if deltable(e) and (dst.is_cuda or not dst.is_contiguous() or dtype_name(dst.dtype) != e.wire_dtype):
                return None
            if deltable(e):
                spans.append((dst.data_ptr(), dst.data_ptr() + dst.numel() * dst.element_size()))
            local[index[e.name]] = dst
        if overlapping(spans):
            # Tied tensors (two names, one memory): a delta of each would be checked against
            # the other's stores and refused every version; such a subscriber takes them dense.
            log.info("subscriber %s: two tensors that can travel as deltas share memory (tied weights): dense only",
                     who)
            return None
        return cls(DeltaApplier(layout, [local.get(i) for i in range(len(layout.entries))], threads))

    def register(self, transport: Transport, keys: tuple[str, str], layout: Layout) -> None:
        """Registers the delta index beside each slot (``keys``: slot 0's, slot 1's)."""
        self.indexes = [transport.empty(key, index_bytes(layout) // 8, torch.int64) for key in keys]

    def holds(self, version: int, slot: int) -> bool:
        """Whether ``slot`` holds a delta of ``version`` (its index's header names it)."""
        if slot >= len(self.indexes):
            return False
        head = DeltaApplier.header_of(self.indexes[slot])
        return head is not None and head[0] == version

    def refused(self, word: int) -> bool:
        """Whether front word ``word`` names the delta refused last (not tried again)."""
        return self.refused_word != 0 and word == self.refused_word

    def take(self, data: torch.Tensor, slot: int, version: int, word: int) -> DeltaRefusedError | None:
        """Applies the delta of ``version`` in ``slot`` (``data``: the slot's bytes), or refuses
        it whole and remembers its front word ``word``. The caller holds the claim on the slot.

        Returns:
            None once applied; the refusal (nothing was written) otherwise.
        """
        try:
            self.applier.apply(data, self.indexes[slot], version)
        except DeltaRefusedError as exc:
            self.refused_word = word
            self.refusals += 1
            return exc
        return None
