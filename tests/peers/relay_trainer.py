"""A trainer process for relay tests: ``python -m tests.peers.relay_trainer '<json spec>'``.

It publishes ``versions`` versions of a state dict (``shapes``, seeded) to the generators named
in ``generators``, once each has said it is ready. Version 1 is random; each later one changes
``change`` of the elements of every tensor (a small change goes as a delta to subscribers that
hold the base). Before each publish it prints ``{"publishing": v, "at": time.time()}``, after it
``{"version": v, "sha": digest, "results": {name: [status, relayed_by, delta, seconds, error]},
"total_s": ...}``; before each publish it waits ``pause`` seconds. At the end it signals "stop"
to every generator and dumps its flight record (``flight``).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import trio

import transport
from tests.peers.relay_peer import digest, model
from transport.weights import Publisher


def step(state: dict[str, torch.Tensor], change: float, gen: torch.Generator) -> None:
    """Changes about ``change`` of every tensor's elements (all of them for 1.0)."""
    for t in state.values():
        flat = t.view(-1)
        if change >= 1.0:
            flat.copy_(torch.randn(flat.numel(), generator=gen).to(t.device, t.dtype))
        else:
            n = max(1, int(flat.numel() * change))
            at = torch.randint(0, flat.numel(), (n,), generator=gen)
            flat[at.to(t.device)] = torch.randn(n, generator=gen).to(t.device, t.dtype)


async def main(spec: dict) -> None:
    gen = torch.Generator().manual_seed(spec.get("seed", 1))
    state = model(spec["shapes"], spec.get("device", "cpu"))
    async with transport.Transport("trainer", store=spec["store"], listen=spec.get("listen"), timeout=30,
                                   flight_dir=spec.get("flight")) as t:
        async with Publisher(t, state, deadline=spec.get("deadline", 5.0), bucket_bytes=spec.get("bucket", 1 << 20),
                             relays=spec.get("relays", True), delta=spec.get("delta", "auto"),
                             relay_timeout=spec.get("relay_timeout")) as pub:
            for name in spec["generators"]:
                await t.wait_signal(f"ready.{name}", timeout=120)
            for v in range(1, spec["versions"] + 1):
                step(state, 1.0 if v == 1 else spec.get("change", 1.0), gen)
                await trio.sleep(spec.get("pause", 0.0))
                print(json.dumps({"publishing": v, "at": time.time()}), flush=True)
                r = await pub.publish(v)
                results = {n: [s.status.value, s.relayed_by, s.delta, round(s.seconds, 4), s.error]
                           for n, s in r.results.items()}
                print(json.dumps({"version": v, "sha": digest(state), "results": results,
                                  "total_s": round(r.total_s, 4)}), flush=True)
            for name in spec["generators"]:
                try:
                    await t.signal(name, "stop", 1, timeout=5)
                except transport.TransportError:
                    pass
            if spec.get("flight"):
                t.dump_flight_record("relay trainer done")


if __name__ == "__main__":
    trio.run(main, json.loads(sys.argv[1]))
