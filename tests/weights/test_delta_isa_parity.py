"""The encoder's vector paths agree bit for bit: AVX2 and AVX-512 give the same result (kind,
counts, checksum terms), payload (values, varints or bitmask) and snapshot copy, at every density
from nothing changed to nearly all, for both element sizes, at sizes no multiple of a vector, at
capacities that run out mid-tensor, across gaps of every varint length, and for the checksum of a
piece of a tensor. The scalar path agrees wherever its rules are theirs: it never looks at the
running density (where changes crowd the front of a tensor the vector paths alone give up early
and go dense), and it gives the varints up element by element, the vector paths a group of 16 at
a time (which differs only at capacities of a few dozen bytes).

Each result is also checked on its own: its payload scattered into the base gives the fresh
tensor, and the base's checksum less ``sum_old`` plus ``sum_new`` is the fresh one's."""

from __future__ import annotations

import pytest
import torch

from transport._native import delta as native

VECTOR = [isa for isa in (native.Isa.AVX2, native.Isa.AVX512) if native.supports(isa)]
N = 5 * 65_536 + 77  # several density checks and batches, and a tail past the last vector
DTYPES = {2: torch.int16, 4: torch.int32}  # raw bits: every value is a distinct bit pattern

pytestmark = pytest.mark.skipif(len(VECTOR) < 2, reason="this CPU lacks AVX2 or AVX-512")


def encode(fresh: torch.Tensor, base: torch.Tensor, isa: native.Isa, cap: int, skew: int = 0):
    """The result, payload bytes and snapshot bytes of one encode (the snapshot ``skew`` bytes
    off its allocation's alignment)."""
    n, es = fresh.numel(), fresh.element_size()
    out = torch.zeros(max(cap, 1), dtype=torch.uint8)
    snap = torch.zeros(n * es + skew, dtype=torch.uint8)
    r = native.encode(fresh.data_ptr(), base.data_ptr(), snap.data_ptr() + skew, n, es, out.data_ptr(), cap, isa)
    return r, bytes(out[: r.payload_bytes].numpy()), bytes(snap[skew:].numpy())


def check_alone(fresh: torch.Tensor, base: torch.Tensor, r: native.Encoded, payload: bytes, snap: bytes) -> None:
    n, es = fresh.numel(), fresh.element_size()
    assert snap == bytes(fresh.view(torch.uint8).numpy())
    assert r.changed == int((fresh != base).sum())
    mod = 1 << 64
    assert (native.checksum(base.data_ptr(), n, es) - r.sum_old + r.sum_new) % mod == native.checksum(
        fresh.data_ptr(), n, es)
    if r.kind in (native.Kind.VARINT, native.Kind.BITMASK):
        live, p = base.clone(), torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        refusal, _, _ = native.scatter(live.data_ptr(), n, es, p.data_ptr(), len(payload), int(r.kind), r.changed,
                                       r.pos_bytes, True)
        assert refusal == native.Refusal.OK and torch.equal(live, fresh)


