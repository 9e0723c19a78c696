"""Prepared transfers from arrays of runs (``prepare_put_runs`` / ``prepare_get_runs``) on every
backend, against a real target process (tests/peers/peer_target.py), plus the target side's checks of
a hostile PUTR / GETR frame (real sockets into a real agent).
"""

from __future__ import annotations

import json
import socket

import anyio
import anyio.to_thread
import numpy as np
import pytest
import torch

import transport
from tests._support import backend_params, serving_target
from transport._wire import FRAME_HEADER, ErrCode, FrameKind, encode_frame
from transport.backends.tcp._frames import TcpFrame

REGION = 1 << 20


def random_runs(rng: np.random.Generator, n: int, item: int, local_bytes: int, remote_bytes: int) -> np.ndarray:
    """``n`` runs of 1..8 items at distinct, non-overlapping remote places (with gaps), read
    from anywhere in the local tensor."""
    size = rng.integers(1, 9, n) * item
    slots = remote_bytes // (16 * item)
    remote = np.sort(rng.choice(slots, n, replace=False)) * 16 * item
    local = rng.integers(0, (local_bytes - 8 * item) // item, n) * item
    return np.stack([local, remote, size], axis=1).astype(np.int64)


def expected(base: np.ndarray, src: np.ndarray, runs: np.ndarray) -> np.ndarray:
    out = base.copy()
    for a, b, n in runs.tolist():
        out[b : b + n] = src[a : a + n]
    return out


def with_ucx_through_its_lists() -> list:
    """Every backend, plus ucx with cross-memory attach left out of ``$UCX_TLS``: its prepared
    runs to a same-host peer then go through UCX's own lists (one put per run), not the
    vectored cma calls."""
    ucx = [p for p in backend_params() if p.values[0] == "ucx"]
    return backend_params() + [pytest.param("ucx:^cma", id="ucx-tls-no-cma", marks=p.marks) for p in ucx]


@pytest.mark.parametrize("backend", with_ucx_through_its_lists())
async def test_runs_land_exactly_and_come_back(backend, targets, file_store, monkeypatch):
    backend, _, tls = backend.partition(":")
    if tls:
        monkeypatch.setenv("UCX_TLS", tls)  # read by this process's UCX context, created below
    rng = np.random.default_rng(7)
    async with transport.Transport("init", store=file_store, backends=(backend,), timeout=30) as t:
        target = await serving_target(t, targets, file_store, backend, [{"key": "w", "numel": REGION // 4,
                                                                        "dtype": "float32"}])
        src = torch.randn(REGION // 4)
        runs = random_runs(rng, 3000, 4, REGION, REGION)
        prepared = t.prepare_put_runs(target.name, src, "w", runs)
        assert prepared.segments == len(runs) and prepared.nbytes == int(runs[:, 2].sum())
        for _ in range(2):  # the plan is reused
            h = prepared.start()
            await h
            assert h.one_sided is (backend != "tcp") and h.backend == backend
            assert h.same_host is (backend == "ipc")  # the link the engine reports (weights reads it)
        back = torch.zeros(REGION // 4)
        await t.get(back, target.name, key="w")
        want = expected(np.zeros(REGION, np.uint8), src.numpy().view(np.uint8), runs)
        assert np.array_equal(back.numpy().view(np.uint8), want)

        # The same runs read back into a fresh tensor, at the local offsets.
        dst = torch.zeros(REGION // 4)
        await t.prepare_get_runs(target.name, dst, "w", runs).start()
        got, ref = dst.numpy().view(np.uint8), src.numpy().view(np.uint8)
        for a, _b, n in runs[:50].tolist():
            assert np.array_equal(got[a : a + n], ref[a : a + n])

        # Small and large runs in one transfer (tcp stages the small ones, moves the large in place).
        mixed = np.array([[0, 0, 4], [4096, 8, 100 << 10], [8192, (100 << 10) + 64, 8], [65536, 512 << 10, 256 << 10]])
        await t.prepare_put_runs(target.name, src, "w", mixed).start()
        await t.get(back, target.name, key="w")
        want = expected(want, src.numpy().view(np.uint8), mixed)
        assert np.array_equal(back.numpy().view(np.uint8), want)
        dst.zero_()
        await t.prepare_get_runs(target.name, dst, "w", mixed).start()
        for a, b, n in mixed.tolist():
            assert np.array_equal(dst.numpy().view(np.uint8)[a : a + n], want[b : b + n])
        single = t.put(src[:16], target.name, key="w")
        await single
        assert single.one_sided is (backend != "tcp") and single.same_host is (backend == "ipc")
        await t.signal(target.name, "done", 1)
        await target.result()


@pytest.mark.parametrize("backend", backend_params())
async def test_one_prepared_transfer_over_several_regions_lands_whole(backend, targets, file_store):
    """Items into three regions of two dtypes, small and large, interleaved: tcp carries several
    regions' runs in one frame (its groups), the others one batch; every byte lands, and comes
    back by the same items as a prepared get."""
    regions = [{"key": "a", "numel": 1 << 16, "dtype": "float32"}, {"key": "b", "numel": 1 << 16, "dtype": "int64"},
               {"key": "c", "numel": 1 << 18, "dtype": "float32"}]
    async with transport.Transport("init", store=file_store, backends=(backend,), timeout=30) as t:
        target = await serving_target(t, targets, file_store, backend, regions)
        fa, ib, fc = torch.randn(1 << 16), torch.randint(0, 1 << 40, (1 << 16,)), torch.randn(1 << 18)
        items = []
        for i in range(0, 512, 2):  # small runs, alternating between regions a and b, with gaps
            items += [(fa[i * 64 : i * 64 + 16], "a", i * 256), (ib[i * 64 : i * 64 + 8], "b", i * 512)]
        items += [(fc[: 1 << 17], "c", 0), (fa[-8:], "a", ((1 << 16) - 8) * 4), (fc[1 << 17 :], "c", 1 << 19)]
        await t.prepare_put(target.name, items).start()
        back = {"a": torch.zeros(1 << 16), "b": torch.zeros(1 << 16, dtype=torch.int64), "c": torch.zeros(1 << 18)}
        for key, dst in back.items():
            await t.get(dst, target.name, key=key)
        for src, key, offset in items:
            got = back[key].view(torch.uint8)[offset : offset + src.nbytes]
            assert torch.equal(got, src.view(torch.uint8)), (key, offset)
        landed = sum(int(src.nbytes) for src, _, _ in items)
        assert sum(int(d.count_nonzero()) * d.element_size() for d in back.values()) <= landed

        copies = [(torch.zeros_like(src), key, offset) for src, key, offset in items]
        await t.prepare_get(target.name, copies).start()
        for (src, _, _), (dst, _, _) in zip(items, copies, strict=True):
            assert torch.equal(src, dst)
        await t.signal(target.name, "done", 1)
        await target.result()


async def test_adjacent_runs_coalesce_and_bad_runs_are_typed_errors_before_any_byte(memory_store):
    async with transport.Transport("a", store=memory_store, backends=("ipc",), timeout=10) as a, \
            transport.Transport("b", store=memory_store, backends=("ipc",), timeout=10) as b:
        region = b.empty("w", 1024, torch.float32)
        b.empty("ro", 64, torch.float32, writable=False)
        await a.peer("b", regions=["w", "ro"])
        src = torch.arange(1024, dtype=torch.float32)
        adjacent = np.array([[0, 0, 64], [64, 64, 64], [128, 128, 64], [512, 1024, 16]])
        p = a.prepare_put_runs("b", src, "w", adjacent)
        assert p.segments == 2 and p.nbytes == 208
        await p.start()
        assert torch.equal(region[:48], src[:48]) and torch.equal(region[256:260], src[128:132])

        region.zero_()
        for runs, err in [
            (np.zeros((2, 2), np.int64), TypeError),
            (np.zeros((1, 3), np.float64), TypeError),
            (np.zeros((0, 3), np.int64), ValueError),
            (np.array([[0, -4, 4]]), transport.BoundsError),
            (np.array([[0, 2, 4]]), transport.BoundsError),  # misaligned for float32
            (np.array([[4096, 0, 4]]), transport.BoundsError),  # beyond the local tensor
            (np.array([[0, 0, 8], [0, 4, 8]]), transport.BoundsError),  # two runs write bytes 4..8
            (np.array([[0, 4096, 4]]), transport.BoundsError),  # beyond the remote region
        ]:
            with pytest.raises(err):
                await a.prepare_put_runs("b", src, "w", runs).start()
        with pytest.raises(transport.RegistrationError):
            a.prepare_put_runs("b", src, "nope", np.array([[0, 0, 4]]))
        with pytest.raises(transport.ReadOnlyRegionError):
            a.prepare_put_runs("b", src, "ro", np.array([[0, 0, 4]]))
        with pytest.raises(transport.DTypeMismatchError):
            a.prepare_put_runs("b", src.to(torch.float64), "w", np.array([[0, 0, 8]]))
        assert not region.any(), "a refused prepared transfer wrote bytes"


async def test_a_one_segment_prepared_put_takes_the_put_path(memory_store):
    """One host segment moves as a put of it would: completed at start() when small."""
    async with transport.Transport("a", store=memory_store, backends=("ipc",), timeout=10) as a, \
            transport.Transport("b", store=memory_store, backends=("ipc",), timeout=10) as b:
        region = b.empty("w", 1024, torch.uint8)
        await a.peer("b", regions=["w"])
        src = torch.full((8,), 9, dtype=torch.uint8)
        prepared = a.prepare_put("b", [(src, "w", 16)])
        await prepared.start()  # learns the route
        h = prepared.start()
        assert h.done(), "a small one-segment prepared put did not complete inline as put() does"
        await h
        assert bool((region[16:24] == 9).all())


def _frame(addr: tuple[str, int], to: str, incarnation: str, frames: list[bytes]) -> list[tuple[FrameKind, bytes]]:
    """Says HELLO, sends ``frames``, returns each reply's kind and metadata."""
    out = []
    with socket.create_connection(addr, timeout=10) as s:
        hello = encode_frame(FrameKind.HELLO, 1, {"from": "raw", "from_incarnation": "0" * 16, "lane": "control",
                                                   "to": to, "to_incarnation": incarnation}, 0)
        for data in [hello, *frames]:
            s.sendall(data)
            _, kind, _, _, _, meta_len, plen = FRAME_HEADER.unpack(s.recv(FRAME_HEADER.size, socket.MSG_WAITALL))
            meta = s.recv(meta_len, socket.MSG_WAITALL) if meta_len else b""
            if plen:
                s.recv(plen, socket.MSG_WAITALL)
            out.append((FrameKind(kind), meta))
    return out[1:]


async def test_hostile_run_tables_are_refused_before_a_byte_lands(memory_store):
    async with transport.Transport("b", store=memory_store, backends=("tcp",), timeout=10) as b:
        region = b.empty("w", 256, torch.int32)
        other = b.empty("x", 16, torch.int32)
        addr, inc = b._agent.address, b.incarnation

        def frame(meta: dict, rows: list[tuple[int, int]], data: bytes, rid: int) -> bytes:
            table = np.array(rows, dtype="<i8").reshape(-1, 2).tobytes()
            return encode_frame(TcpFrame.PUTR, rid, meta, len(table) + len(data)) + table + data

        def putr(rows: list[tuple[int, int]], data: bytes, rid: int, staged: bool = False) -> bytes:
            return frame({"groups": [["w", "int32", len(rows)]], "staged": staged}, rows, data, rid)

        both = {"groups": [["w", "int32", 1], ["x", "int32", 1]], "staged": True}
        good = [putr([(0, 4), (64, 4)], bytes([1] * 8), 10, staged=True), putr([(4, 4)], bytes([1] * 4), 11),
                frame(both, [(128, 4), (60, 4)], bytes([2] * 8), 12)]  # two regions' runs in one frame
        replies = await anyio.to_thread.run_sync(_frame, addr, "b", inc, [
            putr([(-4, 4)], bytes(4), 2),                # negative offset
            putr([(1020, 8)], bytes(8), 3),              # past the end of the region
            putr([(2, 4)], bytes(4), 4),                 # misaligned for int32
            putr([(0, 4), (8, 4)], bytes(4), 5),         # the table wants 8 data bytes, 4 follow
            putr([(0, (1 << 63) - 1)], b"", 6),          # an offset + size that overflows
            putr([(0, 4), (8, 4)], bytes(4), 7, staged=True),  # staged, and short of data
            frame(both, [(200, 4), (64, 4)], bytes(8), 8),  # the second region's run is out of bounds
            frame({"groups": [["w", "int32", 0]]}, [], b"", 20),         # a group without runs
            frame({"groups": []}, [], b"", 21),                          # no group
            frame({"groups": [["w", 5, 1]]}, [(0, 4)], bytes(4), 22),    # a dtype that is not a string
            frame({"groups": "w"}, [(0, 4)], bytes(4), 23),              # groups that are not a list
            frame({"groups": [["w", "int32"]]}, [(0, 4)], bytes(4), 24),  # a group short of a field
            frame({"groups": [["w", "int32", 1]] * 4097}, [(0, 4)], bytes(4), 25),  # too many groups
            frame({"groups": [["w", "int32", 2]]}, [(0, 4)], b"", 26),  # the table is longer than the payload
            *good,
        ])
        kinds = [k for k, _ in replies]
        assert kinds == [FrameKind.ERR] * 14 + [FrameKind.OK] * 3, replies
        codes = [json.loads(meta)["code"] for _, meta in replies[:14]]
        bad = ErrCode.BAD_REQUEST  # the request does not decode as what it claims to be
        assert codes == [ErrCode.BOUNDS] * 3 + [bad, ErrCode.BOUNDS, bad, ErrCode.BOUNDS] + [bad] * 7, replies
        assert region[:2].tolist() == [0x01010101, 0x01010101] and region[16].item() == 0x01010101
        assert region[32].item() == 0x02020202 and other[15].item() == 0x02020202
        assert int(region[2:16].count_nonzero()) == 0 and int(region[17:32].count_nonzero()) == 0
        assert int(region[33:].count_nonzero()) == 0 and int(other[:15].count_nonzero()) == 0


def memfd_rss() -> dict[str, int]:
    """This process's mappings of memfds: address range -> bytes of it in its page tables."""
    out: dict[str, int] = {}
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                current = head[0] if len(head) >= 6 and head[5].startswith("/memfd:") else None
            elif current is not None and head[0] == "Rss:":
                out[current] = int(head[1]) * 1024
    return out


async def test_warm_fills_the_page_tables_of_exactly_the_runs_ahead_of_the_first_start(targets, file_store):
    """``PreparedTransfer.warm`` over ipc into a library buffer maps the peer's memfd and
    fills this process's page tables for the pages the runs touch (every other page here) and
    no others; no byte moves until the start, which then lands exactly. Bad input still gets
    its typed error from warm, before anything."""
    nbytes = 8 << 20
    async with transport.Transport("init", store=file_store, backends=("ipc",), timeout=30) as t:
        target = await serving_target(t, targets, file_store, "ipc", [{"key": "w", "numel": nbytes, "dtype": "uint8",
                                                                      "shared": True}])
        idx = np.arange(1024, dtype=np.int64)
        runs = np.stack([idx * 4096, idx * 8192, np.full(1024, 4096)], axis=1)  # 4 MiB in every other page
        src = torch.full((4 << 20,), 7, dtype=torch.uint8)
        prepared = t.prepare_put_runs(target.name, src, "w", runs)
        before = memfd_rss()
        await prepared.warm()
        fresh = {k: v for k, v in memfd_rss().items() if k not in before}
        [(span, rss)] = [(k, v) for k, v in fresh.items()
                         if int(k.split("-")[1], 16) - int(k.split("-")[0], 16) >= nbytes]
        assert 4 << 20 <= rss < 5 << 20, (span, rss)  # the runs' pages, not the gaps between them
        back = torch.empty(nbytes, dtype=torch.uint8)
        await t.get(back, target.name, key="w")
        assert int(back.count_nonzero()) == 0  # warming moved nothing
        await prepared.warm()  # again: nothing changes
        await prepared.start()
        await t.get(back, target.name, key="w")
        got = back.view(-1, 4096)
        assert bool((got[0::2] == 7).all()) and bool((got[1::2] == 0).all())

        with pytest.raises(transport.RegistrationError):
            await t.prepare_put_runs(target.name, src, "nope", runs).warm()
        with pytest.raises(transport.BoundsError):
            await t.prepare_put_runs(target.name, src, "w", runs + np.array([0, nbytes, 0])).warm()
        await t.signal(target.name, "done", 1)
    with pytest.raises(transport.ClosedError):
        await prepared.warm()
