"""The processes of the fan-out benchmark, each started on a fabric host by :mod:`._run`:
``python -m benchmarks.fanout._roles ROLE SPEC_JSON``.

* ``trainer``: a ``transport.weights.Publisher`` (dense versions, ``delta=False``) that
  publishes ``versions`` stamped versions once every generator said ready, and after each waits
  until every generator (but a fault's victim) signalled it live; it records each publish's
  start (``time.time()``), its report, and, in a fault run, when it stopped or killed the victim
  (during the last version; the harness kills the victim once the others are done).
* ``generator``: a ``Subscriber`` that waits for versions 1..N, records when each
  ``wait_version`` returned (``time.time()``: every process runs on this one machine, so the
  clocks are one) and whether every tensor carries the version's stamp, and signals the trainer.
* ``gloo``: one rank of a ``torch.distributed`` gloo group: rank 0 on T broadcasts each version
  in buckets (:class:`benchmarks.weight_sync._broadcast.BucketedBroadcast`) after a barrier;
  every rank records when its broadcast returned.
* ``stream-recv`` / ``stream-send``: a plain TCP stream of ``nbytes`` (the reference for what
  one shaped link carries).

Each writes its record as JSON to ``spec["out"]`` when it ends normally; the harness quotes the
log of one that did not. Every wait is bounded by the spec's timeouts.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

STREAM_BLOCK = 1 << 20


def _write(spec: dict[str, Any], record: dict[str, Any]) -> None:
    tmp = Path(spec["out"] + ".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(spec["out"])


def _accepts(fn: Any, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def _state(spec: dict[str, Any], seed: int | None) -> dict[str, Any]:
    from benchmarks.weight_sync._models import llama_like, make_state

    return make_state(llama_like(spec["state_bytes"]), seed=seed)


# ---- transport.weights ----------------------------------------------------------------------

def publisher_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """What the method asks of the Publisher: relays on (``relays=True``, and ``relay_timeout``
    where the run gives one) or off. Off is said explicitly where this library's Publisher has the switch (a library
    without relays pushes directly anyway); on is always said, so a library without relays
    fails with TypeError rather than measuring direct pushes under the name of relays."""
    from transport.weights import Publisher

    if spec["relays"]:
        kw: dict[str, Any] = {"relays": True}
        if spec.get("relay_timeout") is not None:
            kw["relay_timeout"] = spec["relay_timeout"]
        return kw
    return {"relays": False} if _accepts(Publisher.__init__, "relays") else {}


def subscriber_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """``relay=True`` / ``relay=False`` as :func:`publisher_kwargs`."""
    from transport.weights import Subscriber

    if spec["relays"]:
        return {"relay": True}
    return {"relay": False} if _accepts(Subscriber.__init__, "relay") else {}


def _result(r: Any) -> dict[str, Any]:
    """A SyncResult as JSON (with ``relayed_by`` where this library reports it)."""
    return {"status": getattr(r.status, "value", str(r.status)), "seconds": r.seconds, "nbytes": r.nbytes,
            "error": r.error, "relayed_by": getattr(r, "relayed_by", None)}


async def trainer(spec: dict[str, Any]) -> None:
    import trio

    import transport
    from benchmarks.weight_sync._models import stamp
    from transport.weights import Publisher

    state = _state(spec, seed=0)
    fault: dict[str, Any] | None = spec.get("fault")
    gens: list[str] = spec["generators"]
    versions: list[dict[str, Any]] = []
    record: dict[str, Any] = {"versions": versions, "pid": os.getpid(), "hostname": socket.gethostname()}
    record["publisher_kwargs"] = kwargs = publisher_kwargs(spec)
    async with transport.Transport("trainer", store=spec["store"], listen=spec["listen"],
                                   backends=tuple(spec["backends"]), timeout=spec["timeout"]) as t:
        async with Publisher(t, state, delta=False, deadline=spec["deadline"], **kwargs) as pub:
            for g in gens:
                await t.wait_signal(f"ready.{g}", at_least=1, timeout=spec["start_timeout"])
            for v in range(1, spec["versions"] + 1):
                stamp(state, v)
                faulty = fault is not None and v == spec["versions"]  # the last version
                row: dict[str, Any] = {"version": v}
                async with trio.open_nursery() as n:
                    if faulty and fault is not None:
                        n.start_soon(_inject, fault, row)
                    row["t0"] = time.time()
                    report = await pub.publish(v)
                    row["publish_end"] = time.time()
                    n.cancel_scope.cancel()  # an injection not yet due (the publish was faster): none
                row.update(publish_s=report.total_s, push_s=report.push_s,
                           results={k: _result(r) for k, r in report.results.items()})
                for g in gens:
                    if fault is not None and faulty and g == fault["victim"]:
                        continue
                    await t.wait_signal(f"live.{g}", at_least=v, timeout=spec["version_timeout"])
                row["all_live"] = time.time()
                versions.append(row)
            for g in gens:
                if fault is None or g != fault["victim"]:  # the harness kills the victim
                    await t.signal(g, "stop", 1, timeout=spec["start_timeout"])
    _write(spec, record)


async def _inject(fault: dict[str, Any], row: dict[str, Any]) -> None:
    import trio

    await trio.sleep(fault["after_s"])
    os.kill(fault["pid"], getattr(signal, fault["signal"]))
    row["injected_at"] = time.time()


async def generator(spec: dict[str, Any]) -> None:
    import trio

    import transport
    from benchmarks.weight_sync._models import stamp_mismatches
    from transport.weights import Subscriber

    model = _state(spec, seed=None)
    lives: list[dict[str, Any]] = []
    record: dict[str, Any] = {"name": spec["name"], "lives": lives, "pid": os.getpid(),
                              "hostname": socket.gethostname()}
    async with transport.Transport(spec["name"], store=spec["store"], listen=spec["listen"],
                                   backends=tuple(spec["backends"]), timeout=spec["timeout"]) as t:
        async with Subscriber(t, model, publisher="trainer", **subscriber_kwargs(spec)) as sub:
            async def follow() -> None:
                for v in range(1, spec["versions"] + 1):
                    got = await sub.wait_version(v, timeout=spec["version_timeout"])
                    at = time.time()
                    lives.append({"version": got, "at": at, "torn_tensors": stamp_mismatches(model, got)})
                    await t.signal("trainer", f"live.{spec['name']}", got)

            async def stop(cancel: trio.CancelScope) -> None:
                await t.wait_signal("stop", at_least=1, timeout=spec["run_timeout"])
                cancel.cancel()

            await t.signal("trainer", f"ready.{spec['name']}", 1, timeout=spec["start_timeout"])
            async with trio.open_nursery() as n:
                n.start_soon(follow)
                n.start_soon(stop, n.cancel_scope)
    _write(spec, record)


# ---- gloo -----------------------------------------------------------------------------------

def gloo(spec: dict[str, Any]) -> None:
    import datetime

    import torch.distributed as dist

    from benchmarks.weight_sync._broadcast import BucketedBroadcast
    from benchmarks.weight_sync._models import stamp, stamp_mismatches

    rank = spec["rank"]
    state = _state(spec, seed=0 if rank == 0 else None)
    dist.init_process_group("gloo", init_method=spec["init_method"], rank=rank, world_size=spec["world_size"],
                            timeout=datetime.timedelta(seconds=spec["timeout"]))
    try:
        bcast = BucketedBroadcast(list(state.values()), spec["bucket_bytes"])
        rows = []
        for v in range(1, spec["versions"] + 1):
            if rank == 0:
                stamp(state, v)
            dist.barrier()
            t0 = time.time()
            bcast(rank)
            at = time.time()
            rows.append({"version": v, "t0": t0, "at": at, "torn_tensors": stamp_mismatches(state, v)})
        dist.barrier()
    finally:
        dist.destroy_process_group()
    _write(spec, {"rank": rank, "rows": rows, "hostname": socket.gethostname()})


# ---- plain socket stream --------------------------------------------------------------------

def stream_recv(spec: dict[str, Any]) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((spec["addr"], spec["port"]))
    srv.listen(1)
    srv.settimeout(spec["timeout"])
    conn, _ = srv.accept()
    conn.settimeout(spec["timeout"])
    buf = bytearray(STREAM_BLOCK)
    got, first = 0, None
    while True:
        k = conn.recv_into(buf)
        if not k:
            break
        if first is None:
            first = time.time()
        got += k
    _write(spec, {"bytes": got, "first_at": first, "end_at": time.time()})


def stream_send(spec: dict[str, Any]) -> None:
    deadline = time.monotonic() + spec["timeout"]
    while True:  # the receiver may still be starting
        try:
            conn = socket.create_connection((spec["addr"], spec["port"]), timeout=spec["timeout"])
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    start = time.time()
    block = b"\x5a" * STREAM_BLOCK
    left = spec["nbytes"]
    while left > 0:
        conn.sendall(block[: min(left, STREAM_BLOCK)])
        left -= min(left, STREAM_BLOCK)
    conn.close()
    _write(spec, {"start_at": start, "bytes": spec["nbytes"]})


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    role, spec = args[0], json.loads(args[1])
    if role in ("trainer", "generator"):
        import trio

        trio.run(trainer if role == "trainer" else generator, spec)
    elif role == "gloo":
        gloo(spec)
    elif role == "stream-recv":
        stream_recv(spec)
    elif role == "stream-send":
        stream_send(spec)
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main()
