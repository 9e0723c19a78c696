"""Mesh delta sync, in one process: the in-place diff, the cut of a change along a generator
rank's runs, and the checked apply into its slot (real native code, real tensors; the
protocol between real processes is in test_mesh_sync.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transport._native import delta as native
from transport.weights import DeltaRefusedError
from transport.weights._codec.format import HEAD_BYTES, area_table, read_table
from transport.weights._codec.runs import Materializer, MeshDeltaPacker, Runs, cut

ISAS = [isa for isa in (native.Isa.SCALAR, native.Isa.AVX2, native.Isa.AVX512) if native.supports(isa)]


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name.lower())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_in_place_diff_records_exactly_the_changed_elements_and_their_old_bits(isa, dtype):
    g = torch.Generator().manual_seed(1)
    n = 10_007  # not a multiple of any vector width
    snap = torch.randn(n, generator=g).to(dtype)
    fresh = snap.clone()
    where = torch.rand(n, generator=g) < 0.03
    where[-1] = True  # the scalar tail too
    fresh[where] = torch.randn(int(where.sum()), generator=g).to(dtype)
    fresh.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)[5] ^= 1  # a one-bit change
    before = snap.clone()
    es = snap.element_size()
    changed = torch.nonzero(fresh.view(torch.uint8).view(-1, es).ne(before.view(torch.uint8).view(-1, es)).any(1))
    positions = torch.zeros(n, dtype=torch.int64)
    old = torch.zeros(n, dtype=dtype)
    count = native.diff_in_place(fresh.data_ptr(), snap.data_ptr(), n, es, 128, positions.data_ptr(),
                                 old.data_ptr(), n, isa)
    assert count == len(changed)
    assert torch.equal(snap.view(torch.uint8), fresh.view(torch.uint8))  # the snapshot is the new version
    assert torch.equal(positions[:count], 128 + changed.view(-1) * es)
    assert torch.equal(old[:count].view(torch.uint8), before[changed.view(-1)].view(torch.uint8))
    # Past the cap only the count goes on (and nothing is written past it).
    positions.fill_(-7)
    snap.copy_(before)
    assert native.diff_in_place(fresh.data_ptr(), snap.data_ptr(), n, es, 0, positions.data_ptr(), old.data_ptr(),
                                10, isa) == count
    assert bool((positions[10:] == -7).all())


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name.lower())
def test_the_fp32_diff_casts_as_torch_does_and_records_the_changes(isa):
    g = torch.Generator().manual_seed(2)
    n = 20_011
    base32 = torch.randn(n, generator=g) * 3
    bits = base32.view(torch.int32)
    # Rounding ties both ways, infinities, NaNs of every sign and payload, subnormals, -0.0.
    specials = [0x3F808000, 0x3F818000, 0x7F800000, -0x800000, 0x7F800001, 0x7FC00000, -0x3FFFFF,
                0x7FFFFFFF, 0x00000001, 0x00400000, -0x80000000, 0x7F7FFFFF]
    bits[: len(specials)] = torch.tensor(specials, dtype=torch.int32)
    snap = base32.to(torch.bfloat16)
    fresh = base32.clone()
    where = torch.rand(n, generator=g) < 0.03
    where[-1] = True  # the scalar tail too
    fresh[where] += torch.randn(int(where.sum()), generator=g)
    fresh.view(torch.int32)[len(specials)] ^= 1 << 20  # a change the cast keeps
    fresh.view(torch.int32)[len(specials) + 1] ^= 1  # and one it rounds away
    fresh.view(torch.int32)[3] = -0x7FFFFF  # a NaN for the infinity at 3; its cast is 0x7FC0
    # torch's cast, except NaN: its vector loops give 0xFFFF and its scalar tail 0x7FC0; ours is
    # always 0x7FC0 (c10::BFloat16's rounding), wherever the element lies.
    want = fresh.to(torch.bfloat16)
    want.view(torch.int16)[fresh.isnan()] = 0x7FC0
    snap.view(torch.int16)[snap.isnan()] = 0x7FC0
    before = snap.clone()
    changed = torch.nonzero(want.view(torch.int16).ne(before.view(torch.int16))).view(-1)
    positions = torch.zeros(n, dtype=torch.int64)
    old = torch.zeros(n, dtype=torch.bfloat16)
    count = native.diff_bf16_in_place(fresh.data_ptr(), snap.data_ptr(), n, 64, positions.data_ptr(),
                                      old.data_ptr(), n, isa)
    assert torch.equal(snap.view(torch.int16), want.view(torch.int16))  # the cast, bit for bit
    assert count == len(changed) and torch.equal(positions[:count], 64 + changed * 2)
    assert torch.equal(old[:count].view(torch.int16), before[changed].view(torch.int16))


def _packer_and_snapshot(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    packed = [("w", (64, 32), torch.bfloat16), ("v", (100,), torch.float32)]
    offsets = {"w": (0, 64 * 32 * 2), "v": (4096, 400)}
    snap = torch.zeros(4096 + 448, dtype=torch.uint8)
    live = {"w": torch.randn(64, 32, generator=g).to(torch.bfloat16), "v": torch.randn(100, generator=g)}
    return MeshDeltaPacker(packed, offsets, snap.numel()), snap, live, g


def _generator_slot(snap: torch.Tensor, runs: np.ndarray, slot_bytes: int) -> torch.Tensor:
    slot = torch.zeros(slot_bytes, dtype=torch.uint8)
    for a, b, n in runs:
        slot[b : b + n] = snap[a : a + n]
    return slot


def test_a_change_cut_along_runs_rebuilds_the_generators_slot_bit_for_bit():
    packer, snap, live, _ = _packer_and_snapshot()
    assert packer.pack(snap, live, 0, None) is None  # no base: packed, not diffed
    # The generator rank gets rows 16..47 of w (one run per row, into another order) and v whole.
    row = 32 * 2
    runs = np.array([(r * row, (47 - r) * row, row) for r in range(16, 48)] + [(4096, 32 * row, 400)], np.int64)
    slot = _generator_slot(snap, runs, 32 * row + 400)
    r = Runs.of(runs)
    base_sum = r.checksum(snap)
    assert base_sum == native.checksum_runs(slot.data_ptr(), runs.ctypes.data, len(runs), 1, 1)
    live["w"].view(-1)[::37] += 1
    live["v"][3] = 7.0
    change = packer.pack(snap, live, 1, 0)
    assert change is not None and 0 < change.density < 0.1
    made = cut(change, r, base_sum, cap=4096)
    assert made is not None and made.new_sum == r.checksum(snap)  # O(changed) == the full checksum
    table, nbytes = area_table({3: int(runs[:, 2].sum())})
    area = torch.zeros(nbytes, dtype=torch.uint8)
    off = int(table[0, 1])
    area[off : off + made.payload.numel()] = made.payload
    entries = read_table(torch.from_numpy(table.reshape(-1).copy()).view(torch.uint8), nbytes)
    m = Materializer([slot, slot], [area, area], entries, {3: runs})
    assert m.materialize(1, 0) == 1
    assert torch.equal(slot, _generator_slot(snap, runs, slot.numel()))  # bit for bit the new version's slices
    assert m.materialize(1, 0) == 0  # applied once: its header is cleared


@pytest.mark.parametrize("what", ["wrong base", "scribbled value", "position past the slot", "count too large",
                                  "payload larger than its area"])
def test_a_payload_that_does_not_apply_is_refused_and_nothing_is_written(what):
    packer, snap, live, _ = _packer_and_snapshot(1)
    packer.pack(snap, live, 0, None)
    runs = np.array([(0, 0, 64 * 32 * 2), (4096, 4096, 400)], np.int64)
    slot = _generator_slot(snap, runs, snap.numel())
    r = Runs.of(runs)
    base_sum = r.checksum(snap)
    live["w"].view(-1)[::11] -= 1
    change = packer.pack(snap, live, 1, 0)
    made = cut(change, r, base_sum, cap=4096)
    table, nbytes = area_table({0: int(runs[:, 2].sum())})
    area = torch.zeros(nbytes, dtype=torch.uint8)
    area[: made.payload.numel()] = made.payload
    head = area[:HEAD_BYTES].view(torch.int64)
    if what == "wrong base":
        slot[10] ^= 0xFF  # the slot does not hold version 0 from that trainer rank
    elif what == "scribbled value":
        area[HEAD_BYTES + 2] ^= 1
    elif what == "position past the slot":
        pos_at = HEAD_BYTES + int(head[7]) - int(head[6])
        area[pos_at : pos_at + 4] = torch.tensor([0xFF, 0xFF, 0xFF, 0x7F], dtype=torch.uint8)
    elif what == "count too large":
        head[5] = slot.numel()
    else:
        head[7] = nbytes
    before = slot.clone()
    m = Materializer([slot, slot], [area, area], {0: (0, int(table[0, 2]))}, {0: runs})
    with pytest.raises(DeltaRefusedError):
        m.materialize(1, 0)
    assert torch.equal(slot, before)


def test_a_table_from_a_peer_keeps_only_entries_inside_the_area():
    rows = np.array([(0, 0, 64), (1, 64, 64), (2, 100, 64), (3, 10_000, 64), (4, 128, -64)], np.int64)
    got = read_table(torch.from_numpy(rows.reshape(-1).copy()).view(torch.uint8), 512)
    assert got == {0: (0, 64)}  # 1 overlaps 0, 2 is misaligned, 3 lies past the area, 4 is negative


def test_the_next_delta_builds_on_the_checked_checksum_and_any_other_base_is_read_again():
    packer, snap, live, _ = _packer_and_snapshot(2)
    packer.pack(snap, live, 0, None)
    runs = np.array([(0, 0, 64 * 32 * 2), (4096, 4096, 400)], np.int64)
    slot = _generator_slot(snap, runs, snap.numel())
    r = Runs.of(runs)
    table, nbytes = area_table({0: int(runs[:, 2].sum()) // 2})
    area = torch.zeros(nbytes, dtype=torch.uint8)
    m = Materializer([slot, slot], [area, area], {0: (0, int(table[0, 2]))}, {0: runs})
    sums = [r.checksum(snap)]  # per version
    for version in (1, 2, 3):  # each a delta on the last, all into the same slot here
        live["w"].view(-1)[version::13] += 1
        made = cut(packer.pack(snap, live, version, version - 1), r, sums[-1], cap=int(table[0, 2]))
        area[: made.payload.numel()] = made.payload
        assert m.materialize(version, 0) == 1
        sums.append(made.new_sum)
    assert torch.equal(slot, _generator_slot(snap, runs, slot.numel()))
    assert m.full_checks == 1  # only the first base was read from the slot
    # A delta made on another base than the one this rank made (version 2's, as a trainer whose
    # words said so would) is checked against the bytes in the slot, which are version 3's.
    live["w"].view(-1)[::7] += 1
    change = packer.pack(snap, live, 4, 3)
    change.base = 2
    made = cut(change, r, sums[2], cap=int(table[0, 2]))
    area[: made.payload.numel()] = made.payload
    before = slot.clone()
    with pytest.raises(DeltaRefusedError, match="does not hold version 2"):
        m.materialize(4, 0)
    assert m.full_checks == 2 and torch.equal(slot, before)
