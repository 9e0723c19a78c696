"""The checksum passes of delta sync that run in the background after a dense version (on the
publisher, over its new snapshot; on the subscriber, over its live tensors): shared by a
background thread and the copy threads that finish them, exact whoever computes a piece,
and never used once the tensors they read are rewritten; and when the publisher's patches of
its snapshot after a delta version run."""

from __future__ import annotations

import subprocess
import time
import uuid

import numpy as np
import pytest
import torch

import transport
from tests._support import PYTHON, ROOT, python_env
from tests._support.delta_model import land
from transport._background import start_background
from transport._errors import DeltaRefusedError, TransferTimeoutError
from transport.weights import Publisher, Subscriber
from transport.weights._codec.apply import DeltaApplier
from transport.weights._codec.checksum import SumPass
from transport.weights._codec.encode import DeltaEncoder
from transport.weights._copy import PIECE_BYTES
from transport.weights._layout import build_layout
from transport.weights._snapshots import PATCH_AFTER_APPLIES_S


def reference_checksum(t: torch.Tensor) -> int:
    """The checksum as delta.h defines it, in numpy (bf16 bits, indices from 0)."""
    bits = t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)
    i = np.arange(len(bits), dtype=np.uint64).astype(np.uint32)
    y = (bits.astype(np.uint32) ^ (i * np.uint32(0x9E3779B9))) * np.uint32(0x85EBCA6B)
    y = y ^ (y >> np.uint32(15))
    return int(y.astype(np.uint64).sum(dtype=np.uint64))


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # one tensor of several pieces, so a pass is shared piece by piece
    big = PIECE_BYTES // 2 * 3 + 5
    return {"big": torch.randn(big, generator=g).to(torch.bfloat16),
            "small": torch.randn(7, 9, generator=g).to(torch.bfloat16),
            "ids": torch.arange(11, dtype=torch.int64)}  # 8-byte elements: never a delta, no sum


def test_a_pass_shared_with_a_background_thread_sums_exactly():
    s = state(0)
    layout = build_layout("m", s, bucket_bytes=1 << 20)
    expect = [reference_checksum(s["big"]), reference_checksum(s["small"]), None]
    tensors = [s[e.name] for e in layout.entries]
    # finished while the background thread may still hold pieces: those are computed again
    shared = SumPass(tensors, layout.entries, [0] * 3)
    start_background(shared.drain)
    assert shared.finish(2) == expect
    # drained wholly in the background first: finishing computes nothing new, same sums
    alone = SumPass(tensors, layout.entries, [0] * 3)
    start_background(alone.drain).join()
    assert alone.finish(2) == expect
    # and without any background thread
    assert SumPass(tensors, layout.entries, [0] * 3).finish(1) == expect


def test_a_copying_pass_paused_midway_stores_nothing_more_and_finishes_the_copy():
    """The publisher's pass after a dense version also copies its snapshot into the other one,
    which the next publish then writes: once paused, no store of the background lands (the
    piece in flight ended), and finishing copies and sums every piece exactly once."""
    g = torch.Generator().manual_seed(3)
    s = {"big": torch.randn(PIECE_BYTES * 3, generator=g).to(torch.bfloat16),  # 6 pieces
         "small": torch.randn(7, 9, generator=g).to(torch.bfloat16),
         "ids": torch.arange(11, dtype=torch.int64)}
    layout = build_layout("m", s, bucket_bytes=1 << 20)
    src = torch.zeros(layout.total, dtype=torch.uint8)
    for e in layout.entries:
        src[e.offset:e.offset + e.nbytes].copy_(s[e.name].reshape(-1).view(torch.uint8))
    dst = torch.full((layout.total,), 0xAB, dtype=torch.uint8)
    p = SumPass.of_buffer(src, layout.entries, copy_to=dst)
    assert p.copies
    background = start_background(p.drain)
    deadline = time.monotonic() + 10
    while p._next < 2 and time.monotonic() < deadline:  # a piece done, the next one in flight
        pass
    p.pause(10.0)
    taken, done = p._next, sum(x is not None for x in p._parts)
    assert done == taken >= 2  # every piece taken has ended: none in flight
    frozen = dst.clone()
    background.join(10)
    assert not background.is_alive()
    assert torch.equal(dst, frozen)  # nothing landed after pause returned
    assert p.finish(2) == [reference_checksum(s["big"]), reference_checksum(s["small"]), None]
    for e in layout.entries[:2]:
        assert torch.equal(dst[e.offset:e.offset + e.nbytes], src[e.offset:e.offset + e.nbytes]), e.name
    ids = next(e for e in layout.entries if e.name == "ids")
    assert bool((dst[ids.offset:ids.offset + ids.nbytes] == 0xAB).all())  # not deltable: not copied


