"""Shared by tests/weights/test_delta_sync.py and its subscriber processes (tests/peers/delta_peer.py): a model
whose every version both sides can compute, with sparse, bit-level updates.

Version 1 is random; version v changes ``DENSITY`` of each tensor's elements to new values,
among them sign flips of zeros (``0.0`` -> ``-0.0``, equal as floats, different as bits) and
NaNs whose payload changes (any float comparison would miss both). In a 2-byte tensor two in
three of those changes move the bits by 1 to 3 ulps either way instead, as an optimizer step
moves them (its delta then goes in the steps form, the new values escaped in it). Version 3
rewrites ``ln.weight`` whole, so one tensor of that version goes dense.
"""

from __future__ import annotations

import torch

DENSITY = 0.01
SHAPES = {
    "embed.weight": ((512, 256), torch.bfloat16),
    "layers.0.w": ((256, 256), torch.bfloat16),
    "layers.0.h": ((128, 64), torch.float16),
    "ln.weight": ((1000,), torch.float32),
    "step": ((), torch.int64),
}
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def model_at(version: int) -> dict[str, torch.Tensor]:
    """The weights of ``version`` (1, 2, ...), the same in every process."""
    g = torch.Generator().manual_seed(1234)
    m = {}
    for name, (shape, dtype) in SHAPES.items():
        if dtype == torch.int64:
            m[name] = torch.zeros(shape, dtype=dtype)
            continue
        t = torch.randn(shape, generator=g).to(dtype)
        t.view(-1)[:: 97] = 0.0  # zeros, some of which later become -0.0
        m[name] = t
    for v in range(2, version + 1):
        step(m, v)
    return m


def step(m: dict[str, torch.Tensor], v: int) -> None:
    """Turns version ``v - 1`` of ``m`` into version ``v`` in place."""
    g = torch.Generator().manual_seed(v)
    for name, t in m.items():
        if t.dtype == torch.int64:
            t.fill_(v)
            continue
        flat = t.view(-1)
        if name == "ln.weight" and v == 3:
            flat.copy_(torch.randn(flat.numel(), generator=g).to(t.dtype))
            continue
        k = max(1, int(flat.numel() * DENSITY))
        idx = torch.randperm(flat.numel(), generator=g)[:k]
        bits = flat.view(_BITS[t.dtype])
        near = idx[: 2 * k // 3] if bits.element_size() == 2 else idx[:0]  # an optimizer's steps: a few ulps
        idx = idx[near.numel():]
        flat[idx] = torch.randn(idx.numel(), generator=g).to(t.dtype)
        bits[near] += torch.randint(1, 4, (near.numel(),), generator=g, dtype=bits.dtype) * \
            torch.where(torch.rand(near.numel(), generator=g) < 0.5, -1, 1).to(bits.dtype)
        zeros = torch.arange(0, flat.numel(), 97)
        bits[zeros[v % len(zeros)]] ^= torch.tensor(1 << (bits.element_size() * 8 - 1), dtype=torch.int64).to(
            bits.dtype)  # 0.0 <-> -0.0 (equal as floats)
        nan = torch.tensor(0x7FC0 if bits.element_size() == 2 else 0x7FC00000, dtype=bits.dtype)
        bits[5] = nan | v  # a NaN whose payload changes every version


def zeros() -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in SHAPES.items()}


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-for-bit equality of two state dicts (NaNs and signed zeros included)."""
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a)


def land(slot: torch.Tensor, runs) -> int:
    """Writes a delta version's ``runs`` (``DeltaVersion.runs``, or one part: per source, rows
    (source offset, slot offset, nbytes)) into ``slot`` here, as its pushes write them into a
    subscriber's slot; returns the bytes written."""
    nbytes = 0
    for source, rows in runs:
        for a, b, n in rows.tolist():
            slot[b:b + n].copy_(source.buffer[a:a + n])
            nbytes += n
    return nbytes
