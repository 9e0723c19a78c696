"""The ucx backend's descriptors in peer records: its endpoint (the control word, its rkey,
and one worker address per lane) and a region's (address, size, packed rkey). Everything
decoded here came from a peer's record: sizes are checked before a byte is sliced, and rkeys
and worker addresses are checked (:mod:`transport._native.ucx_format`) before libucp sees them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .._errors import WireError
from .._native import SharedBuffer
from .._native.ucx_format import check_rkey, check_worker_address
from ._control import SEQ_OFFSET

# magic, version, lanes, address of the control word, its memfd's number and inode (same-host
# peers map it), length of its rkey; then the rkey; then per lane: <I length, worker address
_ENDPOINT = struct.Struct("<4sHHQiQI")
_ENDPOINT_MAGIC, _ENDPOINT_VERSION = b"UCXE", 2
_LEN = struct.Struct("<I")
_REGION = struct.Struct("<4sQQ")  # magic, address, nbytes; then the packed rkey
_REGION_MAGIC = b"UCXR"


@dataclass(frozen=True)
class EndpointInfo:
    """A peer's ucx endpoint descriptor, decoded."""

    addresses: list[bytes]  # worker address per lane
    ctl_address: int  # the word holding the seq of the peer's latest record
    ctl_fd: int  # the memfd holding it (at offset 0), as numbered in the peer's process
    ctl_inode: int
    ctl_rkey: bytes


def encode_endpoint(addresses: list[bytes], ctl: SharedBuffer, ctl_rkey: bytes) -> bytes:
    """This endpoint's descriptor: the worker address of every lane, the control word in
    ``ctl`` and the rkey it is mapped with."""
    out = [_ENDPOINT.pack(_ENDPOINT_MAGIC, _ENDPOINT_VERSION, len(addresses), ctl.address + SEQ_OFFSET, ctl.fd,
                          ctl.inode, len(ctl_rkey)), ctl_rkey]
    for a in addresses:
        out += [_LEN.pack(len(a)), a]
    return b"".join(out)


def decode_endpoint(data: bytes, peer: str) -> EndpointInfo:
    """``peer``'s endpoint descriptor, checked whole.

    Raises:
        WireError: it is not one (too short, truncated, another magic or version, a bad
            worker address or rkey).
    """
    if len(data) < _ENDPOINT.size:
        raise WireError(f"{peer}: ucx endpoint descriptor of {len(data)} bytes is too short")
    magic, version, lanes, ctl_address, ctl_fd, ctl_inode, ctl_len = _ENDPOINT.unpack_from(data)
    if magic != _ENDPOINT_MAGIC or version != _ENDPOINT_VERSION or lanes < 1:
        raise WireError(f"{peer}: not a ucx endpoint descriptor (magic {magic!r}, version {version}, {lanes} lanes)")
    pos = _ENDPOINT.size + ctl_len
    if pos > len(data):
        raise WireError(f"{peer}: truncated ucx endpoint descriptor")
    ctl_rkey, out = data[_ENDPOINT.size : pos], list[bytes]()
    for _ in range(lanes):
        if pos + _LEN.size > len(data):
            raise WireError(f"{peer}: truncated ucx endpoint descriptor")
        (n,) = _LEN.unpack_from(data, pos)
        pos += _LEN.size
        if n == 0 or pos + n > len(data):
            raise WireError(f"{peer}: truncated ucx endpoint descriptor")
        check_worker_address(data[pos : pos + n], f"{peer}: ucx worker address of lane {len(out)}")
        out.append(data[pos : pos + n])
        pos += n
    check_rkey(ctl_rkey, f"{peer}: ucx rkey of the control word")  # before libucp ever sees them
    return EndpointInfo(out, ctl_address, ctl_fd, ctl_inode, ctl_rkey)


def decode_region(data: bytes, where: str) -> tuple[int, int, bytes]:
    """A region descriptor as (address, nbytes, packed rkey), checked.

    Raises:
        WireError: it is not one.
    """
    if len(data) < _REGION.size:
        raise WireError(f"{where}: ucx region descriptor of {len(data)} bytes is too short")
    magic, address, nbytes = _REGION.unpack_from(data)
    if magic != _REGION_MAGIC:
        raise WireError(f"{where}: not a ucx region descriptor (magic {magic!r})")
    if nbytes:
        check_rkey(data[_REGION.size :], f"{where}: ucx rkey")
    return address, nbytes, data[_REGION.size :]


def encode_region(address: int, nbytes: int, rkey: bytes) -> bytes:
    """A region's descriptor: where it is mapped for UCX, its size, and its packed rkey."""
    return _REGION.pack(_REGION_MAGIC, address, nbytes) + rkey
