"""A same-host peer that lies in its record: ``python -m tests.peers.forged_peer '<json spec>'``.

It opens a real Transport (``backends``), allocates a writable region ``w`` and a read-only
region ``ro`` (both from ``Transport.empty``, so their memfds are published), then rewrites its
own record in the store (same name, incarnation, seq and pid: every liveness check passes) with
the descriptor named by ``forge``:

- ``none``: nothing changed (a legitimate peer, for the "others are unaffected" half);
- ``fifo-ipc-ctl`` / ``fifo-ucx-ctl``: the ipc or ucx control page's memfd number names a FIFO
  this process holds open for reading, with no writer (an ``open`` of it for reading blocks);
- ``fifo-ro-region``: the ipc descriptor of ``ro`` names that FIFO;
- ``empty-rkey``: the ucx descriptor of ``w`` has no rkey bytes at all;
- ``random-address``: every ucx worker address is random bytes (seeded by ``seed``);
- ``garbage-rkey``: the ucx descriptor of ``w`` carries random bytes as its rkey.

With ``subscribe`` (``{"publisher": NAME, "stream": NAME, "numel": N}``) it first joins that
weight-sync stream as a real ``Subscriber`` of one float32 tensor ``w0`` of N elements, so the
forged record is a subscriber's that every publish of the stream looks up.

Writes ``<out>`` (JSON: pid) once forged, then sleeps until killed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import struct
import sys
import tempfile
import time

import trio

import transport
from transport._rendezvous import open_store
from transport._wire import PeerRecord

_IPC_ENDPOINT = struct.Struct("<qQq")
_IPC_REGION = struct.Struct("<QQqQQ")
_UCX_ENDPOINT = struct.Struct("<4sHHQiQI")
_UCX_REGION = struct.Struct("<4sQQ")
_LEN = struct.Struct("<I")


def _fifo() -> int:
    path = os.path.join(tempfile.mkdtemp(), "fifo")
    os.mkfifo(path)
    return os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a reader, and never a writer


def _ucx_endpoint(data: bytes, *, ctl_fd: int | None = None, addresses: list[bytes] | None = None) -> bytes:
    magic, version, lanes, ctl_address, fd, inode, ctl_len = _UCX_ENDPOINT.unpack_from(data)
    pos = _UCX_ENDPOINT.size + ctl_len
    ctl_rkey, old = data[_UCX_ENDPOINT.size : pos], []
    for _ in range(lanes):
        (n,) = _LEN.unpack_from(data, pos)
        old.append(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
    addresses = addresses if addresses is not None else old
    out = [_UCX_ENDPOINT.pack(magic, version, len(addresses), ctl_address, fd if ctl_fd is None else ctl_fd,
                              inode, len(ctl_rkey)), ctl_rkey]
    for a in addresses:
        out += [_LEN.pack(len(a)), a]
    return b"".join(out)


def forge(record: PeerRecord, kind: str, fifo: int, rng: random.Random) -> PeerRecord:
    backends, regions = dict(record.backends), dict(record.regions)
    if kind == "fifo-ipc-ctl":
        pid, probe, _fd = _IPC_ENDPOINT.unpack(backends["ipc"])
        backends["ipc"] = _IPC_ENDPOINT.pack(pid, probe, fifo)
    elif kind == "fifo-ucx-ctl":
        backends["ucx"] = _ucx_endpoint(backends["ucx"], ctl_fd=fifo)
    elif kind == "fifo-ro-region":
        ro = regions["ro"]
        addr, nbytes, _fd, offset, _inode = _IPC_REGION.unpack(ro.descriptors["ipc"])
        desc = {**ro.descriptors, "ipc": _IPC_REGION.pack(addr, nbytes, fifo, offset, 0)}
        regions["ro"] = dataclasses.replace(ro, descriptors=desc)
    elif kind in ("empty-rkey", "garbage-rkey"):
        w = regions["w"]
        magic, addr, nbytes = _UCX_REGION.unpack_from(w.descriptors["ucx"])
        rkey = b"" if kind == "empty-rkey" else rng.randbytes(rng.randrange(1, 64))
        desc = {**w.descriptors, "ucx": _UCX_REGION.pack(magic, addr, nbytes) + rkey}
        regions["w"] = dataclasses.replace(w, descriptors=desc)
    elif kind == "random-address":
        n = len(_ucx_endpoint_addresses(backends["ucx"]))
        addresses = [rng.randbytes(rng.randrange(1, 300)) for _ in range(n)]
        backends["ucx"] = _ucx_endpoint(backends["ucx"], addresses=addresses)
    elif kind != "none":
        raise ValueError(f"unknown forgery {kind!r}")
    return dataclasses.replace(record, backends=backends, regions=regions)


def _ucx_endpoint_addresses(data: bytes) -> list[bytes]:
    _m, _v, lanes, *_rest = _UCX_ENDPOINT.unpack_from(data)
    return [b""] * lanes


async def main(spec: dict) -> None:
    fifo = _fifo()
    backends = tuple(spec["backends"])
    async with transport.Transport(spec["name"], store=spec["store"], backends=backends, timeout=30) as t:
        t.empty("w", 1 << 16, dtype=transport_dtype())
        t.empty("ro", 1 << 16, dtype=transport_dtype(), writable=False)
        if sub := spec.get("subscribe"):
            import torch

            from transport.weights import Subscriber

            await Subscriber(t, {"w0": torch.zeros(sub["numel"])}, publisher=sub["publisher"],
                             name=sub["stream"]).start()
        await trio.sleep(0.2)  # let the record with every region be published
        store = open_store(spec["store"])
        key = "peer/" + spec["name"]
        record = PeerRecord.decode(store.get(key))
        store.set(key, forge(record, spec["forge"], fifo, random.Random(spec.get("seed", 0))).encode())
        with open(spec["out"] + ".tmp", "w") as f:
            json.dump({"pid": os.getpid()}, f)
        os.replace(spec["out"] + ".tmp", spec["out"])
        while True:
            time.sleep(3600)  # one-sided: a target that never runs Python must not matter


def transport_dtype():
    import torch

    return torch.uint8


if __name__ == "__main__":
    trio.run(main, json.loads(sys.argv[1]))
