"""Both ends of a striped tcp transfer, for tests and the striping benchmark:
``python -m tests.peers.stripe_peer '<json spec>'``.

Spec: ``role`` ("target" or "initiator"), ``name``, ``peer`` (the other's name), ``store``,
``listen`` (this end's addresses, comma-separated), ``nbytes``, ``seed`` (the bytes are
``torch.randint`` of that seed), ``timeout``, optionally ``backends`` (default ``["tcp"]``).

* target: registers ``w`` (``nbytes`` zero bytes), signals the initiator "ready", then polls its
  region until it holds exactly the initiator's bytes (no message needed: the link that would
  carry one may be cut) or ``timeout`` passes; prints ``RESULT {"exact": bool}``, and serves on
  for ``linger`` seconds (default 0). With ``poll`` false it waits for the signal "done" instead
  (``signal_done`` on the initiator).
* initiator: waits for "ready", prints ``START`` and puts its bytes into the target's ``w`` once
  per ``repeat`` (default 1) with ``timeout`` each, then prints ``RESULT`` with each put's
  seconds, the error (class, message, seconds) if one failed, the flight record's lanes of the
  last put, and the tcp backend's lane stats. With ``wait_go``, it prints ``WAITING`` and waits
  for a line on stdin before each put (a test cuts links in between).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import trio

import transport


def payload(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


async def target(spec: dict) -> None:
    expected = payload(spec["nbytes"], spec["seed"])
    async with transport.Transport(spec["name"], store=spec["store"], backends=spec.get("backends", ("tcp",)),
                                   listen=spec["listen"], timeout=spec["timeout"]) as t:
        w = torch.zeros(spec["nbytes"], dtype=torch.uint8)
        t.register("w", w)
        await t.peer(spec["peer"])
        await t.signal(spec["peer"], "ready", 1)
        if spec.get("poll", True):
            deadline = time.monotonic() + spec["timeout"]
            exact = False
            while not exact and time.monotonic() < deadline:
                await trio.sleep(0.2)
                exact = bool(torch.equal(w, expected))
        else:  # (a benchmark: no polling pass over the region to compete with the transfer)
            await t.wait_signal("done", timeout=spec["timeout"] * spec.get("repeat", 1) + 60)
            exact = bool(torch.equal(w, expected))
        print("RESULT " + json.dumps({"exact": exact}), flush=True)
        # Its bytes may all be here while the initiator still sends a chunk again (its lane was
        # cut after the bytes landed, before the reply came back): keep serving a while.
        await trio.sleep(spec.get("linger", 0))
        return None


async def initiator(spec: dict) -> dict:
    src = payload(spec["nbytes"], spec["seed"])
    async with transport.Transport(spec["name"], store=spec["store"], backends=spec.get("backends", ("tcp",)),
                                   listen=spec["listen"], timeout=spec["timeout"]) as t:
        await t.wait_signal("ready", timeout=spec["timeout"])
        await t.peer(spec["peer"], regions=["w"])
        times: list[float] = []
        error = None
        for _ in range(spec.get("repeat", 1)):
            if spec.get("wait_go"):
                print("WAITING", flush=True)
                await trio.to_thread.run_sync(sys.stdin.readline)
            print("START", flush=True)
            t0 = time.monotonic()
            try:
                await t.put(src, spec["peer"], key="w", timeout=spec["timeout"])
            except transport.TransportError as exc:
                error = [type(exc).__name__, str(exc), round(time.monotonic() - t0, 2)]
                break
            times.append(time.monotonic() - t0)
        if spec.get("signal_done"):
            await t.signal(spec["peer"], "done", 1)
        records = t._flight.snapshot("stripe_peer")["records"]
        puts = [r for r in records if r["op"] == "put"]
        tcp = next((b for b in t._backends if b.name == "tcp"), None)
        return {"seconds": times, "error": error, "lanes": puts[-1].get("lanes", {}) if puts else {},
                "backend": puts[-1].get("backend") if puts else None,
                "stats": tcp.lane_stats(spec["peer"]) if tcp is not None else []}


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec["role"] == "target":
        trio.run(target, spec)
    else:
        print("RESULT " + json.dumps(trio.run(initiator, spec)), flush=True)


if __name__ == "__main__":
    main()
