"""Where a stream's delta stops paying: the changed fraction above which a tensor (and a version,
by its sample) goes dense, chosen per version from what this publisher measured.

A delta of a version at changed fraction f costs the diff (it reads the new and the previous
version), the push of its encodings (about ``w(f)`` of the dense bytes) and the subscribers'
checked scatter (a cost per changed element); dense costs the push of every byte and a copy.
Over a link as fast as memory the diff and the scatter outweigh the bytes saved from a few
percent on (``CROSSOVER``); over a network the bytes dominate and much denser changes still pay
(``delta_sync-2026-12-03-tcp-10gbit-crossover-0.4.md``: 11-19% changed at 0.58-0.64x of dense
over 10 Gbit/s). :class:`Crossover` models both from measurements:

- the last dense push to each subscriber that takes deltas (seconds for the dense bytes; the
  fastest of them decides, as one encoding serves them all);
- the last full diff (seconds), else twice a copy of the dense bytes;
- a copy rate and a scatter cost per changed element, measured once on this host on a scratch
  buffer (:meth:`calibrate`, in the background after the first dense version).

Until all are known it answers ``CROSSOVER``; a crossover given to the publisher is used as it is.
"""

from __future__ import annotations

import time

import torch

from ..._native import delta as native
from ..._native import stream_copy
from .encode import CROSSOVER

NETWORK_MAX = 0.4  # the highest crossover chosen: denser changes go dense on any link
MARGIN = 0.8  # a delta is chosen only where it is predicted to take at most this share of dense
STEPS = (0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, NETWORK_MAX)  # the crossovers tried above CROSSOVER
CALIBRATE_ELEMENTS = 8 << 20  # bf16 elements of the scratch buffer (16 MiB, past most caches)


def wire_share(f: float, es: int) -> float:
    """The bytes of a sparse encoding at changed fraction ``f`` over the dense bytes, for
    elements of ``es`` bytes: the values plus a one-byte gap each, or plus a bitmask, whichever
    is smaller (gaps under 128 take one byte at the densities where this matters)."""
    return min(f * (es + 1) / es, f + 1 / (8 * es))


class Crossover:
    """The crossover of one publisher, from its measurements (see the module docstring).

    Args:
        fixed: a crossover given by the caller (used as it is), or None to choose one.
        dense_bytes: bytes of a dense version.
        elements: elements of the tensors that can travel as deltas.
        element_size: their usual element size in bytes (2 for bf16).
    """

    def __init__(self, fixed: float | None, dense_bytes: int, elements: int, element_size: int) -> None:
        self.fixed = fixed
        self._bytes = dense_bytes
        self._elements = elements
        self._es = element_size
        self._push_s: dict[str, float] = {}  # subscriber -> seconds of its last dense push
        self._diff_s: float | None = None
        self.copy_gbps: float | None = None  # measured by calibrate()
        self.scatter_ns: float | None = None  # per changed element, measured by calibrate()

    def pushed_dense(self, sub: str, seconds: float) -> None:
        """A dense version reached ``sub`` in ``seconds`` (its push alone)."""
        if seconds > 0:
            self._push_s[sub] = seconds

    def forget(self, sub: str) -> None:
        self._push_s.pop(sub, None)

    def diffed(self, seconds: float) -> None:
        """A full diff of a version took ``seconds``."""
        if seconds > 0:
            self._diff_s = seconds

    @property
    def calibrated(self) -> bool:
        return self.copy_gbps is not None and self.scatter_ns is not None

    def calibrate(self) -> None:
        """Measures a streaming copy and the checked scatter (check pass and stores) of a 10%
        change on a scratch buffer of ``CALIBRATE_ELEMENTS`` bf16 elements (best of three
        each; about 30 ms). Runs in a background thread. It sees this host idle: subscribers
        that share their cores with each other and the trainer scatter slower (3-4x on the
        2-core VM of the benchmarks)."""
        n = CALIBRATE_ELEMENTS
        base = torch.zeros(n, dtype=torch.int16)
        fresh = base.clone()
        fresh[::10] = 1  # 10% changed, every gap 9: the varint encoding the scatter meets
        dst = torch.empty_like(base)
        dst.fill_(0)
        out = torch.zeros(n * 2, dtype=torch.uint8)
        enc = native.encode(fresh.data_ptr(), base.data_ptr(), 0, n, 2, out.data_ptr(), out.numel())
        copy_s = scatter_s = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            stream_copy(dst.data_ptr(), base.data_ptr(), n * 2)
            t1 = time.perf_counter()
            for write in (False, True):  # a subscriber's checked apply: the check pass, then the stores
                native.scatter(dst.data_ptr() if write else 0, n, 2, out.data_ptr(), enc.payload_bytes,
                               int(enc.kind), enc.changed, enc.pos_bytes, write)
            t2 = time.perf_counter()
            copy_s, scatter_s = min(copy_s, t1 - t0), min(scatter_s, t2 - t1)
        self.copy_gbps = n * 2 / copy_s / 1e9
        self.scatter_ns = scatter_s / max(1, enc.changed) * 1e9

    def value(self, takers: list[str]) -> float:
        """The crossover for a version going to ``takers`` (the subscribers that take deltas)."""
        if self.fixed is not None:
            return self.fixed
        pushes = [self._push_s[s] for s in takers if s in self._push_s]
        if not pushes or self.copy_gbps is None or self.scatter_ns is None:
            return CROSSOVER
        push = min(pushes)
        copy = self._bytes / (self.copy_gbps * 1e9)
        diff = self._diff_s if self._diff_s is not None else 2 * copy
        dense = push + copy
        best = CROSSOVER
        for f in STEPS:
            delta = diff + wire_share(f, self._es) * push + self.scatter_ns * 1e-9 * f * self._elements
            if delta <= MARGIN * dense:
                best = f
        return best
