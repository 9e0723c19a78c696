"""A generator process for relay tests: ``python -m tests.peers.relay_peer '<json spec>'``.

Run it on a "host" of its own (``unshare --uts`` with a hostname, inside a network namespace or
not): it subscribes with ``relay=True`` (or the spec's ``relay``), then applies every version
that arrives until the signal "stop", and prints one JSON line per version made live:
``{"live": v, "at": time.time(), "sha": ...}``, the sha256 of its live weights (the trainer
prints the digest of the state it published as v: a torn or mixed version, bytes of two versions
or of none, has another digest). At the end, a summary with the number of relay orders it
followed; it writes nothing else to stdout.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import torch
import trio

import transport
from transport.weights import Subscriber


def model(shapes: dict, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The state dict of ``shapes`` (name -> [shape, dtype name]), zeros on ``device``."""
    return {k: torch.zeros(s, dtype=getattr(torch, d), device=device) for k, (s, d) in shapes.items()}


def digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 of every tensor's bytes, by name."""
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


async def main(spec: dict) -> None:
    device = spec.get("device", "cpu")  # (a CUDA device: the model and the slots there)
    local = model(spec["shapes"], device)
    async with transport.Transport(spec["name"], store=spec["store"], backends=spec.get("backends"),
                                   listen=spec.get("listen"), timeout=30,
                                   flight_dir=spec.get("flight")) as t:
        async with Subscriber(t, local, publisher=spec["publisher"], relay=spec.get("relay", True),
                              delta=spec.get("delta", True), device=device) as sub:
            await t.signal(spec["publisher"], f"ready.{spec['name']}", 1)
            while t.signal_value("stop") is None:
                v = await sub.apply_async()
                if v is None:
                    try:
                        await t.wait_signal(f"wsync.{sub.name}.version", at_least=(sub.version or 0) + 1,
                                            timeout=0.05)
                    except transport.TransferTimeoutError:
                        pass
                    continue
                print(json.dumps({"live": v, "at": time.time(), "sha": digest(local)}), flush=True)
            followed = sub._relay.followed if sub._relay is not None else 0
            print(json.dumps({"summary": True, "followed": followed, "version": sub.version,
                              "refused_deltas": sub.refused_deltas}), flush=True)
            if spec.get("flight"):
                t.dump_flight_record("relay peer done")


if __name__ == "__main__":
    trio.run(main, json.loads(sys.argv[1]))
