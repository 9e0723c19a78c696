"""The piece schedule (``transport._pieces.run``), on which every path that moves a transfer in
parts runs: here its pieces are real puts between two Transports over ipc and tcp, and a real
prepared transfer through the default runner of a real backend (``transport.testing.faulty``,
which keeps the default ``Backend.prepare_runs``). Counts of pieces started, in flight and
ended are taken around the real moves; nothing waits for time (``fail_after`` only bounds a
hang)."""

from __future__ import annotations

import anyio
import pytest
import torch

import transport
from tests._support import backend_params
from transport import _pieces
from transport.backends import REGISTRY
from transport.backends._base import MANY_INFLIGHT
from transport.testing import Fault, FaultKind, faulty, temporary_backend

BACKENDS = [p for p in backend_params() if p.values[0] in ("ipc", "tcp")]
N, SIZE = 48, 512  # pieces, bytes each: piece i is slot i of region "w"


class Slots:
    """``N`` pieces of ``SIZE`` random nonzero bytes, piece i a real put into slot i of the
    peer's region "w", with what happened to each piece recorded around the put."""

    def __init__(self, a: transport.Transport, region: torch.Tensor) -> None:
        self.a = a
        self.region = region.view(N, SIZE)
        self.src = torch.randint(1, 256, (N, SIZE), dtype=torch.uint8)
        self.started: list[int] = []
        self.ended: list[int] = []
        self.inflight = self.peak = 0

    async def put(self, i: int, offset: int | None = None) -> None:
        """Piece ``i``: put into its slot (or at byte ``offset`` of "w")."""
        await self.a.put(self.src[i], "b", key="w", offset=i * SIZE if offset is None else offset)

    def landed(self) -> set[int]:
        """The pieces whose bytes are in their slot (an untouched slot is zero)."""
        return {i for i in range(N) if torch.equal(self.region[i], self.src[i])}


async def slots(pair) -> Slots:
    a, b = pair
    region = b.empty("w", N * SIZE, torch.uint8)
    await a.peer("b", regions=["w"])
    return Slots(a, region)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_pieces_start_in_order_at_most_k_at_once_and_all_land(pair):
    s, k = await slots(pair), 5
    full = anyio.Event()  # k pieces in flight at once: until then none of them moves

    async def move(i: int) -> None:
        s.started.append(i)
        s.inflight += 1
        s.peak = max(s.peak, s.inflight)
        if s.inflight == k:
            full.set()
        try:
            await full.wait()
            await s.put(i)
        finally:
            s.inflight -= 1

    with anyio.fail_after(60):
        await _pieces.run(list(range(N)), move, k)
    assert s.peak == k  # k reached (the first k wait for each other), never passed
    assert s.started == list(range(N))
    assert s.landed() == set(range(N))


@pytest.mark.parametrize("backend", BACKENDS)
async def test_the_first_error_is_raised_and_no_piece_starts_after_it(pair):
    s, k = await slots(pair), 4
    bad = {20, 21}  # both put past the region's end: the transport refuses them (BoundsError)
    failed = anyio.Event()  # pieces after the bad ones move only once a piece has failed
    errors: list[tuple[int, transport.TransportError]] = []  # in the order the pieces failed
    started_by_then = 0

    async def move(i: int) -> None:
        nonlocal started_by_then
        s.started.append(i)
        try:
            if i > max(bad):
                await failed.wait()
            await s.put(i, offset=N * SIZE if i in bad else None)
        except transport.TransportError as exc:
            if not errors:
                started_by_then = len(s.started)
                failed.set()
            errors.append((i, exc))
            raise
        finally:
            s.ended.append(i)

    with anyio.fail_after(60), pytest.raises(transport.BoundsError) as raised:
        await _pieces.run(list(range(N)), move, k)
    assert raised.value is errors[0][1]  # the first to fail, whichever of the two it was
    assert len(s.started) == started_by_then  # none started once a piece had failed
    assert s.started == list(range(len(s.started))) and len(s.started) <= min(bad) + k  # (k in flight)
    assert sorted(s.ended) == s.started  # those in flight ran to their end
    assert errors[0][0] in bad and s.landed() == set(s.started) - bad


