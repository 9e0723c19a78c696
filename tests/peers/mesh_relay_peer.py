"""A trainer rank or a generator rank of a mesh stream for the mesh relay tests, as a real
process on a "host" of the test fabric: ``python -m tests.peers.mesh_relay_peer SPEC_JSON``.

Its backends are ``ipc`` and ``tcp`` (``spec["backends"]``): UCX would reach the other
"hosts" through shared memory, around the shaped links. It drives itself and reports on stdout,
one JSON object a line (the test reads them as they come). The model is
:mod:`tests.peers.mesh_peer`'s, with ``w8`` as large as ``spec["w8"]``.

* ``role: "trainer"``: waits for every generator rank's ``ready.<name>`` signal, then publishes
  ``versions`` versions, ``pause`` seconds apart (with ``lockstep``: and each only once every
  generator rank, or those it names, said it applied the one before: its ``applied.<name>``
  signal, within 60 s),
  printing ``{"publishing": v}`` before each and
  ``{"rank": r, "version": v, "results": {label: [status, relayed_by, delta, error]}}`` after.
  Before each push into a relay it prints ``{"relaying": v, "relay": name, "rank": r}``.
  Then it rings ``stop`` at every generator rank, waits for their ``finished`` (bounded), and
  dumps its flight record.
* ``role: "gen"``: commits (the leader) or waits for commits, applies each, checks its tensors
  bit for bit against the reference slices of the version applied and prints
  ``{"applied": v, "ok": bool, "delta": [...]}``, then sets its ``applied.<name>`` signal at
  each trainer rank to ``v + 1``; it ends at the last version, or 10 s after
  ``stop`` without it, printing ``{"summary": true, "applied": v, "followed": n, "refused":
  [...]}`` (its flight recorder's relay orders that did not end DONE, with why).
"""

from __future__ import annotations

import json
import sys
import time

import anyio
import torch

import transport
import transport.weights._mesh_relays as mesh_relays
from tests.peers import mesh_peer
from transport.weights import CommitError, DeltaRefusedError, MeshPublisher, MeshSubscriber


async def _signal(t: transport.Transport, peer: str, name: str, value: int, within: float = 60.0) -> None:
    """Rings ``peer``'s signal, waiting for it to be up (bounded)."""
    with anyio.fail_after(within):
        while True:
            try:
                await t.signal(peer, name, value, timeout=5)
                return
            except transport.TransportError:
                await anyio.sleep(0.1)


async def trainer(spec: dict, t: transport.Transport) -> None:
    rank = spec["rank"]
    lay = mesh_peer.layout()
    boxes = {s.name: s.sharding.boxes(s.shape)[rank] for s in lay.tensors}

    def shards(version: int) -> dict[str, torch.Tensor]:
        f = mesh_peer.full(version)
        return {n: f[n][tuple(slice(lo, hi) for lo, hi in boxes[n])].contiguous() for n in boxes}

    live = shards(0)
    pub = MeshPublisher(t, "m", live, lay, rank=rank, deadline=spec.get("deadline", 10.0),
                        delta=spec.get("delta", "auto"), relays=spec.get("relays", True),
                        relay_timeout=spec.get("relay_timeout"))
    await pub.start()
    if pub._relays is not None:  # says when a push into a relay starts (the fault tests time their faults by it)
        push_relay = pub._relays._push_relay

        async def announced(peer, moves, version, *args):  # type: ignore[no-untyped-def]
            print(json.dumps({"relaying": version, "relay": peer.name, "rank": rank}), flush=True)
            return await push_relay(peer, moves, version, *args)

        pub._relays._push_relay = announced  # type: ignore[method-assign]
    for g in spec["generators"]:
        await t.wait_signal(f"ready.{g}", timeout=120)
    for v in range(spec["versions"]):
        for n, x in shards(v).items():
            live[n].copy_(x)
        await anyio.sleep(spec.get("pause", 0.0))
        lockstep = spec.get("lockstep")
        if lockstep and v > 0:  # (else a rank still applying v - 2 there is a straggler)
            for g in spec["generators"] if lockstep is True else lockstep:
                await t.wait_signal(f"applied.{g}", at_least=v, timeout=60)
        print(json.dumps({"publishing": v, "rank": rank, "at": time.time()}), flush=True)
        rep = await pub.publish(v)
        results = {k: [r.status.value, r.relayed_by, r.delta, r.error] for k, r in rep.results.items()}
        print(json.dumps({"rank": rank, "version": v, "results": results}), flush=True)
    for g in spec["generators"]:
        try:
            await t.signal(g, "stop", 1, timeout=5)
        except transport.TransportError:
            pass
    try:
        await t.wait_signal("finished", at_least=spec.get("finishers", len(spec["generators"])), timeout=30)
    except transport.TransferTimeoutError:
        pass
    t.dump_flight_record("mesh relay trainer done")
    pub.close()


