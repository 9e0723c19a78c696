"""The layouts of libucp's packed rkeys and worker addresses, checked before libucp sees them.

libucp parses both without a length (``ucp_ep_rkey_unpack`` takes a pointer, ``ucp_ep_create``
a worker address) and trusts what it reads: an empty or short rkey makes it read past the
buffer (SIGSEGV), a worker address with an unknown version byte fails an assertion
(SIGABRT). Both come from a peer's record, so they are walked here first, field by field as
libucp 1.x packs them (``src/ucp/core/ucp_rkey.c``: ``ucp_rkey_pack_memh``;
``src/ucp/wireup/address.c``: ``ucp_address_unpack``, address versions 1 and 2), and refused
with :class:`WireError` unless every length stays inside the bytes and the walk ends exactly
at their end. Values libucp uses as indices are range-checked too.

What this cannot check: the transport-specific bytes inside (a UCT rkey, an interface or
device address), which only the UCT component that packed them understands. A peer that
writes well-formed but wrong ones can still make UCX fail its connection (an error status,
which is reported), and UCX's own shared-memory transports may map what such bytes name.
With ``UCX_UNIFIED_MODE=y`` interface lengths are not in the address (libucp takes its own),
so only the address header is checked.
"""

from __future__ import annotations

import os

from .._errors import WireError

_UNKNOWN_SYS_DEV = 0xFF
_FLUSH_BIT = 0x80
_HOST_MEMORY = 0  # UCS_MEMORY_TYPE_HOST: this engine maps host memory only
_DISTANCE_BYTES = 3  # ucp_rkey_packed_distance_t: sys_dev, latency, bandwidth (fp8)
_MAX_MDS = 64  # UCP_MAX_MDS: md indices are bits of a 64-bit map
_MAX_RESOURCES = 128  # UCP_MAX_RESOURCES
_MAX_EP_ADDRS = 64  # UCP_MAX_LANES

# Worker address: header flags, and the flags inside its length bytes.
_V1, _V2 = 0, 1
_HDR_DEBUG_INFO, _HDR_UUID, _HDR_CLIENT_ID, _HDR_AM_ONLY = 1, 2, 4, 8
_NULL_RESOURCE = 0xFF
_FLAG_LAST = 0x80
_FLAG_HAS_EP_ADDR = 0x40
_FLAG_NUM_PATHS = 0x40
_FLAG_SYS_DEVICE = 0x20
_MD_EMPTY_DEV = 0x80
_MD_MASK = 0x7F
_DEVICE_LEN_MASK = 0x1F
_IFACE_LEN_MASK = 0x3F
_IFACE_ATTR_BYTES = {_V1: 16, _V2: 8}  # ucp_address_packed_iface_attr_t / ..._v2_...


class _Reader:
    def __init__(self, data: bytes, what: str) -> None:
        self.data, self.pos, self.what = data, 0, what

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise WireError(f"{self.what}: truncated at byte {self.pos} (needs {n} more of {len(self.data)})")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def byte(self) -> int:
        return self.take(1)[0]

    def peek(self) -> int:
        if self.pos >= len(self.data):
            raise WireError(f"{self.what}: truncated at byte {self.pos}")
        return self.data[self.pos]

    def extended(self, mask: int, version: int) -> int:
        """ucp_address_unpack_byte_extended: the masked value, or the next byte when it is all
        ones (address version 2 only)."""
        value = self.byte() & mask
        if version != _V1 and value == mask:
            value = self.byte()
        return value

    def end(self) -> None:
        if self.pos != len(self.data):
            raise WireError(f"{self.what}: {len(self.data) - self.pos} unexpected bytes after byte {self.pos}")


