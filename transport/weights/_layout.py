"""The packed layout of a weight-sync stream: which tensor lives at which byte of a version.

The publisher builds it from its state dict (after renaming, filtering and conversion) and
publishes it as a read-only region; subscribers fetch it and size their buffers from it. Every
entry is 64-byte aligned; entries are grouped into buckets (contiguous byte ranges) so one
transfer carries many tensors.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import LayoutError, TransportError
from .._tensors import dtype_from_name, dtype_name
from .._wire import WireError, loads_bounded

LAYOUT_FORMAT = "transport.weights.layout"
LAYOUT_VERSION = 1
MAX_LAYOUT_BYTES = 256 << 20  # a layout read from a peer is refused beyond this (~2M tensors)
ALIGN = 64
DIRECT_MIN = 1 << 20  # tensors this large travel in buckets of their own


class LayoutMismatchError(LayoutError):
    """Publisher and subscriber disagree about the weights (names, shapes, conversions).

    A ``LayoutError``: the subscriber's tensors are a layout the publisher's stream cannot
    serve, so ``except LayoutError`` catches every "these tensors do not fit" refusal.

    Attributes:
        not_received: wire names the publisher sends that no local tensor receives.
        not_sent: local tensor names the publisher's layout does not send.
    """

    def __init__(self, message: str, *, not_received: Iterable[str] = (), not_sent: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.not_received = tuple(not_received)
        self.not_sent = tuple(not_sent)


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
        """Parses and validates bytes made by :meth:`encode`.

        Raises:
            WireError: not a layout of this format and version, or an entry lies outside it.
        """
        doc = loads_bounded(data, max_bytes=MAX_LAYOUT_BYTES, max_depth=6, what="weights layout")
        try:
            if not isinstance(doc, dict) or doc.get("format") != LAYOUT_FORMAT or doc.get("v") != LAYOUT_VERSION:
                raise WireError(f"not a version-{LAYOUT_VERSION} weights layout")
            entries = tuple(
                Entry(str(n), tuple(int(x) for x in shape), str(sd), str(wd), int(off), int(nb), int(so))
                for n, shape, sd, wd, off, nb, so in doc["entries"]
            )
            buckets = tuple((int(a), int(b)) for a, b in doc["buckets"])
            layout = Layout(str(doc["name"]), entries, buckets, int(doc["total"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise WireError(f"malformed weights layout: {exc}") from exc
        for e in layout.entries:
            try:
                dtype_from_name(e.wire_dtype)
            except ValueError as exc:
                raise WireError(f"weights layout entry {e.name!r}: {exc}") from exc
            if e.offset < 0 or e.offset + e.nbytes > layout.total:
                raise WireError(f"layout entry {e.name!r} lies outside the {layout.total}-byte version")
        return layout


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