async def generator(spec: dict, t: transport.Transport) -> None:
    g = mesh_peer.generator_layout(spec["size"], spec["rank"])
    sub = MeshSubscriber(t, "m", replica=spec["replica"], rank=spec["rank"], size=spec["size"], layout=g,
                         timeout=30, relay=spec.get("relay", True))
    await sub.start()
    for tr in spec["trainers"]:
        await _signal(t, tr, f"ready.{spec['name']}", 1)
    last, applied, stop_at = spec["versions"] - 1, None, None
    while applied != last:
        committed = None
        try:
            if spec["rank"] == 0:
                committed = await sub.commit(timeout=5)
            else:
                committed = await sub.wait_committed(-1 if applied is None else applied + 1, timeout=0.5)
        except (CommitError, transport.TransportError):
            pass
        if committed is not None and committed != applied:
            try:
                got = sub.apply()
            except DeltaRefusedError:
                await sub.pull(version=committed, timeout=30)
                got = sub.apply()
            if got is not None and got != applied:
                ref = mesh_peer.reference(g, got)
                ok = all(torch.equal(sub.tensors[n].view(torch.uint8), ref[n].view(torch.uint8)) for n in ref)
                doc = {"applied": got, "ok": ok, "delta": list(sub.last_delta)}
                if not ok:  # where it differs: tensor -> (elements, first rows)
                    doc["wrong"] = {n: [int((sub.tensors[n] != ref[n]).sum()),
                                        sorted({int(i) for i in (sub.tensors[n] != ref[n]).nonzero()[:, 0][:50]})[:8]]
                                    for n in ref if not torch.equal(sub.tensors[n], ref[n])}
                print(json.dumps(doc), flush=True)
                applied = got
                for tr in spec["trainers"]:
                    try:
                        await t.signal(tr, f"applied.{spec['name']}", got + 1, timeout=5)
                    except transport.TransportError:
                        pass
        if t.signal_value("stop"):
            stop_at = stop_at or time.monotonic()
            if time.monotonic() - stop_at > 10:
                break
        await anyio.sleep(0.02)
    member = sub._relay
    refused = [e["detail"] for e in t.flight_record()["events"]
               if e["event"] == "relayed" and "DONE" not in e["detail"]]
    print(json.dumps({"summary": True, "applied": applied, "followed": member.followed if member else 0,
                      "refused": refused}), flush=True)
    for tr in spec["trainers"]:
        try:
            await t.signal(tr, "finished", time.time_ns(), timeout=5)
        except transport.TransportError:
            pass
    sub.close()


async def main(spec: dict) -> None:
    mesh_peer.SHAPES["w8"] = tuple(spec.get("w8", mesh_peer.SHAPES["w8"]))
    mesh_peer.SPARSE = spec.get("sparse")
    if spec.get("piece_bytes"):
        mesh_relays.PIECE_BYTES = spec["piece_bytes"]
    async with transport.Transport(spec["name"], store=spec["store"], listen=spec.get("listen"), timeout=30,
                                   flight_dir=spec.get("flight"), backends=tuple(spec.get("backends", ("ipc", "tcp")))
                                   ) as t:
        await (trainer(spec, t) if spec["role"] == "trainer" else generator(spec, t))


if __name__ == "__main__":
    anyio.run(main, json.loads(sys.argv[1]), backend="trio")
