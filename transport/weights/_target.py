"""The local tensors a stream ``Subscriber`` writes versions into.

They are matched against the publisher's layout once, at start (by name both ways, through
``rename``, and by shape: :meth:`Target.match`), and every version is then written into them
from a slot or a pulled copy, by copying (:meth:`Target.unpack`: host tensors, a memcpy split
across the available cores, :mod:`._copy`; CUDA, one ``_tensor_kernels.unpack``; plus a
dequantisation per fp8 tensor) or by re-pointing them at the slot (:meth:`Target.repoint`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import torch

from .. import _tensor_kernels
from .._errors import LayoutMismatchError
from ._apply import ApplyPlan, Copies, dequantize_into, host_unpack
from ._layout import Entry, Layout

log = logging.getLogger(__name__)
SHOWN_NAMES = 5  # names listed in a mismatch message before "and N more"


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:SHOWN_NAMES])
    return shown + (f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else "")


class Target:
    """The (layout entry, local tensor) pairs of one subscriber, and the copies that fill them.

    Args:
        matched: the pairs, as :meth:`match` finds them.
        device: where the subscriber's slots live.
        threads: how many threads a host copy is split across.
    """

    def __init__(self, matched: list[tuple[Entry, torch.Tensor]], device: torch.device, threads: int) -> None:
        self.matched = matched
        self._plan = ApplyPlan.of(matched)
        self._threads = threads
        # Host slots into host tensors: copies split across the cores (else _tensor_kernels.unpack).
        self.host = device.type == "cpu" and all(not dst.is_cuda for _, dst in matched)
        # CUDA devices an apply queues work on (apply_async queues it on the caller's streams).
        self.devices = sorted({dst.device.index for _, dst in matched if dst.is_cuda}
                              | ({device.index} if device.type == "cuda" else set()))
        # Devices whose queued copies read a device slot in apply() (a host slot is consumed by
        # the time copy_ returns): apply() waits for them before it lets the slot go.
        self.gpus = sorted({dst.device.index for _, dst in matched if dst.is_cuda} | {device.index}) \
            if device.type == "cuda" else []

    @classmethod
    def match(cls, local: Mapping[str, torch.Tensor], layout: Layout, *, rename: Callable[[str], str | None] | None,
              strict: bool, who: str, where: str, device: torch.device, threads: int) -> Target:
        """Pairs ``layout``'s entries with the ``local`` tensors; checks shapes, and names both
        ways (see ``Subscriber``'s ``strict``).

        Args:
            who: the subscriber's Transport name, for the messages.
            where: whose layout of which stream it is, for the messages.

        Raises:
            LayoutMismatchError: a shape differs; or (``strict``) the names do not match both
                ways (``not_received``/``not_sent`` list them all).
        """
        matched: list[tuple[Entry, torch.Tensor]] = []
        not_received: list[str] = []
        received: set[str] = set()
        for e in layout.entries:
            local_name = rename(e.name) if rename is not None else e.name
            if local_name is None:
                continue  # left out on purpose
            dst = local.get(local_name)
            if dst is None:
                not_received.append(e.name if local_name == e.name else f"{e.name} -> {local_name}")
                continue
            if tuple(dst.shape) != e.shape:
                raise LayoutMismatchError(
                    f"{local_name!r}: local shape {tuple(dst.shape)} but the publisher sends {e.shape}"
                )
            matched.append((e, dst))
            received.add(local_name)
        not_sent = [n for n in local if n not in received]
        if strict and (not_received or not_sent):
            parts = []
            if not_received:
                parts.append(f"{len(not_received)} tensor(s) it sends have no local counterpart: "
                             f"{_names(not_received)}")
            if not_sent:
                parts.append(f"{len(not_sent)} local tensor(s) are not sent: {_names(not_sent)}")
            raise LayoutMismatchError(
                f"{who}: the local tensors do not match {where}: {'; '.join(parts)} (map names with "
                f"rename=, or pass strict=False to leave them unsynced)",
                not_received=not_received, not_sent=not_sent,
            )
        if not_sent:
            log.warning("subscriber %s: %d local tensor(s) are not in %s and stay unsynced (strict=False): %s",
                        who, len(not_sent), where, _names(not_sent))
        if not_received:
            log.info("subscriber %s: ignoring %d tensor(s) of %s with no local counterpart (strict=False): %s",
                     who, len(not_received), where, _names(not_received))
        return cls(matched, device, threads)

    def unpack(self, buf: torch.Tensor) -> None:
        """Copies a whole version from ``buf`` (a slot or a pulled copy) into the local tensors.

        CUDA work is queued on the current streams of the devices involved (a device ``buf``:
        one batched-copy launch for the same-dtype tensors on its device); host-to-host copies
        are done when this returns.
        """
        with torch.no_grad():
            self._fill(buf, self._plan.copies)

    def repoint(self, slot: torch.Tensor) -> None:
        """Re-points the local tensors at ``slot``; those that need a conversion are copied."""
        plan = self._plan
        storage = slot.untyped_storage()
        with torch.no_grad():
            for e, dst, strides in plan.repoint:
                dst.set_(storage, e.offset // dst.element_size(), e.shape, strides)
            self._fill(slot, plan.zc_copies)

    def _fill(self, buf: torch.Tensor, copies: Copies) -> None:
        """Copies ``copies`` out of ``buf``, and dequantises the converted tensors."""
        if self.host:
            host_unpack(buf, copies, self._plan.converted, self._threads)
            return
        _tensor_kernels.unpack(buf, copies.dsts, copies.offsets, copies.dtypes)
        dequantize_into(buf, self._plan.converted)
