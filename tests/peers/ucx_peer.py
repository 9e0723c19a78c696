"""Processes for the two-"host" ucx tests: ``python -m tests.peers.ucx_peer '<json spec>'``.

Roles (``spec["role"]``), each speaking only ``ucx`` and writing a JSON result to ``spec["out"]``:

* ``target``: registers ``w`` and one region per dtype, rings ``ready`` at the initiator; after
  the ``phase`` doorbell it re-registers ``w`` over new memory of the same size (keeping the old
  tensor) and rings ``rereg``; after ``done`` it reports the sha256 of every region.
* ``initiator``: puts random data into every region and reads it back; puts pattern 1 into
  ``w``, rings ``phase``; after ``rereg`` puts pattern 2 into ``w`` (the new memory, if it
  noticed the re-registration), rings ``done``.
* ``victim``: registers ``w``, rings ``ready-<its name>``, then only waits (until it is killed).
* ``streamer``: puts into the victim's ``w`` in a loop, creates ``out + ".streaming"`` once
  puts flow, and reports the error that ends the loop (and the one a further put raises).
* ``straggle``: with two victims ``slow`` and ``fast``, creates ``out + ".stop"`` once both
  received a put, waits for ``out + ".stopped"`` (the harness has SIGSTOPped ``slow``), then puts
  into ``slow`` while putting into ``fast`` in a loop, and reports how both went.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch
import trio

import transport
from tests._support.scenarios import DTYPES, random_tensor

SIZES = {"float32": 1_000_003, "bfloat16": 4097, "int8": 1, "int64": 65536, "bool": 12345}
W_BYTES = 16 << 20
STREAM_BYTES = 32 << 20


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def pattern(value: int) -> torch.Tensor:
    return torch.full((W_BYTES,), value, dtype=torch.uint8)


def dtypes() -> list[torch.dtype]:
    return [d for d in DTYPES if str(d).removeprefix("torch.") in SIZES]


async def target(t: transport.Transport, spec: dict) -> dict:
    regions = {"w": torch.zeros(W_BYTES, dtype=torch.uint8)}
    for d in dtypes():
        regions[str(d).removeprefix("torch.")] = torch.zeros(SIZES[str(d).removeprefix("torch.")], dtype=d)
    t.register_many(regions)
    await t.peer(spec["peer"])
    await t.signal(spec["peer"], "ready", 1)
    await t.wait_signal("phase")
    old = regions["w"]
    t.unregister("w")
    regions["w"] = torch.zeros(W_BYTES, dtype=torch.uint8)  # new memory, same size and dtype
    t.register("w", regions["w"])
    await t.signal(spec["peer"], "rereg", 1)
    await t.wait_signal("done")
    return {"sha256": {k: sha(v) for k, v in regions.items()}, "old_w": sha(old)}


async def initiator(t: transport.Transport, spec: dict) -> dict:
    peer = spec["peer"]
    await t.wait_signal("ready")
    await t.peer(peer, regions=["w", *SIZES])
    out: dict = {"backends": set(), "read_back": {}, "sha256": {}}
    for i, d in enumerate(dtypes()):
        key = str(d).removeprefix("torch.")
        src = random_tensor(SIZES[key], d, seed=i)
        h = t.put(src, peer, key=key)
        await h
        out["backends"].add(h.backend)
        back = torch.empty_like(src)
        await t.get(back, peer, key=key)
        out["read_back"][key] = torch.equal(back.view(torch.uint8), src.view(torch.uint8))
        out["sha256"][key] = sha(src)
    await t.put(pattern(1), peer, key="w")
    await t.signal(peer, "phase", 1)
    await t.wait_signal("rereg")
    await t.put(pattern(2), peer, key="w")  # must land in the re-registered memory
    await t.signal(peer, "done", 1)
    out["backends"] = sorted(out["backends"])
    out["w_first"], out["w_second"] = sha(pattern(1)), sha(pattern(2))
    return out


async def victim(t: transport.Transport, spec: dict) -> dict:
    t.register("w", torch.zeros(STREAM_BYTES, dtype=torch.uint8))
    await t.peer(spec["peer"])
    await t.signal(spec["peer"], f"ready-{t.name}", 1)
    await t.wait_signal("done", timeout=spec["timeout"] * 10)  # killed long before
    return {}


async def streamer(t: transport.Transport, spec: dict) -> dict:
    peer = spec["peer"]
    await t.wait_signal(f"ready-{peer}")
    await t.peer(peer, regions=["w"])
    src = torch.ones(STREAM_BYTES, dtype=torch.uint8)
    puts, started, h = 0, None, None
    out: dict = {}
    try:
        while True:
            h = t.put(src, peer, key="w")
            await h
            puts += 1
            if puts == 2:
                started = time.monotonic()
                await trio.Path(spec["out"] + ".streaming").touch()  # the harness kills the victim now
    except transport.TransportError as exc:
        out.update(error=type(exc).__name__, message=str(exc), cause=type(exc.__cause__).__name__,
                   puts=puts, backend=h.backend if h else None,
                   after_s=time.monotonic() - (started or time.monotonic()))
    try:
        await t.put(src, peer, key="w")
        out["again"] = "completed"
    except transport.TransportError as exc:
        out["again"] = type(exc).__name__
    return out


async def straggle(t: transport.Transport, spec: dict) -> dict:
    src = torch.ones(STREAM_BYTES, dtype=torch.uint8)
    for peer in ("slow", "fast"):
        await t.wait_signal(f"ready-{peer}")
        await t.peer(peer, regions=["w"])
        await t.put(src, peer, key="w")
    await trio.Path(spec["out"] + ".stop").touch()
    while not await trio.Path(spec["out"] + ".stopped").exists():
        await trio.sleep(0.01)
    out: dict = {"fast_puts": 0}
    slow_done = trio.Event()

    async def to_slow() -> None:
        try:
            await t.put(src, "slow", key="w", timeout=spec["slow_timeout"])
            out["slow"] = "completed"
        except transport.TransportError as exc:
            out["slow"] = type(exc).__name__
        slow_done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(to_slow)
        while not slow_done.is_set():  # the live peer is served all along
            await t.put(src, "fast", key="w")
            out["fast_puts"] += 1
    return out


ROLES = {"target": target, "initiator": initiator, "victim": victim, "streamer": streamer, "straggle": straggle}


async def main(spec: dict) -> None:
    async with transport.Transport(spec["name"], store=spec["store"], backends=("ucx",), timeout=spec["timeout"]) as t:
        result = await ROLES[spec["role"]](t, spec)
    result["pid_ns"] = os.stat("/proc/self/ns/pid").st_ino
    await trio.Path(spec["out"] + ".tmp").write_text(json.dumps(result))
    os.replace(spec["out"] + ".tmp", spec["out"])  # the harness never sees half a result


if __name__ == "__main__":
    trio.run(main, json.loads(sys.argv[1]))
