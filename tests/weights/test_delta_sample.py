"""The sample that decides, before any diff, whether a version goes dense: its changed fraction
is each tensor's sampled fraction weighed by the tensor's size (the stream encoder's
``predicts_dense`` and the mesh packer's ``sample``).

Every large tensor is sampled alike (16 runs of 1024 elements), so a count of the sample's own
changes weighs a big tensor that barely changed (an embedding, a few rows touched) as much as a
small one that changed everywhere. On the delta-sync benchmark's model after real AdamW steps
that count read 1.29x the true fraction, and versions a delta would have halved went dense.
"""

from __future__ import annotations

import torch

from transport.weights._codec.encode import DeltaEncoder, sample_runs
from transport.weights._codec.runs import MeshDeltaPacker
from transport.weights._layout import build_layout

BIG, SMALL = 1 << 22, 1 << 16  # elements: sampled in 16 runs of 1024, and sampled whole


def versions(big_changed: float, small_changed: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A base and a new version of a big and a small bf16 tensor, with those fractions of each
    changed (by one step of their bits, at evenly spread positions)."""
    g = torch.Generator().manual_seed(3)
    base = {"big": torch.randn(BIG, generator=g).to(torch.bfloat16),
            "small": torch.randn(SMALL, generator=g).to(torch.bfloat16)}
    new = {k: v.clone() for k, v in base.items()}
    for k, f in (("big", big_changed), ("small", small_changed)):
        bits = new[k].view(torch.int16)
        every = max(1, round(1 / f))
        bits[::every] += 1
    return base, new


def true_fraction(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> float:
    changed = sum(int((new[k].view(torch.int16) != base[k].view(torch.int16)).sum()) for k in new)
    return changed / sum(v.numel() for v in new.values())


def test_sample_runs_cover_a_small_tensor_whole_and_a_big_one_in_runs():
    assert sample_runs(SMALL) == (1, SMALL)
    assert sample_runs(BIG) == (16, 1024)


def test_stream_sample_weighs_each_tensor_by_its_size():
    # 1% of the big tensor and all of the small one: 2.5% in all. The sample's own count
    # (16384 elements of each) would read about 80%: far above any crossover.
    base, new = versions(0.01, 1.0)
    layout = build_layout("m", new, bucket_bytes=1 << 20)
    snap = torch.zeros(layout.total, dtype=torch.uint8)
    for e in layout.entries:
        snap[e.offset : e.offset + e.nbytes].copy_(base[e.name].view(torch.uint8))
    enc = DeltaEncoder(layout, new, 2)
    enc.crossover = 0.2
    dense, changed, elements = enc.predicts_dense(snap)
    assert not dense  # a delta pays: about an eighth of the crossover
    assert elements == BIG + SMALL
    assert abs(changed / elements - true_fraction(base, new)) < 0.002
    # Above the crossover it still says dense: all of the big tensor and none of the small.
    base, new = versions(1.0, 1e-4)
    enc = DeltaEncoder(layout, new, 2)
    enc.crossover = 0.2
    for e in layout.entries:
        snap[e.offset : e.offset + e.nbytes].copy_(base[e.name].view(torch.uint8))
    dense, changed, elements = enc.predicts_dense(snap)
    assert dense and changed / elements > 0.9


def mesh_packer(base: dict[str, torch.Tensor]) -> tuple[MeshDeltaPacker, torch.Tensor]:
    """A mesh packer of ``base``'s tensors (their dtype on the wire) and a snapshot holding them."""
    offsets, at = {}, 0
    for k, v in base.items():
        offsets[k] = (at, v.numel() * v.element_size())
        at += v.numel() * v.element_size()
    packer = MeshDeltaPacker([(k, tuple(v.shape), v.dtype) for k, v in base.items()], offsets, at)
    snap = torch.empty(at, dtype=torch.uint8)
    for k, (off, nbytes) in offsets.items():
        snap[off : off + nbytes].copy_(base[k].view(torch.uint8))
    return packer, snap


def test_mesh_sample_weighs_each_shard_by_its_size():
    base, new = versions(0.01, 1.0)
    packer, snap = mesh_packer(base)
    got = packer.sample(snap, new)
    assert got is not None and abs(got - true_fraction(base, new)) < 0.002
    # The shards cast on the way (fp32 sources of bf16 wire tensors) are weighed alike.
    fp32 = {k: v.float() for k, v in new.items()}
    got = packer.sample(snap, fp32)
    assert got is not None and abs(got - true_fraction(base, new)) < 0.002
    # 4-byte wire elements cast on the way (fp64 sources of fp32 wire tensors): their 2-byte
    # units counted and weighed as the diff counts them, never past the shards' own fraction.
    base32 = {k: v.float() for k, v in base.items()}
    new32 = {k: v.float() for k, v in new.items()}
    packer, snap = mesh_packer(base32)
    units = sum(int((new32[k].view(torch.int16) != base32[k].view(torch.int16)).sum()) for k in new32)
    want = units / (snap.numel() // 2)
    got = packer.sample(snap, {k: v.double() for k, v in new32.items()})
    assert got is not None and abs(got - want) < 0.002, (got, want)
