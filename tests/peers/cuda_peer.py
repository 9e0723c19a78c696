"""A target process for the GPU tests: ``python -m tests.peers.cuda_peer '<json spec>'``.

It registers the spec's regions (device or host memory), tells the initiator it is ready, then
serves checksum requests until told to exit, and finally writes what it saw to ``out``. Its
application code never touches the regions between requests: what lands there was put there
one-sidedly by the initiator.

Spec (JSON)::

    name, store, initiator, out         as in tests/peers/peer_target.py
    serial                              a number the test chooses per process (restarts: 1, 2, ...)
    backends                            default ["ipc"]
    timeout                             the Transport's timeout (s), default 30
    lifetime                            exit with an error after this many seconds, default 240
    register_errors                     "raise" (default) or "report" (see below)
    regions: [{
        key, dtype, numel,
        where:    "cuda" (torch's caching allocator) | "host" (torch.zeros) |
                  "pinned" (torch.zeros(pin_memory=True)) | "shared" (Transport.empty)
        fill:     byte value every byte starts with (default 0)
        slice:    {"before": B, "after": A, "guard": G}: the region is a view B bytes into one
                  larger allocation of B + nbytes + A bytes, whose other bytes hold G (cuda only)
        writable: default true
    }]

Protocol, through signals (those sent to the initiator carry this peer's name, so one
initiator can serve several peers and restarts of one):

    -> ready.<name> = serial            every region is registered
    -> expandable.<name> = 1 | 0 | -1   whether torch's allocator handed out expandable segments
                                        (unknown: -1); sent before ready, when CUDA is in use
    -> regerr.<name> = 1                (register_errors "report") registering failed: the error
                                        is in ``out`` after exit; sent before ready
    <- check = n                        compute the checksums of every region ...
    -> digest.<name>.<key> = d          ... of its bytes, d = :func:`digest`
    -> guard.<name>.<key> = d           ... of the bytes around a slice region
    -> checked.<name> = n               after all of round n
    <- exit = 1                         write ``out`` and exit 0

The checksums are computed without any CUDA synchronisation of this process: a completed
transfer means the bytes are already in this process's memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any

import torch
import trio

import transport


def digest(t: torch.Tensor) -> int:
    """The first 60 bits of the sha256 of a contiguous tensor's bytes (fits a signal value)."""
    return int(sha256(t)[:15], 16)


def sha256(t: torch.Tensor) -> str:
    data = t.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b""
    return hashlib.sha256(data).hexdigest()


def make_region(t: transport.Transport, r: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """Allocates and registers one region; returns (tensor, guard bytes or None, keepalive)."""
    dtype = getattr(torch, r["dtype"])
    numel, fill, where = int(r["numel"]), int(r.get("fill", 0)), r.get("where", "cuda")
    nbytes = numel * dtype.itemsize
    writable = bool(r.get("writable", True))
    guard = keep = None
    if where == "shared":
        tensor = t.empty(r["key"], numel, dtype, writable=writable)
        tensor.view(torch.uint8).fill_(fill)
        return tensor, None, None
    if where == "cuda" and r.get("slice"):
        s = r["slice"]
        before, after = int(s["before"]), int(s["after"])
        keep = torch.full((before + nbytes + after,), int(s["guard"]), dtype=torch.uint8, device="cuda")
        keep[before : before + nbytes].fill_(fill)
        tensor = keep[before : before + nbytes].view(dtype)
        guard = (keep[:before], keep[before + nbytes :])
    elif where == "cuda":
        tensor = torch.full((nbytes,), fill, dtype=torch.uint8, device="cuda").view(dtype)
    elif where in ("host", "pinned"):
        tensor = torch.full((nbytes,), fill, dtype=torch.uint8, pin_memory=where == "pinned").view(dtype)
    else:
        raise ValueError(f"unknown region placement {where!r}")
    if tensor.device.type == "cuda":
        torch.cuda.synchronize()  # the fill is complete before anyone can write
    t.register(r["key"], tensor, writable=writable)
    return tensor, guard, keep


def guard_digest(guard: tuple[torch.Tensor, torch.Tensor]) -> int:
    return digest(torch.cat([guard[0], guard[1]]))


def expandable_in_use() -> bool | None:
    """Whether torch's caching allocator handed out expandable segments (None: cannot tell)."""
    try:
        return any(seg.get("is_expandable", False) for seg in torch.cuda.memory_snapshot())
    except Exception:  # an older torch: cannot tell
        return None


async def main(spec: dict) -> None:
    name, initiator = spec["name"], spec["initiator"]
    parent = os.getppid()
    deadline = time.monotonic() + float(spec.get("lifetime", 240))
    info: dict[str, Any] = {"pid": os.getpid(), "serial": spec.get("serial", 1)}
    async with transport.Transport(name, store=spec["store"], backends=spec.get("backends", ["ipc"]),
                                   timeout=spec.get("timeout", 30)) as t:
        regions: dict[str, torch.Tensor] = {}
        guards: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        keep = []
        try:
            for r in spec["regions"]:
                tensor, guard, k = make_region(t, r)
                regions[r["key"]] = tensor
                keep.append(k)
                if guard is not None:
                    guards[r["key"]] = guard
        except transport.TransportError as exc:
            if spec.get("register_errors", "raise") != "report":
                raise
            info["register_error"] = {"type": type(exc).__name__, "message": str(exc)}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            info["expandable_segments"] = expandable_in_use()
        await t.peer(initiator)
        if "expandable_segments" in info:
            await t.signal(initiator, f"expandable.{name}", {True: 1, False: 0, None: -1}[info["expandable_segments"]])
        if "register_error" in info:
            await t.signal(initiator, f"regerr.{name}", 1)
        await t.signal(initiator, f"ready.{name}", int(spec.get("serial", 1)))
        handled = 0
        while not t.signal_value("exit"):
            if time.monotonic() > deadline:
                raise SystemExit(f"cuda_peer {name}: no exit signal within its lifetime")
            if os.getppid() != parent:
                raise SystemExit(f"cuda_peer {name}: the test process went away")
            wanted = t.signal_value("check") or 0
            if wanted > handled:
                handled = wanted
                for key, tensor in regions.items():
                    await t.signal(initiator, f"digest.{name}.{key}", digest(tensor))
                for key, guard in guards.items():
                    await t.signal(initiator, f"guard.{name}.{key}", guard_digest(guard))
                await t.signal(initiator, f"checked.{name}", handled)
            await trio.sleep(0.005)
        info["sha256"] = {k: sha256(v) for k, v in regions.items()}
        info["rounds"] = handled
    with open(spec["out"] + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(spec["out"] + ".tmp", spec["out"])


if __name__ == "__main__":
    trio.run(main, json.loads(sys.argv[1]))
