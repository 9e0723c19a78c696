"""Both ends of a striped put given up on midway and a second put over it, for
tests/backends/test_tcp_stripe_settle.py: ``python -m tests.peers.stripe_settle_peer '<json spec>'``.

Spec: ``role`` ("target" or "initiator"), ``name``, ``peer`` (the other's name), ``store``,
``listen`` (this end's addresses, comma-separated), ``nbytes``, ``timeout``, ``piece`` (the
second put's piece size), ``first_timeout`` (the first put's), ``prepared`` (the first put
is a prepared one, ``prepare_put``: PUTR frames). The first put's bytes are ``torch.randint``
of seed 1, the second's of seed 2.

* target: registers ``w`` (``nbytes`` zero bytes), signals the initiator "ready", then waits for
  a line on stdin (the test sends one once every byte on its way has landed) and prints
  ``RESULT {"exact": bool, "differ": n, "first": m}``: whether ``w`` holds exactly the second
  put's bytes, how many bytes differ from them, and how many of those are the first put's.
  It then serves until stdin ends.
* initiator: waits for "ready", prints ``START`` and starts a put of the first bytes (striped:
  ``nbytes`` is large and the target listens on several addresses). On a line on stdin it
  cancels it (the line ``cancel``) or not (any other), waits for its end and prints ``ENDED
  {"error": null or its class name, "partial": bool, "lanes": the tcp backend's lane stats}``.
  On the next line it puts the second bytes over the whole region in pieces of ``piece``
  bytes (too small to stripe: they take one connection, to the target's first address), one
  after another, prints ``DONE {"error": null or [class name, message]}``, and serves until
  stdin ends.
"""

from __future__ import annotations

import json
import sys

import torch
import trio

import transport


def payload(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


async def line() -> str:
    return await trio.to_thread.run_sync(sys.stdin.readline)


def say(what: str, doc: dict) -> None:
    print(f"{what} {json.dumps(doc)}", flush=True)


async def target(spec: dict) -> None:
    second = payload(spec["nbytes"], 2)
    first = payload(spec["nbytes"], 1)
    async with transport.Transport(spec["name"], store=spec["store"], backends=("tcp",), listen=spec["listen"],
                                   timeout=spec["timeout"]) as t:
        w = torch.zeros(spec["nbytes"], dtype=torch.uint8)
        t.register("w", w)
        await t.peer(spec["peer"])
        await t.signal(spec["peer"], "ready", 1)
        await line()
        differ = w != second
        say("RESULT", {"exact": not bool(differ.any()), "differ": int(differ.sum()),
                       "first": int((differ & (w == first)).sum())})
        await line()


async def initiator(spec: dict) -> None:
    nbytes, piece = spec["nbytes"], spec["piece"]
    first, second = payload(nbytes, 1), payload(nbytes, 2)
    async with transport.Transport(spec["name"], store=spec["store"], backends=("tcp",), listen=spec["listen"],
                                   timeout=spec["timeout"]) as t:
        await t.wait_signal("ready", timeout=spec["timeout"])
        await t.peer(spec["peer"], regions=["w"])
        print("START", flush=True)
        if spec.get("prepared"):
            handle = t.prepare_put(spec["peer"], [(first, "w", 0)]).start(timeout=spec["first_timeout"])
        else:
            handle = t.put(first, spec["peer"], key="w", timeout=spec["first_timeout"])
        if (await line()).strip() == "cancel":
            handle.cancel()
        ended: dict = {"error": None, "partial": False}
        try:
            await handle
        except transport.TransportError as exc:
            ended = {"error": type(exc).__name__, "partial": bool(getattr(exc, "partial", False))}
        tcp = next(b for b in t._backends if b.name == "tcp")
        say("ENDED", {**ended, "lanes": tcp.lane_stats(spec["peer"])})
        await line()
        error = None
        try:
            for offset in range(0, nbytes, piece):
                await t.put(second[offset : offset + piece], spec["peer"], key="w", offset=offset)
        except transport.TransportError as exc:
            error = [type(exc).__name__, str(exc)]
        say("DONE", {"error": error})
        await line()


def main() -> None:
    spec = json.loads(sys.argv[1])
    trio.run(target if spec["role"] == "target" else initiator, spec)


if __name__ == "__main__":
    main()