def delta_between(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], version: int):
    """A real delta ``version`` of ``new`` against ``old`` (base version 0), as a subscriber's
    slot and index would hold it."""
    layout = build_layout("m", new, bucket_bytes=1 << 20)
    snaps = [torch.zeros(layout.total, dtype=torch.uint8) for _ in range(2)]
    enc = DeltaEncoder(layout, old, 2)
    _, sums0 = enc.encode(snaps[0], 0, None, None, None, 0)
    enc.commit(0, 0, sums0)
    enc = DeltaEncoder(layout, new, 2)
    enc.commit(0, 0, sums0)
    enc.reserve()  # the staging buffer readied ahead, as a publisher does after a dense version
    dv, _ = enc.encode(snaps[1], 1, snaps[0], 0, 0, version)
    assert dv.is_delta
    slot = torch.zeros(layout.total, dtype=torch.uint8)
    land(slot, dv.runs)
    return layout, slot, dv.header.clone()


def changed(s: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in s.items()}
    for k in ("big", "small"):
        flat = out[k].view(-1).view(torch.int16)
        idx = torch.randperm(flat.numel(), generator=g)[:max(1, flat.numel() // 200)]
        flat[idx] ^= 1
    return out


def test_a_dense_rewrite_discards_the_pass_over_what_it_replaced():
    first, second = state(1), state(2)
    live = {k: v.clone() for k, v in first.items()}
    layout = build_layout("m", live, bucket_bytes=1 << 20)
    applier = DeltaApplier(layout, [live[e.name] for e in layout.entries], 2)
    applier.dense_applied()  # its pass over `first` begins in the background
    time.sleep(0.2)
    applier.before_dense()  # a dense version rewrites the live tensors
    for k in live:
        live[k].copy_(second[k])
    applier.dense_applied()
    # A delta against what was replaced is refused, with nothing written...
    _, slot, index = delta_between(first, changed(first, 3), 5)
    with pytest.raises(DeltaRefusedError, match="not the base"):
        applier.apply(slot, index, 5)
    assert all(torch.equal(live[k], second[k]) for k in live)
    # ...and one against the live tensors applies bit for bit.
    target = changed(second, 4)
    _, slot, index = delta_between(second, target, 6)
    applier.apply(slot, index, 6)
    assert all(torch.equal(live[k].view(-1).view(torch.uint8), target[k].view(-1).view(torch.uint8)) for k in live)
    applier.close()


EXITS = {
    # torch work still running on a background thread when the script ends: waited for at exit
    "background torch work": """
import torch
from transport._background import start_background
def work():
    for _ in range(20):
        torch.empty(1 << 27, dtype=torch.uint8).fill_(1)
start_background(work)
""",
    # a delta publish, then a normal exit: the background pass after the dense version (and the
    # staging buffer and calibration it goes on to) ends with the publisher
    "after a delta publish": """
import uuid, anyio, torch, transport
from transport.weights import Publisher, Subscriber
async def main():
    store = f"memory://{uuid.uuid4().hex}"
    src = {"a": torch.randn(512, 64).to(torch.bfloat16)}
    async with transport.Transport("trainer", store=store) as tt, transport.Transport("gen", store=store) as tg:
        async with Publisher(tt, src, delta=True) as pub, \\
                Subscriber(tg, {"a": torch.zeros(512, 64, dtype=torch.bfloat16)}, publisher="trainer") as sub:
            await pub.publish(1)
            await sub.wait_version(1)
            src["a"].view(-1)[::50] += 1
            await pub.publish(2)
anyio.run(main)
""",
}


@pytest.mark.parametrize("what", list(EXITS))
def test_the_process_exits_cleanly_with_background_work_running(what):
    """A daemon thread still in native code when the interpreter finalizes aborts the process
    ("terminate called without an active exception", status 134): background work is stopped
    and waited for at close and at exit."""
    r = subprocess.run([PYTHON, "-c", EXITS[what]], cwd=ROOT, env=python_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "terminate called" not in r.stderr, (r.returncode, r.stderr[-2000:])


async def test_a_deltas_patches_wait_for_the_applies_on_this_host_and_never_hold_back_the_next_publish():
    """The publisher's patches of its snapshot (after a delta version) start once the subscriber
    on its host has applied the version: beside its apply they would take the cores and the
    memory bandwidth it needs. A subscriber that does not apply holds them back at most
    ``PATCH_AFTER_APPLIES_S``, and the next publish never waits for that: it starts them."""
    store = f"memory://{uuid.uuid4().hex}"
    src = {"a": torch.randn(1 << 16)}
    async with transport.Transport("trainer", store=store, backends=("tcp",)) as tt, \
            transport.Transport("gen", store=store, backends=("tcp",)) as tg:
        async with Publisher(tt, src, delta=True, delta_crossover=0.3) as pub, \
                Subscriber(tg, live := {"a": torch.zeros(1 << 16)}, publisher="trainer") as sub:
            await pub.publish(1)
            assert await sub.wait_version(1) == 1
            await pub.wait_snapshot()
            src["a"][10:20] += 1
            r2 = await pub.publish(2)
            assert r2.results["gen"].delta  # a delta: its patches are held for the apply
            with pytest.raises(TransferTimeoutError):
                await pub.wait_snapshot(timeout=PATCH_AFTER_APPLIES_S / 4)
            assert await sub.wait_version(2) == 2 and torch.equal(live["a"], src["a"])
            assert await pub.wait_snapshot(timeout=30) == 2  # applied: the patches ran
            # Not applied, and published over at once: the next publish starts the patches
            # rather than waiting for the apply (or for the bound).
            src["a"][30:40] += 1
            r3 = await pub.publish(3)
            src["a"][50:60] += 1
            r4 = await pub.publish(4)
            assert r3.results["gen"].delta and r4.queued_s < PATCH_AFTER_APPLIES_S / 2, r4
            assert await sub.wait_version(4) == 4 and torch.equal(live["a"], src["a"])
            assert await pub.wait_snapshot(timeout=30) == 4


async def test_the_first_delta_after_a_dense_version_published_at_once_leaves_a_whole_snapshot():
    """Published right after a dense version, the first delta finds the background pass over the
    base not begun: it finishes it, and that pass copies the base's tensors into the snapshot the
    delta is written into, after the new version's small tensors were packed there (they share
    a bucket, so they cannot go from the live tensors). The delta patches the deltable ones and
    the pass copies no other: a late joiner pulls the version bit for bit."""
    store = f"memory://{uuid.uuid4().hex}"
    g = torch.Generator().manual_seed(7)
    src = {"big": torch.randn(1 << 20, generator=g).to(torch.bfloat16),  # 2 MB: a bucket of its own
           **{f"norm{i}": torch.randn(256, generator=g).to(torch.bfloat16) for i in range(4)},
           "ids": torch.arange(64, dtype=torch.int64)}  # 8-byte elements: never a delta
    async with transport.Transport("trainer", store=store, backends=("tcp",)) as tt, \
            transport.Transport("gen", store=store, backends=("tcp",)) as tg:
        async with Publisher(tt, src, delta=True, delta_crossover=0.3) as pub, \
                Subscriber(tg, {k: torch.zeros_like(v) for k, v in src.items()}, publisher="trainer") as sub:
            await pub.publish(1)
            assert await sub.wait_version(1) == 1
            for t in src.values():
                t.view(-1)[::97] += 1
            r2 = await pub.publish(2)  # at once: the pass over version 1 has not begun
            assert r2.results["gen"].delta and r2.delta is not None and r2.delta.base == 1, r2
            assert await sub.wait_version(2) == 2
            assert await pub.wait_snapshot(timeout=30) == 2
            async with transport.Transport("late", store=store, backends=("tcp",)) as tl, \
                    Subscriber(tl, late := {k: torch.zeros_like(v) for k, v in src.items()},
                               publisher="trainer") as joiner:
                assert await joiner.pull(timeout=30) == 2
    for k, v in src.items():
        assert torch.equal(late[k].view(torch.uint8), v.view(torch.uint8)), k
