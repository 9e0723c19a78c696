"""The weights surface: every sync class as ``async with`` / ``aclose()`` against real
Transports, and the two helpers every wait on a peer's control words goes through (the poll
loop with its backoff and deadline, and the seqlock read)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import pytest
import torch

import transport
from transport.plan import (
    GeneratorRank,
    LocalTensor,
    MeshSharding,
    Piece,
    Shard,
    TensorSpec,
    TrainerLayout,
    full_box,
)
from transport.weights import MeshPublisher, MeshSubscriber, Publisher, Subscriber, SyncStatus
from transport.weights._polling import LONGEST_WAIT_S, PENDING, Pending, even, poll, seqlock_read


@pytest.fixture
def store() -> str:
    return f"memory://{uuid.uuid4().hex}"


def _mine(t: transport.Transport, prefix: str) -> set[str]:
    return {k for k in t.regions if k.startswith(prefix)}


# -- async with / aclose on all four classes ------------------------------------------------


async def test_publisher_and_subscriber_as_async_with(store):
    src = {"w": torch.arange(12, dtype=torch.float32), "b": torch.ones(3)}
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    async with transport.Transport("pub", store=store) as tp, transport.Transport("sub", store=store) as ts:
        async with Publisher(tp, src) as pub, Subscriber(ts, dst, publisher="pub") as sub:
            assert _mine(tp, "wsync.") and _mine(ts, "wsync.")
            report = await pub.publish(1)
            assert report.done == ["sub"]
            assert await sub.wait_version(1, timeout=10) == 1
            assert all(torch.equal(dst[k], src[k]) for k in src)
        assert not _mine(tp, "wsync.") and not _mine(ts, "wsync.")  # both withdrew their regions
        await pub.aclose()  # idempotent
        await sub.aclose()


def _one_rank_mesh() -> tuple[TrainerLayout, GeneratorRank]:
    """One trainer rank holding ``w`` whole (a 1-rank shard), one generator rank needing it."""
    shape = (8, 6)
    layout = TrainerLayout.of([TensorSpec("w", shape, "float32", MeshSharding((1,), (Shard(0),), (0,)))])
    rank = GeneratorRank.of([LocalTensor("w", shape, "float32", (Piece("w", full_box(shape), full_box(shape)),))])
    return layout, rank


async def test_mesh_publisher_and_subscriber_as_async_with(store):
    layout, need = _one_rank_mesh()
    w = torch.arange(48, dtype=torch.float32).view(8, 6)
    async with transport.Transport("t0", store=store) as tt, transport.Transport("g0", store=store) as tg:
        async with MeshPublisher(tt, "m", {"w": w}, layout, rank=0) as pub, \
                MeshSubscriber(tg, "m", replica="A", rank=0, size=1, layout=need, timeout=10) as sub:
            report = await pub.publish(0)
            assert report.results["A/0"].status is SyncStatus.DONE, report
            assert await sub.commit() == 0
            assert sub.apply() == 0 and torch.equal(sub.tensors["w"], w)
        assert not _mine(tt, "mesh.") and not _mine(tg, "mesh.")  # both withdrew their regions
        await pub.aclose()  # idempotent, and close() is still there
        pub.close()
        await sub.aclose()
        sub.close()
        with pytest.raises(transport.ClosedError):
            await pub.publish(1)


async def test_mesh_classes_close_and_aclose_alike(store):
    layout, need = _one_rank_mesh()
    async with transport.Transport("t0", store=store) as tt, transport.Transport("g0", store=store) as tg:
        pub = MeshPublisher(tt, "m", {"w": torch.zeros(8, 6)}, layout, rank=0)
        sub = MeshSubscriber(tg, "m", replica="A", rank=0, size=1, layout=need)
        await pub.start()
        await sub.start()
        assert _mine(tt, "mesh.") and _mine(tg, "mesh.")
        pub.close()  # the synchronous spelling
        await sub.aclose()
        assert not _mine(tt, "mesh.") and not _mine(tg, "mesh.")


# -- poll -----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _word_pair(store: str) -> AsyncIterator[tuple[transport.Transport, torch.Tensor]]:
    """A reader Transport, and the ``int64[4]`` region ``w`` (zeroed) of a writer Transport
    that it reads one-sidedly (the writer changes it in place, as a peer's control words)."""
    async with transport.Transport("writer", store=store) as writer, \
            transport.Transport("reader", store=store) as reader:
        word = writer.empty("w", 4, torch.int64)
        await reader.peer("writer", regions=["w"], timeout=10)
        yield reader, word


async def test_poll_times_out_with_the_typed_error_naming_what_it_waited_for(store):
    async with _word_pair(store) as (reader, _):
        looks = 0
        buf = torch.zeros(4, dtype=torch.int64)

        async def look() -> int | Pending:
            nonlocal looks
            looks += 1
            await reader.get(buf, "writer", key="w")
            return int(buf[0]) if int(buf[0]) == 1 else PENDING

        t0 = time.monotonic()
        with pytest.raises(transport.TransferTimeoutError) as info:
            await poll(look, timeout=0.3, what="writer: word 0 not 1", why=lambda: f"it says {int(buf[0])}")
        elapsed = time.monotonic() - t0
        assert str(info.value) == "writer: word 0 not 1 within 0.3s: it says 0"
        assert isinstance(info.value, TimeoutError)
        assert 0.3 <= elapsed < 3.0
        # Backed off: a fixed 2 ms poll would look ~150 times in 0.3 s; waits that double up to
        # LONGEST_WAIT_S look at most 0.3 / LONGEST_WAIT_S + a few times.
        assert 3 <= looks <= 0.3 / LONGEST_WAIT_S + 6, looks


async def test_poll_returns_as_soon_as_the_word_is_ready(store):
    async with _word_pair(store) as (reader, word):
        buf = torch.zeros(4, dtype=torch.int64)
        looks = 0

        async def look() -> int | Pending:
            nonlocal looks
            looks += 1
            await reader.get(buf, "writer", key="w")
            return int(buf[1]) if int(buf[0]) == 1 else PENDING

        word[1], word[0] = 42, 1  # ready before the first look: one look, no wait
        t0 = time.monotonic()
        assert await poll(look, timeout=10, what="ready") == 42
        assert looks == 1 and time.monotonic() - t0 < 1.0

        word[0], looks = 0, 0
        set_at: list[float] = []

        async def ready_later() -> None:
            await anyio.sleep(0.2)
            word[1], word[0] = 7, 1
            set_at.append(time.monotonic())

        async with anyio.create_task_group() as tg:
            tg.start_soon(ready_later)
            assert await poll(look, timeout=10, what="ready") == 7
        # Seen within one capped wait (plus a look) of being set, not at the 10 s timeout.
        assert time.monotonic() - set_at[0] < LONGEST_WAIT_S + 0.5 and looks > 1


async def test_poll_passes_a_probe_error_through_unchanged(store):
    async with _word_pair(store) as (reader, _):
        async def look() -> int | Pending:
            await reader.get(torch.zeros(1, dtype=torch.int64), "writer", key="no-such-region")
            return PENDING

        with pytest.raises(transport.TransportError) as info:
            await poll(look, timeout=5, what="never")
        assert not isinstance(info.value, transport.TransferTimeoutError)


# -- seqlock_read ---------------------------------------------------------------------------


def _seqlock_reads(reader: transport.Transport, after_read: Callable[[int], None] | None = None
                   ) -> tuple[Callable[[], Awaitable[int]], Callable[[], Awaitable[list[int]]], list[int]]:
    """A one-sided stamp (the writer's generation word) and read (its three data words) for
    seqlock_read, and the count of reads made; ``after_read(n)`` runs after the n-th read."""
    gen, data, reads = torch.zeros(1, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), [0]

    async def stamp() -> int:
        await reader.get(gen, "writer", key="w")
        return int(gen[0])

    async def read() -> list[int]:
        reads[0] += 1
        await reader.get(data, "writer", key="w", offset=8)
        if after_read is not None:
            after_read(reads[0])
        return data.tolist()

    return stamp, read, reads


async def test_seqlock_read_keeps_a_stable_copy_and_refuses_one_being_written(store):
    async with _word_pair(store) as (reader, seq):  # seq[0]: generation; seq[1:]: the data
        stamp, read, reads = _seqlock_reads(reader)
        seq[1:] = torch.tensor([1, 2, 3])
        assert await seqlock_read(stamp, read, stable=even) == [1, 2, 3]
        seq[0] = 1  # odd: a write in progress; the data is not even read
        assert await seqlock_read(stamp, read, stable=even) is PENDING and reads == [1]


async def test_seqlock_read_retries_a_torn_read_until_a_consistent_copy(store):
    async with _word_pair(store) as (reader, seq):  # seq[0]: generation; seq[1:]: the data
        seq[1:] = torch.tensor([1, 1, 1])

        def rewrite(n: int) -> None:
            if n == 1:  # the writer rewrites the data right after this read: it is torn
                seq[0] += 1
                seq[1:] = torch.tensor([2, 2, 2])
                seq[0] += 1

        stamp, read, reads = _seqlock_reads(reader, rewrite)
        got = await poll(lambda: seqlock_read(stamp, read, stable=even), timeout=10, what="a consistent copy")
        assert got == [2, 2, 2] and reads == [2]  # the torn copy ([1, 1, 1]) was not kept
