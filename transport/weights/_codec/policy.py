"""Where a delta stops paying, for both delta forms: per subscriber (a stream's subscriber, a
mesh stream's generator rank), the changed fraction above which a version goes dense to it,
chosen per version from what the publisher measured, down to none: the version goes dense to
it, and where it is none for every subscriber that could take a delta, without being diffed.

A delta of a version at changed fraction f costs the diff (it reads the new and the previous
version), the push of its encodings (about ``w(f)`` of the dense bytes) and the subscriber's
checked scatter (a cost per changed element); the first delta after a dense version also pays
what was not readied after that version (the base's checksums; for the stream also the copy
that lets the new snapshot be patched rather than copied). Dense costs the push of every byte
and, for the stream, the subscriber's copy. Over a link as fast as memory the diff alone costs
about what the bytes saved do, so a delta there rarely pays (``delta_sync-2026-12-04-ipc.md``:
1.05-1.56x of dense at 2-3% changed); over a network the bytes dominate and much denser changes
still pay (``delta_sync-2026-12-03-tcp-10gbit-crossover-0.4.md``: 11-19% changed at
0.58-0.64x of dense over 10 Gbit/s). :class:`Crossover` models both from measurements:

- the last dense push to each subscriber that takes deltas (seconds for its dense bytes: its
  path, including what it shares with the other pushes of a version);
- the last full diff (seconds, at the change it found), else twice a copy of the dense bytes;
- a copy rate, a checksum rate, the diff's cost per changed element and a scatter cost per
  changed element (the slower of the two position forms), measured once on this host on a
  scratch buffer (:meth:`Crossover.calibrate`).

The two forms (:class:`Form`) differ where their costs do. The stream's diff is a pass of its
own, its positions may be a bitmask, and a dense version costs its subscriber a copy out of
the slot. A mesh trainer rank diffs in the pass that packs its snapshot, which a dense version
makes too (only the diff's excess over that copy counts: :meth:`Crossover.packed`), then cuts
the change along each generator rank's runs (:meth:`Crossover.cut`); its positions are varint
gaps of 2-byte units; a generator rank reads its slot whether it came dense or as a delta, so
dense costs the push alone, and each rank's push carries only its own slices (its bytes are
given with its push time). Its first delta into a slot after a dense write pays the
generator's check of the base there (a checksum pass over those bytes).

A delta is chosen only where it is predicted to take at most ``MARGIN`` of dense: the rule is
that a delta stream is never slower than dense. Until a subscriber's path is measured it
answers its form's constant (``CROSSOVER``, ``RUNS_CROSSOVER``); a crossover given to the
publisher is used as it is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..._native import delta as native
from ..._native import stream_copy

# The changed fraction above which a tensor of a stream goes dense (and a version, by its sample,
# without the full diff) until the publisher has measured its subscribers' paths: where
# scattering stops paying against a dense copy when the link runs about as fast as memory
# (benchmarks/results/delta_sync-2026-12-01.md). Over a network, bytes dominate and denser
# changes pay: :class:`Crossover` chooses per version and subscriber unless given one.
CROSSOVER = 0.05
# Mesh sync's, until a generator rank's path is measured (``MeshPublisher``, unless given a
# ``delta_crossover``): the changed fraction of a version's units above which it goes dense.
# Higher than the stream's: its base is the version two back (twice the change), and by default
# its deltas go over networks.
RUNS_CROSSOVER = 0.2

NETWORK_MAX = 0.4  # the highest crossover chosen (a stream's: see Form.most): denser changes go dense on any link
MARGIN = 0.8  # a delta is chosen only where it is predicted to take at most this share of dense
# The crossovers tried, lowest first; the highest that pays is chosen, and none (0.0: dense) when
# not even the lowest does.
STEPS = (0.005, 0.01, 0.02, 0.03, CROSSOVER, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, NETWORK_MAX)
CALIBRATE_ELEMENTS = 8 << 20  # bf16 elements of the scratch buffer (16 MiB, past most caches)
# A measured diff stands this long; after it, versions are judged as before any diff was
# measured (twice a copy), so the next one a delta pays for is diffed and measures it again.
# Without it, one diff measured slow in a busy moment would keep every subscriber dense for
# good: nothing more would be diffed, so nothing would measure it again.
DIFF_STALE_S = 120.0


def wire_share(f: float, es: int, bitmask: bool = True) -> float:
    """The bytes of a sparse encoding at changed fraction ``f`` over the dense bytes, for
    elements of ``es`` bytes: the values plus a one-byte gap each, or plus a bitmask, whichever
    is smaller (gaps under 128 take one byte at the densities where this matters); without
    ``bitmask`` (the mesh form's varint positions), the former."""
    gaps = f * (es + 1) / es
    return min(gaps, f + 1 / (8 * es)) if bitmask else gaps


@dataclass(frozen=True)
class Form:
    """Where a delta form's costs differ, for :class:`Crossover` (see the module docstring).

    Attributes:
        name: "stream" or "runs".
        unmeasured: the crossover before a subscriber's path (or this host) is measured.
        bitmask: its positions may go as a bitmask (else varint gaps only).
        receiver_copies: a dense version costs the subscriber a copy beside the push (a stream
            subscriber copies out of its slot; a mesh generator rank reads its slot either way).
        packs: the diff runs in the packing pass a dense version makes too: only its excess
            over that copy counts against dense.
        most: the highest crossover chosen.
    """

    name: str
    unmeasured: float
    bitmask: bool
    receiver_copies: bool
    packs: bool
    most: float = NETWORK_MAX


STREAM = Form("stream", CROSSOVER, bitmask=True, receiver_copies=True, packs=False)
# A mesh payload must fit its generator rank's delta area, half its slices (SPARSE_MAX): values
# and a varint gap take about 1.5 bytes per changed byte, so no more than a third can change.
RUNS = Form("runs", RUNS_CROSSOVER, bitmask=False, receiver_copies=False, packs=True, most=0.3)


class Crossover:
    """The crossovers of one publisher, from its measurements (see the module docstring).

    Args:
        fixed: a crossover given by the caller (used as it is), or None to choose one.
        dense_bytes: bytes of a dense version (a mesh trainer rank's: its snapshot).
        elements: elements of the tensors that can travel as deltas (mesh: 2-byte units).
        element_size: their usual element size in bytes (2 for bf16, and for units).
        threads: the threads the diff runs on.
        form: the delta form (:data:`STREAM` or :data:`RUNS`).
    """

    def __init__(self, fixed: float | None, dense_bytes: int, elements: int, element_size: int,
                 threads: int = 1, form: Form = STREAM) -> None:
        self.fixed = fixed
        self.form = form
        self._bytes = dense_bytes
        self._elements = elements
        self._es = element_size
        self._threads = max(1, threads)
        # subscriber -> (seconds of its last dense push, its bytes, their elements)
        self._push_s: dict[str, tuple[float, int, float]] = {}
        self._diff_s: float | None = None
        self._diff_f = 0.0  # the changed fraction that diff found
        self._diff_at = 0.0  # when it was measured (time.monotonic())
        self._pack_s: float | None = None  # a dense packing pass (forms that diff while packing)
        self.cut_ns = 0.0  # nanoseconds per changed element of the last cut along a subscriber's runs (runs)
        self._calibrating = threading.Lock()  # one calibration at a time; the second waits for it
        self.copy_gbps: float | None = None  # measured by calibrate()
        self.sum_gbps: float | None = None  # the checksum pass, measured by calibrate()
        self.scatter_ns: float | None = None  # per changed element, measured by calibrate()
        self.emit_ns = 0.0  # what the diff spends per changed element (encoding it), measured by calibrate()

    def pushed_dense(self, sub: str, seconds: float, nbytes: int | None = None) -> None:
        """A dense version reached ``sub`` in ``seconds`` (its push alone); ``nbytes``: the
        bytes that push carried where it is not the whole dense version (a mesh generator rank
        gets its own slices)."""
        if seconds > 0:
            share = 1.0 if nbytes is None else nbytes / max(1, self._bytes)
            self._push_s[sub] = (seconds, self._bytes if nbytes is None else nbytes, share * self._elements)

    def forget(self, sub: str) -> None:
        self._push_s.pop(sub, None)

    def diffed(self, seconds: float, density: float = 0.0) -> None:
        """A full diff of a version took ``seconds`` and found ``density`` of it changed (a
        form that ``packs``: the packing pass that diffed)."""
        if seconds > 0:
            self._diff_s, self._diff_f, self._diff_at = seconds, density, time.monotonic()

    def packed(self, seconds: float) -> None:
        """A dense version's packing pass took ``seconds`` (what a diff while packing is
        compared against)."""
        if seconds > 0:
            self._pack_s = seconds

    def cut(self, seconds: float, changed: int) -> None:
        """A cut of a change of ``changed`` elements along a subscriber's runs took ``seconds``."""
        if seconds > 0 and changed > 0:
            self.cut_ns = seconds / changed * 1e9

    @property
    def calibrated(self) -> bool:
        return self.copy_gbps is not None and self.scatter_ns is not None and self.sum_gbps is not None

    def calibrate(self) -> None:
        """Measures a streaming copy, a checksum pass, the diff of nothing changed against a
        10% change, and the checked scatter (check pass and stores) of a 10% change with varint
        positions and a 25% one with a bitmask, on scratch buffers of ``CALIBRATE_ELEMENTS``
        bf16 elements (best of three each; about 0.15 s on the 2-core VM), once: a call while
        another runs waits for it. Runs
        in a worker or background thread. It sees this host idle: subscribers that share their
        cores with each other and the trainer scatter slower (3-4x on the 2-core VM of the
        benchmarks)."""
        with self._calibrating:
            if self.calibrated:
                return
            n = CALIBRATE_ELEMENTS
            base = torch.zeros(n, dtype=torch.int16)
            fresh = base.clone()
            fresh[::10] = 1  # 10% changed, every gap 9: varint positions
            dense = base.clone()  # 25% changed at random: bitmask positions (each ISA walks them its own way)
            dense[torch.rand(n, generator=torch.Generator().manual_seed(0)) < 0.25] = 1
            dst = torch.empty_like(base)
            dst.fill_(0)
            out = torch.zeros(n * 2, dtype=torch.uint8)
            encs = [native.encode(x.data_ptr(), base.data_ptr(), 0, n, 2, out.data_ptr(), out.numel())
                    for x in (fresh, dense)]
            copy_s = sum_s = diff0_s = diff_s = float("inf")
            scatter_s = [float("inf")] * len(encs)
            for _ in range(3):
                t0 = time.perf_counter()
                stream_copy(dst.data_ptr(), base.data_ptr(), n * 2)
                t1 = time.perf_counter()
                native.checksum(fresh.data_ptr(), n, 2)
                t2 = time.perf_counter()
                native.encode(dst.data_ptr(), base.data_ptr(), 0, n, 2, out.data_ptr(), out.numel())  # nothing changed
                t3 = time.perf_counter()
                native.encode(fresh.data_ptr(), base.data_ptr(), 0, n, 2, out.data_ptr(), out.numel())
                t4 = time.perf_counter()
                copy_s, sum_s = min(copy_s, t1 - t0), min(sum_s, t2 - t1)
                diff0_s, diff_s = min(diff0_s, t3 - t2), min(diff_s, t4 - t3)
            for i, (x, enc) in enumerate(zip((fresh, dense), encs, strict=True)):
                native.encode(x.data_ptr(), base.data_ptr(), 0, n, 2, out.data_ptr(), out.numel())
                for _ in range(3):
                    dst.fill_(0)
                    t0 = time.perf_counter()
                    for write in (False, True):  # a subscriber's checked apply: the check pass, then the stores
                        native.scatter(dst.data_ptr() if write else 0, n, 2, out.data_ptr(), enc.payload_bytes,
                                       int(enc.kind), enc.changed, enc.pos_bytes, write)
                    scatter_s[i] = min(scatter_s[i], time.perf_counter() - t0)
            self.copy_gbps = n * 2 / copy_s / 1e9
            self.sum_gbps = n * 2 / sum_s / 1e9
            self.emit_ns = max(0.0, diff_s - diff0_s) / max(1, encs[0].changed) * 1e9
            # the slower of the two position forms, per changed element
            self.scatter_ns = max(t / max(1, enc.changed) for t, enc in zip(scatter_s, encs, strict=True)) * 1e9

    def diff_s(self, f: float) -> float:
        """The predicted diff of a version at changed fraction ``f``: the last one measured (or
        twice a copy), less what it spent encoding its changes, plus what ``f`` costs."""
        emit = self.emit_ns * 1e-9 * self._elements / self._threads  # seconds per unit of f
        if self._diff_s is None or time.monotonic() - self._diff_at > DIFF_STALE_S:
            assert self.copy_gbps is not None
            return 2 * self._bytes / (self.copy_gbps * 1e9) + emit * f
        return max(self._diff_s - emit * self._diff_f, self._diff_s / 2) + emit * f

    def _diff_cost(self, f: float) -> float:
        """What diffing a version at changed fraction ``f`` costs beyond a dense version: the
        whole diff, or, where the diff is the packing pass (``form.packs``), its excess over
        the dense packing pass (the last measured; before a diff is measured, a copy: the read
        of the base beside the packing) and the cut along the runs."""
        if not self.form.packs:
            return self.diff_s(f)
        assert self.copy_gbps is not None
        copy = self._bytes / (self.copy_gbps * 1e9)
        measured = self._diff_s is not None and time.monotonic() - self._diff_at <= DIFF_STALE_S
        pack = self._pack_s if measured and self._pack_s is not None else copy
        return max(0.0, self.diff_s(f) - pack) + self.cut_ns * 1e-9 * f * self._elements

    def first_s(self, unsummed: int, uncopied: int) -> float:
        """What the first delta after a dense version pays on top of the others: a checksum
        pass over ``unsummed`` bytes of the base and a copy of ``uncopied`` bytes into the new
        snapshot (what the background pass after the dense version did not do). 0.0 while not
        calibrated."""
        if self.copy_gbps is None or self.sum_gbps is None:
            return 0.0
        return unsummed / (self.sum_gbps * 1e9) + uncopied / (self.copy_gbps * 1e9)

    def of(self, sub: str, first_s: float = 0.0) -> float:
        """The crossover for a version going to ``sub`` (a subscriber that takes deltas): the
        highest of ``STEPS`` at which a delta is predicted to take at most ``MARGIN`` of the
        dense version on its path, or 0.0 where none is (it gets the version dense, undiffed);
        ``first_s``: the extra cost of a first delta after a dense version (:meth:`first_s`).
        The given crossover, if any; the form's ``unmeasured`` while its path or this host is
        unmeasured."""
        if self.fixed is not None:
            return self.fixed
        got = self._push_s.get(sub)
        if got is None or self.copy_gbps is None or self.scatter_ns is None:
            return self.form.unmeasured
        push, nbytes, elements = got
        dense = push + (nbytes / (self.copy_gbps * 1e9) if self.form.receiver_copies else 0.0)
        best = 0.0
        for f in (f for f in STEPS if f <= self.form.most):
            delta = (first_s + self._diff_cost(f) + wire_share(f, self._es, self.form.bitmask) * push
                     + self.scatter_ns * 1e-9 * f * elements)
            if delta <= MARGIN * dense:
                best = f
        return best

    def worth_readying(self, sub: str, change: float | None) -> bool:
        """Whether to ready for a delta to ``sub`` after a dense version (the stream publisher's
        background pass, and the subscriber's; a mesh trainer rank's checksum of the slices it
        pushed dense): one may pay on its path (before a first delta's
        own costs, which that readying takes off) or its path is unmeasured; and on a path where
        one pays only below ``CROSSOVER`` (about as fast as memory), only while the changed
        fraction last seen (``change``; None: unknown) is that small too. Readying is work on
        every version, wasted where the versions change more than a delta there can carry."""
        x = self.of(sub)
        return x > 0 and (x >= CROSSOVER or change is None or x >= change)

    def value(self, takers: Iterable[str], first_s: float = 0.0) -> dict[str, float]:
        """:meth:`of` each of ``takers`` (the subscribers that take deltas)."""
        return {sub: self.of(sub, first_s) for sub in takers}