@pytest.mark.parametrize("backend", BACKENDS)
async def test_cancelled_it_returns_only_once_the_pieces_in_flight_have_ended(pair):
    s, k = await slots(pair), 3

    async def move(i: int) -> None:
        s.started.append(i)
        if len(s.started) == k:
            scope.cancel()
        try:
            await anyio.sleep_forever()
        finally:  # a piece that cannot be recalled: its bytes move before it returns
            with anyio.CancelScope(shield=True):
                await s.put(i)
            s.ended.append(i)

    with anyio.fail_after(60):
        with anyio.CancelScope() as scope:
            await _pieces.run(list(range(N)), move, k)
    assert scope.cancelled_caught
    assert s.started == list(range(k)) and sorted(s.ended) == s.started
    assert s.landed() == set(range(k))


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_prepared_transfer_by_the_default_runner_stops_starting_runs_at_its_first_failure(
        backend, memory_store):
    """The default ``prepare_runs`` moves one run per piece, ``MANY_INFLIGHT`` at once: the
    backend's calls are its pieces, numbered in the order they start. Call ``at`` fails: every
    run before it lands (they ran to their end), none from ``at + MANY_INFLIGHT`` on started."""
    runs, at, size = 4 * MANY_INFLIGHT, MANY_INFLIGHT + 8, 64
    cls = faulty(REGISTRY[backend], Fault(FaultKind.FAIL, at_call=at, peer="b"))
    with temporary_backend(cls, replace=True):
        async with transport.Transport("a", store=memory_store, backends=(backend,), timeout=20) as a, \
                transport.Transport("b", store=memory_store, backends=(backend,), timeout=20) as b:
            region = b.empty("w", runs * 2 * size, torch.uint8).view(runs, 2 * size)
            await a.peer("b", regions=["w"])
            src = torch.randint(1, 256, (runs, size), dtype=torch.uint8)
            prepared = a.prepare_put("b", [(src[i], "w", i * 2 * size) for i in range(runs)])
            assert prepared.segments == runs  # gaps on the remote side: one run per item
            with anyio.fail_after(60):
                with pytest.raises(transport.TransportInternalError, match="injected fault"):
                    await prepared.start()
                landed = {i for i in range(runs) if torch.equal(region[i, :size], src[i])}
                assert set(range(at - 1)) <= landed and at - 1 not in landed
                assert max(landed) < at - 1 + MANY_INFLIGHT
                await prepared.start()  # the fault struck once: the same runner moves them all
            assert torch.equal(region[:, :size], src) and not region[:, size:].any()


def test_cut_covers_the_bytes_in_order_within_the_size():
    assert _pieces.cut(0, 8) == []
    assert _pieces.cut(20, 8) == [(0, 8), (8, 8), (16, 4)]
    assert _pieces.cut(16, 8) == [(0, 8), (8, 8)]
    with pytest.raises(ValueError):
        _pieces.cut(16, 0)


async def test_no_piece_in_flight_is_refused():
    with pytest.raises(ValueError):
        await _pieces.run([1], lambda _: anyio.lowlevel.checkpoint(), 0)


def test_a_cuda_piece_without_its_ready_event_is_a_loud_bug():
    """Nothing below the engine records a ready event: a device it has none for raises."""
    event = object()  # (what the engine records is a torch.cuda.Event; the lookup only hands it on)
    assert _pieces.ready_on({0: event}, 0) is event
    with pytest.raises(transport.TransportInternalError, match=r"device 1 .* without the ready event"):
        _pieces.ready_on({0: event}, 1)
    with pytest.raises(transport.TransportInternalError):
        _pieces.ready_on(_pieces.NO_READY, 0)
