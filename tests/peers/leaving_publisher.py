"""A trainer process that publishes a few versions and then leaves, for the tests of generators
that outlive their trainer: ``python -m tests.peers.leaving_publisher '<json spec>'``.

It opens a Transport ``name`` (``backends``) and a publisher of one float32 tensor ``w`` of
``numel`` elements: a stream :class:`~transport.weights.Publisher` (stream ``policy``), or with
``"mesh": true`` a one-rank :class:`~transport.weights.MeshPublisher` (stream ``m``) whose
generator rank takes ``w`` whole. It waits for the signal ``go`` (the test's subscribers are
subscribed by then), publishes each version ``v`` of ``versions`` with ``w`` filled with ``v``,
checks that every name in ``expect`` got it, and raises the signal ``published`` on the peer
``notify`` to the last version. Then, as ``leave`` says:

- ``"close"``: closes the publisher and the Transport (its record leaves the store) and exits 0;
- ``"stay"``: waits, publisher open, until the test kills it (a crash: its record stays in the
  store).
"""

from __future__ import annotations

import json
import sys

import torch
import trio

import transport
from transport.plan import MeshSharding, Shard, TensorSpec, TrainerLayout
from transport.weights import MeshPublisher, Publisher, SyncStatus


def mesh_layout(numel: int) -> TrainerLayout:
    return TrainerLayout.of([TensorSpec("w", (numel,), "float32", MeshSharding((1,), (Shard(0),), (0,)))])


async def publish_all(spec: dict, t: transport.Transport, w: torch.Tensor) -> None:
    if spec.get("mesh"):
        async with MeshPublisher(t, "m", {"w": w}, mesh_layout(w.numel()), rank=0, deadline=30) as mpub:
            await t.wait_signal("go", timeout=60)
            for v in spec["versions"]:
                w.fill_(float(v))
                report = await mpub.publish(v)
                for name in spec["expect"]:
                    assert report.results[name].status is SyncStatus.DONE, report
            await leave(spec, t)
        return
    async with Publisher(t, {"w": w}, deadline=30) as pub:
        await t.wait_signal("go", timeout=60)
        for v in spec["versions"]:
            w.fill_(float(v))
            report = await pub.publish(v)
            assert sorted(report.done) == sorted(spec["expect"]), report
        await leave(spec, t)


async def leave(spec: dict, t: transport.Transport) -> None:
    """Says it has published everything, then waits to be killed (``stay``) or returns, and
    the caller closes everything."""
    await t.signal(spec["notify"], "published", spec["versions"][-1])
    if spec["leave"] == "stay":
        await trio.sleep_forever()


async def main(spec: dict) -> None:
    w = torch.zeros(spec["numel"])
    async with transport.Transport(spec["name"], store=spec["store"], backends=spec.get("backends"), timeout=30) as t:
        await publish_all(spec, t, w)


if __name__ == "__main__":
    trio.run(main, json.loads(sys.argv[1]))
