"""A subscriber process for the delta-sync tests: ``python -m tests.peers.delta_peer '<json spec>'``.

It subscribes to the stream and runs its ``plan``, a list of ``[action, version]`` steps:

* ``apply``: wait for that version, apply it (the Subscriber chooses: a delta or dense), and
  check the live weights bit for bit against :func:`tests._support.delta_model.model_at`;
* ``skip``: wait until that version is complete in a slot, and leave it unapplied;
* ``refuse``: the same, then ``apply()``: it must refuse it (a delta whose base it does not
  hold) and leave the live weights bit for bit on the version they held;
* ``pull``: ``pull()`` that version from the publisher's snapshot and check it.

After each step it raises its ``ack.<name>`` signal on the trainer to the number of steps done
(plus ``ack_base``, so that a restarted process under the same name counts on),
and at the end writes one record per step to ``out``.
"""

from __future__ import annotations

import json
import os
import sys

import trio

import transport
from tests._support.delta_model import model_at, same_bits, zeros
from transport.weights import Subscriber


async def until_latest(sub: Subscriber, version: int, timeout: float = 30) -> None:
    with trio.fail_after(timeout):
        while sub.latest is None or sub.latest < version:
            await trio.sleep(0.005)


async def main(spec: dict) -> None:
    local = zeros()
    records = []
    async with transport.Transport(spec["name"], store=spec["store"], backends=spec.get("backends"), timeout=30) as t:
        async with Subscriber(t, local, publisher=spec["publisher"]) as sub:
            base = spec.get("ack_base", 0)  # a restarted process counts on from there
            await t.signal(spec["publisher"], f"ready.{spec['name']}", base + 1)
            for n, (action, version) in enumerate(spec["plan"], 1):
                held, refused = sub.version, sub.refused_deltas
                if action == "apply":
                    got = await sub.wait_version(version, timeout=30)
                    ok = got == version and same_bits(local, model_at(version))
                elif action == "skip":
                    await until_latest(sub, version)
                    ok = sub.version == held
                elif action == "refuse":
                    await until_latest(sub, version)
                    got = sub.apply()
                    ok = (got is None and sub.version == held and sub.refused_deltas == refused + 1
                          and held is not None and same_bits(local, model_at(held)))
                elif action == "pull":
                    got = await sub.pull(timeout=30)
                    ok = got == version and same_bits(local, model_at(version))
                else:
                    raise ValueError(action)
                records.append({"action": action, "version": version, "ok": ok, "live": sub.version,
                                "refused": sub.refused_deltas})
                await t.signal(spec["publisher"], f"ack.{spec['name']}", base + n)
    with open(spec["out"] + ".tmp", "w") as f:
        json.dump(records, f)
    os.replace(spec["out"] + ".tmp", spec["out"])


if __name__ == "__main__":
    trio.run(main, json.loads(sys.argv[1]))
