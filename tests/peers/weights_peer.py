"""A subscriber process for weight-sync tests: ``python -m tests.peers.weights_peer '<json spec>'``.

It subscribes to the stream, then loops: apply the newest complete version, and check the live
weights — every tensor must encode the same version, the one ``sub.version`` reports (the
publisher fills version v with the value v). A torn or mixed read is counted. It stops on the
signal "stop" and writes its counts and peak RSS to ``out``.
"""

from __future__ import annotations

import json
import os
import resource
import sys

import torch
import trio

import transport
from transport.weights import Subscriber


def model(shapes: dict) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(s, dtype=getattr(torch, d)) for k, (s, d) in shapes.items()}


async def main(spec: dict) -> None:
    local = model(spec["shapes"])
    async with transport.Transport(spec["name"], store=spec["store"], backends=spec.get("backends"), timeout=30) as t:
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        zero_copy = spec.get("zero_copy", False)
        async with Subscriber(t, local, publisher=spec["publisher"], name="policy", zero_copy=zero_copy) as sub:
            if spec.get("pull"):
                await sub.pull()
            await t.signal(spec["publisher"], f"ready.{spec['name']}", 1)
            checks = torn = applied = 0
            versions = []
            while True:
                stopping = t.signal_value("stop") is not None  # still apply what came before it
                v = await sub.apply_async() if spec.get("apply_async") else sub.apply()
                if v is not None:
                    applied += 1
                    versions.append(v)
                live = sub.version
                if live is not None:
                    seen = {float(x.flatten()[0]) for x in local.values()}
                    seen |= {float(x.min()) for x in local.values()} | {float(x.max()) for x in local.values()}
                    checks += 1
                    if seen != {float(live % 128)}:
                        torn += 1
                if stopping:
                    break
                await trio.lowlevel.checkpoint()
            rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            info = {
                "checks": checks, "torn": torn, "applied": applied, "final": sub.version,
                "monotonic": versions == sorted(versions),
                "peak_rss_growth": (rss1 - rss0) * 1024, "staging_bytes": sub.staging_bytes,
                "model_bytes": sum(x.numel() * x.element_size() for x in local.values()),
            }
    write_result(info, spec["out"])


def write_result(info: dict, out: str) -> None:
    """Writes ``info`` to ``out`` atomically (the test waits for the file)."""
    with open(out + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    trio.run(main, json.loads(sys.argv[1]))
