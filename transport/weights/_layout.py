"""The packed layout of a weight-sync stream: which tensor lives at which byte of a version.

The publisher builds it from its state dict (after renaming, filtering and conversion) and
publishes it as a read-only region; subscribers fetch it and size their buffers from it. Every
entry is 64-byte aligned; entries are grouped into buckets (contiguous byte ranges) so one
transfer carries many tensors.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import MalformedLayoutError, TransportError, WireError
from .._tensors import dtype_from_name, dtype_name
from .._wire import loads_bounded

LAYOUT_FORMAT = "transport.weights.layout"
LAYOUT_VERSION = 1
MAX_LAYOUT_BYTES = 256 << 20  # a layout read from a peer is refused beyond this (~2M tensors)
ALIGN = 64
DIRECT_MIN = 1 << 20  # tensors this large travel in buckets of their own


@dataclass(frozen=True)
class Entry:
    """One tensor in the packed version."""

    name: str  # wire name (after the publisher's rename)
    shape: tuple[int, ...]
    src_dtype: str  # the publisher's dtype
    wire_dtype: str  # what travels (differs when converted, e.g. float8_e4m3fn)
    offset: int
    nbytes: int
    scale_offset: int = -1  # float32 per-tensor scale for fp8 entries, else -1

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Layout:
    """Where every tensor of one version lies in the packed bytes, and how they are bucketed."""

    name: str
    entries: tuple[Entry, ...]
    buckets: tuple[tuple[int, int], ...]  # [start, end) byte ranges
    total: int

    @property
    def layout_id(self) -> int:
        """A 63-bit fingerprint; publisher and subscriber compare it before any byte moves."""
        digest = hashlib.sha256(self.encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1

    def encode(self) -> bytes:
        """The layout as canonical JSON bytes (what the publisher registers)."""
        doc = {
            "format": LAYOUT_FORMAT,
            "v": LAYOUT_VERSION,
            "name": self.name,
            "total": self.total,
            "buckets": [list(b) for b in self.buckets],
            "entries": [
                [e.name, list(e.shape), e.src_dtype, e.wire_dtype, e.offset, e.nbytes, e.scale_offset]
                for e in self.entries
            ],
        }
        return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()

    @staticmethod
    def decode(data: bytes) -> Layout:
        """Parses bytes made by :meth:`encode` and validates the layout as a whole, before
        anything is sized or copied from it: every entry's ``nbytes`` is its shape times its
        wire dtype's itemsize, entries are aligned, in order and inside ``total``, an fp8
        entry's scale word lies inside the version right after it, buckets are ordered ranges
        inside the version, and ``total`` is where the last entry ends (at most
        ``MAX_VERSION_BYTES``).

        Raises:
            MalformedLayoutError: not a layout of this format and version, or one whose fields
                do not fit together (a ``LayoutMismatchError`` and a ``WireError``).
        """
        try:
            doc = loads_bounded(data, max_bytes=MAX_LAYOUT_BYTES, max_depth=6, what="weights layout")
        except WireError as exc:
            raise MalformedLayoutError(str(exc)) from exc
        try:
            if not isinstance(doc, dict) or doc.get("format") != LAYOUT_FORMAT or doc.get("v") != LAYOUT_VERSION:
                raise MalformedLayoutError(f"not a version-{LAYOUT_VERSION} weights layout")
            entries = tuple(
                Entry(_str(n), tuple(_int(x) for x in _list(shape)), _str(sd), _str(wd), _int(off), _int(nb), _int(so))
                for n, shape, sd, wd, off, nb, so in _list(doc["entries"])
            )
            buckets = tuple((_int(a), _int(b)) for a, b in _list(doc["buckets"]))
            layout = Layout(_str(doc["name"]), entries, buckets, _int(doc["total"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise MalformedLayoutError(f"malformed weights layout: {exc}") from exc
        _check(layout)
        return layout


MAX_VERSION_BYTES = 1 << 46  # 64 TiB: a layout claiming more is refused before anything is allocated
_MAX_DIMS = 64


def _int(x: object) -> int:
    if type(x) is not int:  # bool, float, str: not a size
        raise TypeError(f"{x!r} is not an integer")
    return x


def _str(x: object) -> str:
    if not isinstance(x, str):
        raise TypeError(f"{x!r} is not a string")
    return x


def _list(x: object) -> list[Any]:
    if not isinstance(x, list):
        raise TypeError(f"{type(x).__name__} where a list belongs")
    return x


def _check(layout: Layout) -> None:
    """Raises :class:`MalformedLayoutError` unless every field of ``layout`` fits the others."""
    total = layout.total
    if not 0 <= total <= MAX_VERSION_BYTES:
        raise MalformedLayoutError(f"weights layout of {total} bytes (at most {MAX_VERSION_BYTES})")
    end = 0
    for e in layout.entries:
        where = f"weights layout entry {e.name!r}"
        try:
            wire, src = dtype_from_name(e.wire_dtype), dtype_from_name(e.src_dtype)
        except ValueError as exc:
            raise MalformedLayoutError(f"{where}: {exc}") from exc
        if len(e.shape) > _MAX_DIMS or any(s < 0 for s in e.shape):
            raise MalformedLayoutError(f"{where}: shape {e.shape}")
        if e.nbytes != e.numel * wire.itemsize:
            raise MalformedLayoutError(f"{where}: {e.nbytes} bytes for shape {e.shape} of {e.wire_dtype}")
        if e.offset < end or e.offset % ALIGN:
            raise MalformedLayoutError(f"{where}: offset {e.offset} (aligned to {ALIGN}, from byte {end} on)")
        end = e.offset + _align(e.nbytes)
        if e.scale_offset == -1:
            if wire != src:
                raise MalformedLayoutError(f"{where}: converted to {e.wire_dtype} without a scale")
        elif wire == torch.float8_e4m3fn and src.is_floating_point and e.scale_offset == end:
            end += ALIGN  # the float32 scale word, in its own aligned slot
        else:
            raise MalformedLayoutError(f"{where}: scale at {e.scale_offset} (a {e.wire_dtype} entry's "
                                       f"scale lies at byte {end})")
        if end > total:
            raise MalformedLayoutError(f"{where} lies outside the {total}-byte version")
    if layout.entries and end != total:
        raise MalformedLayoutError(f"weights layout of {total} bytes whose entries end at byte {end}")
    pos = 0
    for a, b in layout.buckets:
        if not pos <= a < b <= total:
            raise MalformedLayoutError(f"weights layout bucket [{a}, {b}) (in order, inside {total} bytes)")
        pos = b


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def build_layout(
    name: str,
    tensors: Mapping[str, torch.Tensor],
    *,
    bucket_bytes: int,
    fp8: Callable[[str, torch.Tensor], bool] | None = None,
) -> Layout:
    """Packs ``tensors`` (wire name -> tensor) in order; ``fp8(name, t)`` says which to send
    as float8 e4m3 with a per-tensor scale.

    Buckets are consecutive byte ranges that cover the version: small tensors share a bucket
    (one transfer carries many), a tensor of ``DIRECT_MIN`` bytes or more has its own buckets
    of at most ``bucket_bytes`` each (no transfer is huge, and none needs packing).

    Raises:
        ValueError: ``bucket_bytes`` is not positive.
    """
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be > 0")
    entries: list[Entry] = []
    pos = 0
    for wire_name, t in tensors.items():
        convert = bool(fp8 and t.dtype.is_floating_point and fp8(wire_name, t))
        wire_dtype = torch.float8_e4m3fn if convert else t.dtype
        nbytes = t.numel() * wire_dtype.itemsize
        scale_offset = pos + _align(nbytes) if convert else -1
        entries.append(
            Entry(wire_name, tuple(t.shape), dtype_name(t.dtype), dtype_name(wire_dtype), pos, nbytes, scale_offset)
        )
        pos += _align(nbytes) + (ALIGN if convert else 0)
    # Tensors of DIRECT_MIN bytes or more get buckets of their own (split into pieces of at most
    # bucket_bytes), so the publisher can put them straight from live memory; smaller ones
    # share buckets of up to bucket_bytes.
    buckets: list[tuple[int, int]] = []
    small_start = 0
    own = min(DIRECT_MIN, bucket_bytes)  # a tensor this large never shares a bucket
    for e in entries:
        if e.nbytes < own:
            if e.offset + e.nbytes - small_start > bucket_bytes and e.offset > small_start:
                buckets.append((small_start, e.offset))
                small_start = e.offset
            continue
        if e.offset > small_start:
            buckets.append((small_start, e.offset))
        end = e.offset + e.nbytes
        buckets.extend((a, min(a + bucket_bytes, end)) for a in range(e.offset, end, bucket_bytes))
        small_start = e.offset + e.nbytes  # the alignment padding goes with the next small bucket
    if pos > small_start:
        buckets.append((small_start, pos))
    return Layout(name, tuple(entries), tuple(buckets), pos)


def describe(layout: Layout) -> dict[str, Any]:
    """A short summary for logs."""
    return {"tensors": len(layout.entries), "buckets": len(layout.buckets), "bytes": layout.total}


def tensors_of(target: torch.nn.Module | Mapping[str, torch.Tensor], *, detach: bool = True) -> dict[str, torch.Tensor]:
    """The name -> tensor map of a module's ``state_dict`` (or of a mapping), in order.

    Args:
        target: an ``nn.Module`` or a name -> tensor mapping.
        detach: return detached views; False keeps the very objects (a subscriber re-points
            them with ``set_``).

    Raises:
        TypeError: a value is not a tensor.
        TransportError: a tensor is on neither the CPU nor a CUDA device.
    """
    items = target.state_dict(keep_vars=True) if isinstance(target, torch.nn.Module) else target
    out = {}
    for k, v in items.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"{k!r} is a {type(v).__name__}, not a tensor")
        if v.device.type not in ("cpu", "cuda"):
            raise TransportError(f"{k!r} is on {v.device}; weight sync serves cpu and cuda tensors")
        out[k] = v.detach() if detach else v
    return out