def changed(base: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    fresh = base.clone()
    fresh[at] += 1
    return fresh


def caps_around(r: native.Encoded, n: int, es: int) -> list[int]:
    """Capacities at and around where a result stops fitting: its own size, a byte less, the
    bitmask form's, a fraction (values over mid-tensor) and room for the values but barely any
    positions (varints over)."""
    need = r.payload_bytes or n * es
    vbytes = (r.changed * es + 7) // 8 * 8
    mask = vbytes + (n + 7) // 8
    caps = {n * es, need, need - 1, mask, mask - 1, need * 3 // 4, need // 2, need // 5, vbytes + 64, 64}
    return sorted(c for c in caps if c > 0)


@pytest.mark.parametrize("es", [2, 4])
@pytest.mark.parametrize("pattern", ["0", "0.001", "0.02", "0.1", "0.3", "0.9", "front", "bands"])
def test_every_path_encodes_alike_at_every_density_and_capacity(es, pattern):
    g = torch.Generator().manual_seed(7 + es)
    base = torch.randint(-(1 << 15), 1 << 15, (N,), generator=g, dtype=DTYPES[es])
    if pattern == "front":  # 5% changed, all in the first quarter: the density check gives up early
        at = torch.randperm(N // 4, generator=g)[: N // 20]
    elif pattern == "bands":  # sparse, dense, sparse: the AVX2 pass switches how it packs
        third = N // 3
        at = torch.cat([torch.randperm(third, generator=g)[: third // 2000],
                        third + torch.randperm(third, generator=g)[: third // 20],
                        2 * third + torch.randperm(N - 2 * third, generator=g)[: third // 2000]])
    else:
        at = torch.randperm(N, generator=g)[: int(N * float(pattern))]
    fresh = changed(base, at)
    first = encode(fresh, base, native.Isa.AVX512, N * es)
    isas = [*VECTOR, native.Isa.SCALAR] if pattern != "front" else VECTOR
    for cap in caps_around(first[0], N, es):
        got = {isa: encode(fresh, base, isa, cap, skew=es if cap % 2 else 0) for isa in isas}
        want = got[native.Isa.AVX512]
        for isa, res in got.items():
            assert res == want, (isa.name, cap, res[0], want[0])
        check_alone(fresh, base, *want)
    if pattern == "front":  # where the density check fires, with the values fitting the capacity
        assert encode(fresh, base, native.Isa.AVX512, first[0].payload_bytes)[0].kind == native.Kind.DENSE
        assert encode(fresh, base, native.Isa.SCALAR, first[0].payload_bytes)[0].kind == native.Kind.VARINT


@pytest.mark.parametrize("es", [2, 4])
@pytest.mark.parametrize("n", [1, 15, 16, 31, 33, 64, 100, 1_000])
def test_short_tensors_encode_alike(es, n):
    # All in the tail, or one step and a tail: every change pattern of a few lanes.
    g = torch.Generator().manual_seed(n)
    base = torch.randint(-100, 100, (n,), generator=g, dtype=DTYPES[es])
    for k in sorted({0, 1, 2, n // 3, n - 1, n} - {-1}):
        fresh = changed(base, torch.randperm(n, generator=g)[:k])
        for cap in (n * es, 8, 64):
            got = [encode(fresh, base, isa, cap) for isa in (*VECTOR, native.Isa.SCALAR)]
            assert all(res == got[0] for res in got), (k, cap)
            check_alone(fresh, base, *got[0])


@pytest.mark.parametrize("es", [2, 4])
def test_long_gaps_encode_alike(es):
    # Gaps at each varint length's edges, a group of 16 whose first gap is long and one with a
    # long gap in its middle (the vector forms take such groups one by one), runs of adjacent
    # changes, and gaps past 2**21 (four-byte varints).
    gaps = [0, 127, 128, 16_383, 5, 200, 1, 129] * 4
    gaps += [16_384] + [3] * 15 + [2] * 7 + [40_000] + [1] * 8
    gaps += [0, 0, 1, 126, 16_382, 16_383, 16_384, 16_385, 2**21 - 1, 2**21, 2**21 + 7, 5, 0, 0, 300, 3]
    positions, p = [], 3
    for gap in gaps:
        positions.append(p)
        p += gap + 1
    n = p + 29
    base = torch.zeros(n, dtype=DTYPES[es])
    fresh = changed(base, torch.tensor(positions))
    # The changes crowd the front: at the smaller capacities the density check gives up early.
    for cap in (n * es // 2, 1_024, 200):
        got = [encode(fresh, base, isa, cap) for isa in VECTOR]
        assert all(res == got[0] for res in got), cap
        check_alone(fresh, base, *got[0])
    assert got[0][0].kind == native.Kind.DENSE
    varint = encode(fresh, base, native.Isa.SCALAR, n * es // 2)
    assert varint[0].kind == native.Kind.VARINT and encode(fresh, base, native.Isa.AVX2, n * es // 2) == varint


def test_the_varints_run_out_a_group_at_a_time_on_the_vector_paths():
    # Sixteen three-byte gaps, then a one-byte one. The vector paths give the varints up a
    # group of 16 at a time, once less room is left than a group's widest stores need (42
    # bytes); the scalar path element by element (10). One byte short of the vector paths'
    # room for the second group, they go dense where the scalar path fits its varints.
    positions = [20_000 * (j + 1) for j in range(16)] + [20_000 * 16 + 2]
    n = positions[-1] + 1_000
    base = torch.zeros(n, dtype=torch.int16)
    fresh = changed(base, torch.tensor(positions))
    vbytes = 40  # 17 values of 2 bytes, 8-aligned
    cap = vbytes + 16 * 3 + 1
    assert cap == 16 * 3 + 42 - 1
    got = [encode(fresh, base, isa, cap) for isa in VECTOR]
    assert all(res == got[0] for res in got) and got[0][0].kind == native.Kind.DENSE
    scalar = encode(fresh, base, native.Isa.SCALAR, cap)
    assert (scalar[0].kind, scalar[0].payload_bytes) == (native.Kind.VARINT, cap)
    assert encode(fresh, base, native.Isa.AVX2, cap + 1) == encode(fresh, base, native.Isa.SCALAR, cap + 1)


@pytest.mark.parametrize("es", [2, 4])
@pytest.mark.parametrize("first", [0, 1, 12_345, 2**32 - 5, 2**33 + 7])
def test_the_checksum_of_a_piece_is_alike_with_its_copy(es, first):
    # A piece's indices start at first (past 2**32 they wrap in the checksum's 32-bit keys).
    n = 70_001
    t = torch.randint(-(1 << 15), 1 << 15, (n,), generator=torch.Generator().manual_seed(es), dtype=DTYPES[es])
    sums = set()
    for isa in (*VECTOR, native.Isa.SCALAR):
        dst = torch.zeros_like(t)
        sums.add(native.checksum(t.data_ptr(), n, es, first, dst.data_ptr(), isa))
        assert torch.equal(dst, t)
    assert len(sums) == 1
    cut = 33_333
    parts = (native.checksum(t.data_ptr(), cut, es, first, 0, native.Isa.AVX2)
             + native.checksum(t.data_ptr() + es * cut, n - cut, es, first + cut, 0, native.Isa.AVX2))
    assert parts % (1 << 64) == sums.pop()