def check_rkey(packed: bytes, what: str = "ucx rkey") -> None:
    """Raises :class:`WireError` unless ``packed`` is a whole packed rkey of host memory:
    the md map, the memory type, a sized UCT key per md, then (for a non-empty map) the system
    device and, when one is named, its distance list up to its terminator."""
    r = _Reader(bytes(packed), what)
    md_map = int.from_bytes(r.take(8), "little")
    mem_type = r.byte()
    if mem_type != _HOST_MEMORY:
        raise WireError(f"{what}: memory type {mem_type}, not host memory")
    for _md in range(md_map.bit_count()):
        r.take(r.byte())
    if md_map == 0:
        r.end()
        return
    sys_dev = r.byte()
    if sys_dev != _UNKNOWN_SYS_DEV and (sys_dev & ~_FLUSH_BIT) != _UNKNOWN_SYS_DEV:
        # libucp reads distances until the terminator, whatever the length: it must be there.
        while r.peek() != _UNKNOWN_SYS_DEV:
            r.take(_DISTANCE_BYTES)
        r.take(1)
    r.end()


def _unified_mode() -> bool:
    return os.environ.get("UCX_UNIFIED_MODE", "n").strip().lower() in ("y", "yes", "1", "on", "true")


def check_worker_address(address: bytes, what: str = "ucx worker address") -> None:
    """Raises :class:`WireError` unless ``address`` walks as a whole libucp worker address
    (version 1 or 2): header, uuid, client id and name as its flags say, then devices, their
    interfaces and endpoint addresses, each length inside the bytes and the counts within
    libucp's limits, ending exactly at the last byte."""
    r = _Reader(bytes(address), what)
    header = r.byte()
    version = header & 0x0F
    if version not in (_V1, _V2):
        raise WireError(f"{what}: address version {version} (header byte {header:#04x}) is not 1 or 2")
    flags = header >> 4 if version == _V1 else r.byte()
    if flags & ~(_HDR_DEBUG_INFO | _HDR_UUID | _HDR_CLIENT_ID | _HDR_AM_ONLY):
        raise WireError(f"{what}: unknown header flags {flags:#x}")
    if version == _V1 or flags & _HDR_UUID:  # endpoints are created with the worker-uuid flag
        r.take(8)
    if flags & _HDR_CLIENT_ID:
        r.take(8)
    if flags & _HDR_DEBUG_INFO:  # the worker name: a length byte and the name
        r.take(r.byte())
    if r.peek() == _NULL_RESOURCE:  # an empty address list
        r.take(1)
        r.end()
        return
    if _unified_mode():
        return  # lengths are then the local interfaces': only the header can be checked here
    attr_bytes = _IFACE_ATTR_BYTES[version]
    addresses = 0
    while True:
        md_byte = r.peek()
        md_index = r.extended(_MD_MASK, version)
        empty_dev = bool(md_byte & _MD_EMPTY_DEV)
        dev_byte = r.peek()
        last_dev = bool(dev_byte & _FLAG_LAST)
        dev_len = r.extended(_DEVICE_LEN_MASK, version)
        if not empty_dev and md_index >= _MAX_MDS:
            raise WireError(f"{what}: md index {md_index} (at most {_MAX_MDS - 1})")
        if dev_byte & _FLAG_NUM_PATHS:
            r.take(1)
        if dev_byte & _FLAG_SYS_DEVICE:
            r.take(1)
        r.take(dev_len)
        last_tl = empty_dev
        while not last_tl:
            addresses += 1
            if addresses > _MAX_RESOURCES:
                raise WireError(f"{what}: more than {_MAX_RESOURCES} interface addresses")
            r.take(2)  # the transport name's checksum
            r.take(attr_bytes)
            iface_flags = r.peek()
            last_tl = bool(iface_flags & _FLAG_LAST)
            r.take(r.extended(_IFACE_LEN_MASK, version))
            more_eps = bool(iface_flags & _FLAG_HAS_EP_ADDR)
            eps = 0
            while more_eps:
                eps += 1
                if eps > _MAX_EP_ADDRS:
                    raise WireError(f"{what}: more than {_MAX_EP_ADDRS} endpoint addresses")
                r.take(r.byte())
                more_eps = not (r.byte() & _FLAG_LAST)
        if last_dev:
            break
    r.end()
