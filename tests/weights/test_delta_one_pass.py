"""The subscriber's one-pass delta apply: each sparse tensor is checked and stored in one pass
that saves the values it replaces, and every store is undone when any check fails, so a
refused delta leaves the live tensors exactly as they were. Native kernel first (hostile
payloads, random bytes), then whole versions through real Transports."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

from tests.weights.test_delta_sync import HOSTILE, ISAS, guarded, holding_version_1, payload, same_bits
from transport._native import delta as native


def one_pass(live: torch.Tensor, n: int, p: torch.Tensor, kind: int, count: int, pos_bytes: int,
             es: int = 2, isa: native.Isa = native.Isa.AUTO
             ) -> tuple[native.Refusal, int, int, int, torch.Tensor, torch.Tensor]:
    """native.apply of payload ``p`` with a private copy of its positions and an undo buffer
    (bitmask payloads go a vector at a time on AVX512, one position at a time on SCALAR)."""
    values = p.numel() - pos_bytes
    pos = p[values:].clone() if 0 <= values <= p.numel() else torch.zeros(1, dtype=torch.uint8)
    undo = torch.zeros(max(8, count * es), dtype=torch.uint8)
    refusal, old, new, stored = native.apply(live.data_ptr(), n, es, p.data_ptr(), p.numel(), kind, count, pos_bytes,
                                             pos.data_ptr(), undo.data_ptr(), isa)
    return refusal, old, new, stored, pos, undo


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name.lower())
@pytest.mark.parametrize("what,n,kind,count,pos,declared,refusal", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_payloads_are_refused_and_their_stores_undone(what, n, kind, count, pos, declared, refusal, isa):
    mem, live = guarded(n)
    live.copy_(torch.from_numpy(np.random.default_rng(1).integers(0, 256, live.numel(), dtype=np.uint8)))
    before = mem.clone()
    p = payload(count, pos)
    pos_bytes = len(pos) if declared is None else declared
    got, _, _, stored, private, undo = one_pass(live, n, p, int(kind), count, pos_bytes, isa=isa)
    assert got == refusal, what
    assert torch.equal(mem[:4096], before[:4096]) and torch.equal(mem[-4096:], before[-4096:])  # never outside
    native.undo(live.data_ptr(), n, 2, int(kind), private.data_ptr(), pos_bytes, stored, undo.data_ptr())
    assert torch.equal(mem, before), what


FUZZ_N = 1000  # elements of the tensor fuzz_undo applies to


def fuzz_undo(payloads: Callable[[np.random.Generator], tuple[torch.Tensor, int, int, int]], seed: int,
              isa: native.Isa) -> None:
    """Applies 3000 payloads of ``payloads(g)`` (payload, kind, count, pos_bytes) in one pass to
    a tensor of FUZZ_N random 2-byte elements between guard bytes, each undone at once: nothing is
    ever stored outside it, undo restores every byte, and the walks do store before they are
    refused (or pass), so undo is exercised."""
    g = np.random.default_rng(seed)
    n = FUZZ_N
    mem, live = guarded(n)
    live.copy_(torch.from_numpy(g.integers(0, 256, live.numel(), dtype=np.uint8)))
    before = mem.clone()
    stores = 0
    for _ in range(3000):
        p, kind, count, pos_bytes = payloads(g)
        _, _, _, stored, private, undo = one_pass(live, n, p, kind, count, pos_bytes, isa=isa)
        stores += stored
        native.undo(live.data_ptr(), n, 2, kind, private.data_ptr(), pos_bytes, stored, undo.data_ptr())
        assert torch.equal(mem, before)
    assert stores > 1000


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name.lower())
def test_random_payloads_never_store_outside_and_undo_restores_every_byte(isa):
    def payload(g: np.random.Generator) -> tuple[torch.Tensor, int, int, int]:
        count = int(g.integers(1, 300))
        kind = int(g.choice([2, 3]))
        vbytes = (count * 2 + 7) // 8 * 8
        pos_bytes = int(g.integers(0, 300)) if kind == 2 else (FUZZ_N + 7) // 8
        p = torch.from_numpy(g.integers(0, 256, vbytes + pos_bytes, dtype=np.uint8))
        if kind == 2 and g.random() < 0.5:  # mostly small gaps: many walks get far before they fail
            p[vbytes:] &= 0x07
        return p, kind, count, pos_bytes

    fuzz_undo(payload, 7, isa)


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name.lower())
@pytest.mark.parametrize("es", [2, 4])
def test_one_pass_sums_are_the_encoders_and_its_stores_exact(es, isa):
    dtype = torch.bfloat16 if es == 2 else torch.float32
    g = torch.Generator().manual_seed(es)
    n = 300_001
    base = torch.randn(n, generator=g).to(dtype)
    for fraction in (0.002, 0.05, 0.3, 0.9):  # varint, and bitmask where it is the smaller
        fresh = base.clone()
        bits = fresh.view(torch.int16 if es == 2 else torch.int32)
        bits[torch.randperm(n, generator=g)[: int(n * fraction)]] ^= 1
        out = torch.zeros(n * es, dtype=torch.uint8)
        enc = native.encode(fresh.data_ptr(), base.data_ptr(), 0, n, es, out.data_ptr(), out.numel())
        live = base.clone()
        got, old, new, stored, private, undo = one_pass(live, n, out[:enc.payload_bytes], int(enc.kind), enc.changed,
                                                        enc.pos_bytes, es, isa)
        assert (got, old, new, stored) == (native.Refusal.OK, enc.sum_old, enc.sum_new, enc.changed), fraction
        assert torch.equal(live.view(torch.uint8), fresh.view(torch.uint8))
        native.undo(live.data_ptr(), n, es, int(enc.kind), private.data_ptr(), enc.pos_bytes, stored, undo.data_ptr())
        assert torch.equal(live.view(torch.uint8), base.view(torch.uint8))


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name.lower())
def test_the_apply_of_many_payloads_shared_by_threads_applies_each_as_alone(isa):
    # Varint and bitmask payloads of both element sizes, one hostile (a corrupted position) and
    # one that declares more position bytes than it has; two threads claim them from one cursor.
    g = torch.Generator().manual_seed(11)
    rows, want, lives, fresh_of = [], [], [], []
    keep = []
    for j, (n, dtype, fraction) in enumerate([(200_001, torch.bfloat16, 0.01), (100_000, torch.float32, 0.3),
                                              (50_000, torch.bfloat16, 0.4), (70_000, torch.bfloat16, 0.02),
                                              (9, torch.float32, 0.5), (40_000, torch.bfloat16, 0.05)]):
        es = torch.empty(0, dtype=dtype).element_size()
        base = torch.randn(n, generator=g).to(dtype)
        fresh = base.clone()
        bits = fresh.view(torch.int16 if es == 2 else torch.int32)
        bits[torch.randperm(n, generator=g)[: max(1, int(n * fraction))]] ^= 1
        out = torch.zeros(n * es + 64, dtype=torch.uint8)
        enc = native.encode(fresh.data_ptr(), base.data_ptr(), 0, n, es, out.data_ptr(), out.numel())
        assert enc.kind in (native.Kind.VARINT, native.Kind.BITMASK)
        p = out[:enc.payload_bytes].clone()
        pos_bytes = enc.pos_bytes
        if j == 3:  # its last varint points past the tensor: refused after stores, undone below
            p[-3:] = torch.tensor([0xFF, 0xFF, 0x7F], dtype=torch.uint8)
        if j == 5:
            pos_bytes = p.numel() + 8
        alone = base.clone()
        ref = one_pass(alone, n, p, int(enc.kind), enc.changed, pos_bytes, es, isa)[:4]
        live = base.clone()
        scratch = torch.zeros(max(8, pos_bytes) + enc.changed * es + 16, dtype=torch.uint8)
        keep += [p, scratch]
        rows.append((live.data_ptr(), n, es, p.data_ptr(), p.numel(), int(enc.kind), enc.changed, pos_bytes,
                     scratch.data_ptr(), scratch.data_ptr() + (max(8, pos_bytes) + 7) // 8 * 8))
        want.append((ref, alone))
        lives.append(live)
        fresh_of.append((fresh, base))
    table = np.array(rows, dtype=np.uint64)
    results = np.zeros((len(rows), native.APPLY_RESULT), dtype=np.uint64)
    cursor = np.zeros(1, dtype=np.uint64)
    claimed: list[int] = []

    def thread() -> None:
        taken = np.zeros(len(rows), dtype=np.uint64)
        k = native.apply_many(table, results, cursor, taken, isa)
        claimed.extend(taken[:k].tolist())

    helper = threading.Thread(target=thread)
    helper.start()
    thread()
    helper.join()
    assert sorted(claimed) == list(range(len(rows)))  # each once
    for j, ((ref, alone), live, (fresh, _)) in enumerate(zip(want, lives, fresh_of, strict=True)):
        got = tuple(int(x) for x in results[j])
        assert got == tuple(int(x) for x in ref), j
        assert torch.equal(live.view(torch.uint8), alone.view(torch.uint8)), j  # stored as alone
        if j not in (3, 5):
            assert got[0] == native.Refusal.OK and torch.equal(live.view(torch.uint8), fresh.view(torch.uint8)), j
    assert native.Refusal(results[3][0]) != native.Refusal.OK and results[3][3] > 0  # stored some, then refused
    assert native.Refusal(results[5][0]) == native.Refusal.BAD_SIZE and results[5][3] == 0
    assert torch.equal(lives[5].view(torch.uint8), fresh_of[5][1].view(torch.uint8))  # nothing read or stored
    r3 = rows[3]
    native.undo(r3[0], r3[1], r3[2], r3[5], r3[8], r3[7], int(results[3][3]), r3[9])
    assert torch.equal(lives[3].view(torch.uint8), fresh_of[3][1].view(torch.uint8))  # undone from the private copy
    for name, bad in (("rows", (table[:, :9].copy(), results, cursor)), ("results", (table, results[:, :3].copy(),
                                                                                       cursor)),
                      ("cursor", (table, results, cursor.astype(np.int64)))):
        with pytest.raises(ValueError, match=name):
            native.apply_many(*bad, np.zeros(len(rows), dtype=np.uint64), isa)


@pytest.mark.parametrize("scratch", ["one pass", "checked first"])
async def test_a_delta_refused_by_its_last_tensor_leaves_every_tensor_as_it_was(scratch):
    """Both tensors change; a peer scribbles over one value of the second tensor's payload. The
    first was already stored by then (one pass) or not yet (past the scratch: checked first);
    either way the refused delta leaves both exactly on the previous version."""
    g = torch.Generator().manual_seed(4)
    src = {"a": torch.randn(512, 64, generator=g).to(torch.bfloat16),
           "b": torch.randn(256, 64, generator=g).to(torch.bfloat16)}
    async with holding_version_1(src) as (pub, sub, dst):
        held = {k: v.clone() for k, v in dst.items()}
        if scratch == "checked first":
            sub._delta._scratch.max_bytes = 0
        for k in src:
            src[k].view(-1)[::40] += 1
        r = await pub.publish(2)
        assert r.results["gen"].delta and r.delta.kinds.get("varint", 0) + r.delta.kinds.get("bitmask", 0) == 2
        e = next(x for x in pub.layout.entries if x.name == "b")
        slot = sub._slots[sub._front()[1]]
        slot[e.offset + 5] ^= 0x40  # a value of b's payload
        assert sub.apply() is None and sub.version == 1 and sub.refused_deltas == 1
        assert same_bits(dst, held)
        assert await sub.pull() == 2 and same_bits(dst, src)
        src["a"].view(-1)[::30] -= 1  # and the next delta applies on what pull() brought
        await pub.publish(3)
        assert await sub.wait_version(3) == 3 and same_bits(dst, src)
