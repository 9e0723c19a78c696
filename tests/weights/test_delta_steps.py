"""The steps form of a sparse delta (VARSTEP: 2-byte elements, varint positions): each changed
value as the signed byte ``new - old`` of its bit patterns, or an escape and the value itself.

The encoder writes it only where it is smaller than the values, and alike on every vector path;
the subscriber's one-pass apply and the checked scatter make the fresh tensor of it bit for bit;
and a hostile payload (an escape count that lies, more escape steps than escapes, fewer) is
refused, its stores undone, nothing written outside the tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.weights.test_delta_one_pass import fuzz_undo, one_pass
from tests.weights.test_delta_sync import guarded
from transport._native import delta as native

ISAS = [isa for isa in (native.Isa.SCALAR, native.Isa.AVX2, native.Isa.AVX512) if native.supports(isa)]
N = 3 * 65_536 + 77  # several density checks and batches, and a tail past the last vector
VARSTEP = native.Kind.VARSTEP


def nudged(base: torch.Tensor, fraction: float, big: float, seed: int) -> torch.Tensor:
    """``base`` (int16 bits) with ``fraction`` of its elements changed: by a step of 1 to 3 either
    way, except ``big`` of those, which take a step past a byte (an escape)."""
    g = torch.Generator().manual_seed(seed)
    fresh = base.clone()
    at = torch.randperm(base.numel(), generator=g)[: int(base.numel() * fraction)]
    step = torch.randint(1, 4, (at.numel(),), generator=g, dtype=torch.int16)
    step *= torch.where(torch.rand(at.numel(), generator=g) < 0.5, -1, 1).to(torch.int16)
    far = torch.rand(at.numel(), generator=g) < big
    step[far] = torch.randint(128, 30_000, (int(far.sum()),), generator=g, dtype=torch.int16)
    fresh[at] += step
    return fresh


def encode(fresh: torch.Tensor, base: torch.Tensor, isa: native.Isa, cap: int, steps: bool = True):
    n = fresh.numel()
    out = torch.zeros(max(cap, 1), dtype=torch.uint8)
    r = native.encode(fresh.data_ptr(), base.data_ptr(), 0, n, 2, out.data_ptr(), cap, isa, steps)
    return r, out[: r.payload_bytes].clone()


def escapes(payload: torch.Tensor) -> int:
    return int(payload[:8].view(torch.int64))


@pytest.mark.parametrize("fraction,big", [(0.0005, 0.0), (0.02, 0.0), (0.02, 0.01), (0.08, 0.3), (0.02, 1.0)])
def test_every_path_writes_the_steps_alike_and_only_where_smaller(fraction, big):
    base = torch.randint(-(1 << 15), 1 << 15, (N,), generator=torch.Generator().manual_seed(3), dtype=torch.int16)
    fresh = nudged(base, fraction, big, seed=int(fraction * 1e4) + int(big * 100))
    values, _ = encode(fresh, base, native.Isa.SCALAR, N, steps=False)
    assert values.kind == native.Kind.VARINT
    got = {isa: encode(fresh, base, isa, N) for isa in ISAS}
    r, p = got[native.Isa.SCALAR]
    for isa, (ri, pi) in got.items():
        assert ri == r and torch.equal(pi, p), isa.name
    if big < 0.5:  # the steps form: a byte a change (and an escape's two), the same positions
        assert r.kind == VARSTEP and r.pos_bytes == values.pos_bytes
        d = fresh - base  # (int16: mod 2**16, as the steps are)
        assert escapes(p) == int(((d > 127) | (d < -127)).sum())
        assert r.payload_bytes < values.payload_bytes
        assert (r.changed, r.sum_old, r.sum_new) == (values.changed, values.sum_old, values.sum_new)
    else:  # every change escaped: the values are the smaller form
        assert (r.kind, r.payload_bytes) == (native.Kind.VARINT, values.payload_bytes)


@pytest.mark.parametrize("fraction,big", [(0.15, 0.0), (0.25, 0.02), (0.15, 0.6)])
def test_past_the_bitmask_size_the_steps_form_still_wins_where_smaller(fraction, big):
    # Varint gaps take a byte a change: past 1/8 changed they outgrow a bitmask, yet with steps
    # (a byte a change against a value's two) they stay the smaller payload while few escape.
    # The varints go on past the bitmask's size then, and the steps form is compared with
    # values under a bitmask too; where most escape, the values with a bitmask stay.
    base = torch.randint(-(1 << 15), 1 << 15, (N,), generator=torch.Generator().manual_seed(4), dtype=torch.int16)
    fresh = nudged(base, fraction, big, seed=int(fraction * 100) + int(big * 100))
    values, _ = encode(fresh, base, native.Isa.SCALAR, N, steps=False)
    assert values.kind == native.Kind.BITMASK and values.pos_bytes == (N + 7) // 8
    got = {isa: encode(fresh, base, isa, N) for isa in ISAS}
    r, p = got[native.Isa.SCALAR]
    for isa, (ri, pi) in got.items():
        assert ri == r and torch.equal(pi, p), isa.name
    if big < 0.5:
        assert r.kind == VARSTEP and r.pos_bytes > values.pos_bytes and r.payload_bytes < values.payload_bytes
        for isa in ISAS:  # and it applies bit for bit
            live = base.clone()
            assert one_pass(live, N, p, int(VARSTEP), r.changed, r.pos_bytes, isa=isa)[0] == native.Refusal.OK
            assert torch.equal(live, fresh), isa.name
    else:
        assert (r.kind, r.payload_bytes) == (native.Kind.BITMASK, values.payload_bytes)


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name.lower())
def test_the_steps_apply_bit_for_bit_in_one_pass_and_in_the_checked_scatter(isa):
    base = torch.randint(-(1 << 15), 1 << 15, (N,), generator=torch.Generator().manual_seed(5), dtype=torch.int16)
    base[:64] = torch.tensor([32_767, -32_768, 0, -1] * 16, dtype=torch.int16)  # steps that wrap mod 2**16
    fresh = nudged(base, 0.03, 0.01, seed=9)
    fresh[:64] = base[:64] + torch.tensor([1, -1, -1, 1] * 16, dtype=torch.int16)
    r, p = encode(fresh, base, isa, N)
    assert r.kind == VARSTEP and escapes(p) > 0
    # The checked scatter: the sums over the live values and the values the steps make of them.
    live = base.clone()
    refusal, old, new = native.scatter(live.data_ptr(), N, 2, p.data_ptr(), p.numel(), int(VARSTEP), r.changed,
                                       r.pos_bytes, False)
    assert (refusal, old, new) == (native.Refusal.OK, r.sum_old, r.sum_new) and torch.equal(live, base)
    assert native.scatter(live.data_ptr(), N, 2, p.data_ptr(), p.numel(), int(VARSTEP), r.changed, r.pos_bytes,
                          True)[0] == native.Refusal.OK
    assert torch.equal(live, fresh)
    # Without the live values the steps make nothing: refused, nothing read past the payload.
    assert native.scatter(0, N, 2, p.data_ptr(), p.numel(), int(VARSTEP), r.changed, r.pos_bytes,
                          False)[0] == native.Refusal.BAD_SIZE
    # The one-pass apply, and its undo.
    live = base.clone()
    refusal, old, new, stored, pos, undo = one_pass(live, N, p, int(VARSTEP), r.changed, r.pos_bytes, isa=isa)
    assert (refusal, old, new, stored) == (native.Refusal.OK, r.sum_old, r.sum_new, r.changed)
    assert torch.equal(live, fresh)
    native.undo(live.data_ptr(), N, 2, int(VARSTEP), pos.data_ptr(), r.pos_bytes, stored, undo.data_ptr())
    assert torch.equal(live, base)


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name.lower())
def test_the_diff_of_many_tensors_writes_steps_where_its_rows_ask(isa):
    g = torch.Generator().manual_seed(13)
    n = 70_001
    rows, outs, want = [], [], []
    for j in range(4):  # steps asked for by rows 0 and 2; row 2's changes all escape (values)
        base = torch.randint(-(1 << 15), 1 << 15, (n,), generator=g, dtype=torch.int16)
        fresh = nudged(base, 0.02, 1.0 if j == 2 else 0.0, seed=j)
        out = torch.zeros(n, dtype=torch.uint8)
        rows.append((fresh.data_ptr(), base.data_ptr(), 0, n, 2, out.data_ptr(), n, n, 0, 1, int(j % 2 == 0)))
        outs.append((out, fresh, base))
        want.append(encode(fresh, base, isa, n, steps=j % 2 == 0))
    results = np.zeros((len(rows), native.ENCODE_RESULT), dtype=np.uint64)
    taken = np.zeros(len(rows), dtype=np.uint64)
    assert native.encode_many(np.array(rows, dtype=np.uint64), results, np.zeros(1, dtype=np.uint64), taken, None,
                              isa) == len(rows)
    kinds = []
    for j, ((out, _, _), (r, p)) in enumerate(zip(outs, want, strict=True)):
        got = native.encoded(results[j])
        assert got == r and torch.equal(out[:got.payload_bytes], p), j
        kinds.append(got.kind)
    assert kinds == [VARSTEP, native.Kind.VARINT, native.Kind.VARINT, native.Kind.VARINT]


def steps_payload(steps: list[int], esc: list[int], gaps: list[int], declared: int | None = None) -> tuple[
        torch.Tensor, int]:
    """A VARSTEP payload by hand: (payload, pos_bytes)."""
    pos = bytes(gaps)  # (gaps under 128: one byte each)
    head = np.array([len(esc) if declared is None else declared], dtype=np.uint64).tobytes()
    body = head + bytes(s & 0xFF for s in steps) + np.array(esc, dtype=np.uint16).tobytes()
    body += b"\0" * (-len(body) % 8)
    return torch.frombuffer(bytearray(body + pos), dtype=torch.uint8), len(pos)


HOSTILE = [  # (what, steps, escapes, declared escape count or None, refusal)
    ("more escape steps than escapes", [1, -128, -128], [7], None, native.Refusal.BAD_STEPS),
    ("escapes left unread", [1, 2, -128], [7, 8], None, native.Refusal.COUNT_MISMATCH),
    ("escape count past the changes", [1, 2, 3], [], 4, native.Refusal.BAD_SIZE),
    ("escape count the size does not hold", [-128, -128, 3], [7, 8], 9, native.Refusal.BAD_SIZE),
    ("escape count of 2**63", [1, 2, 3], [], 1 << 63, native.Refusal.BAD_SIZE),
]


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name.lower())
@pytest.mark.parametrize("what,steps,esc,declared,refusal", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_steps_are_refused_and_their_stores_undone(what, steps, esc, declared, refusal, isa):
    n = 100
    mem, live = guarded(n)
    live.copy_(torch.from_numpy(np.random.default_rng(2).integers(0, 256, live.numel(), dtype=np.uint8)))
    before = mem.clone()
    p, pos_bytes = steps_payload(steps, esc, [3, 10, 20], declared)
    for write in (False, True):
        got, _, _ = native.scatter(live.data_ptr(), n, 2, p.data_ptr(), p.numel(), int(VARSTEP), 3, pos_bytes, write)
        assert got == refusal, (what, write)
        live.copy_(before[4096:4096 + 2 * n])  # (a refused write may have stored before the refusal)
    got, _, _, stored, private, undo = one_pass(live, n, p, int(VARSTEP), 3, pos_bytes, isa=isa)
    assert got == refusal, what
    assert torch.equal(mem[:4096], before[:4096]) and torch.equal(mem[-4096:], before[-4096:])  # never outside
    native.undo(live.data_ptr(), n, 2, int(VARSTEP), private.data_ptr(), pos_bytes, stored, undo.data_ptr())
    assert torch.equal(mem, before), what


def test_steps_of_four_byte_elements_are_refused():
    n = 100
    _, live = guarded(n, es=4)
    p, pos_bytes = steps_payload([1, 2, 3], [], [3, 10, 20])
    assert native.scatter(live.data_ptr(), n, 4, p.data_ptr(), p.numel(), int(VARSTEP), 3, pos_bytes,
                          False)[0] == native.Refusal.BAD_KIND
    assert one_pass(live, n, p, int(VARSTEP), 3, pos_bytes, es=4)[0] == native.Refusal.BAD_KIND


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name.lower())
def test_random_steps_payloads_never_store_outside_and_undo_restores_every_byte(isa):
    def payload(g: np.random.Generator) -> tuple[torch.Tensor, int, int, int]:
        count = int(g.integers(1, 200))
        nesc = int(g.integers(0, 4))
        steps = g.integers(-128, 128, count).tolist()
        if g.random() < 0.5:  # mostly escapes as declared: many walks get far before they fail
            steps = [s if s != -128 else 1 for s in steps]
            for j in g.choice(count, min(nesc, count), replace=False):
                steps[int(j)] = -128
        gaps = g.integers(0, 8 if g.random() < 0.5 else 128, count).tolist()
        p, pos_bytes = steps_payload(steps, g.integers(0, 1 << 16, nesc).tolist(), gaps,
                                     None if g.random() < 0.8 else int(g.integers(0, 300)))
        return p, int(VARSTEP), count, pos_bytes

    fuzz_undo(payload, 11, isa)
