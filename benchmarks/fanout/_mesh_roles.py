"""The processes of the fan-out benchmark's mesh methods (``mesh-direct``, ``mesh-relays``),
each started by :mod:`._run` on a fabric host: ``python -m benchmarks.fanout._mesh_roles ROLE
SPEC_JSON`` with ROLE ``trainer`` or ``generator``.

The state is the stream methods' Llama-shaped bf16 state (seed 0), laid out as a mesh:

* trainer ranks (``MESH_TRAINER_RANKS``, all on host T, Transports ``trainer0``,
  ``trainer1``, ...): every tensor ``Shard(0)`` over them, FSDP-style (each holds its rows
  of every tensor); each is a ``MeshPublisher(delta=False, relays=...)`` fed views of the
  full state it builds, so that both hold the same bytes;
* generator ranks: one tp=1 replica each (replica id = the process name, rank 0 of 1), every
  tensor whole (:func:`generator_layout`): each needs, from every trainer rank, the very same
  bytes; ``MeshSubscriber(relay=...)``.

Per version ``v``: every trainer rank stamps ``v`` into its state (:func:`stamp_boxes`: the
first element of every trainer rank's box of every tensor). Trainer rank 0 takes the state's
digest (untimed), takes ``time.time()``, rings ``go`` at the other ranks (each takes its own
``time.time()`` on it) and publishes; each rank, once its ``publish()`` returned, rings
``published.<rank>`` at every generator rank, as a trainer's control plane would tell the
engines. Each generator rank, its replica's leader, tries ``commit()`` when every trainer rank
said so, and besides every ``poll_s`` (as an engine would between its steps); once the version
is committed it ``apply()``s it and takes ``time.time()``: live, and signals ``live.<name>`` to
trainer rank 0. Once every replica is live, trainer rank 0 rings ``check``: each generator rank
records the stamps and the digest of every tensor it holds (untimed, and after every replica
took its time: the check slows no one measured), and signals ``checked.<name>``; then the next
version starts. The harness compares the digests with trainer rank 0's.

Each process runs torch with one intra-op thread (see :func:`main`). Every wait is bounded by
the spec's timeouts; each process writes its record as JSON to ``spec["out"]`` when it ends
normally.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._roles import _result, _state, _write

if TYPE_CHECKING:
    import torch

    import transport
    from transport.plan import GeneratorRank, TrainerLayout

MESH_TRAINER_RANKS = 2
STREAM = "fanout"  # the mesh stream's name
RETRY_S = 0.01  # a leader told that every trainer rank published, yet without the version committed: tries again


def trainer_name(rank: int) -> str:
    return f"trainer{rank}"


def shapes(spec: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The state's tensors (name -> shape), as :func:`._roles._state` makes them."""
    from benchmarks.weight_sync._models import llama_like

    return llama_like(spec["state_bytes"]).shapes()


def trainer_layout(shapes: Mapping[str, tuple[int, ...]], ranks: int) -> TrainerLayout:
    """Every tensor sharded on its rows over ``ranks`` trainer ranks, FSDP-style (bf16)."""
    from transport.plan import MeshSharding, Shard, TensorSpec, TrainerLayout

    sharding = MeshSharding((ranks,), (Shard(0),), tuple(range(ranks)))
    return TrainerLayout.of(TensorSpec(n, shape, "bfloat16", sharding) for n, shape in shapes.items())


def generator_layout(shapes: Mapping[str, tuple[int, ...]]) -> GeneratorRank:
    """A tp=1 generator rank: every tensor whole, under its own name."""
    from transport.plan import GeneratorRank, LocalTensor, Piece

    def piece(name: str, shape: tuple[int, ...]) -> Piece:
        whole = tuple((0, n) for n in shape)
        return Piece(name, whole, whole)

    return GeneratorRank.of(LocalTensor(n, shape, "bfloat16", (piece(n, shape),)) for n, shape in shapes.items())


def box_starts(layout: TrainerLayout) -> dict[str, list[tuple[int, ...]]]:
    """Tensor name -> the first index of each trainer rank's (non-empty) box of it."""
    out: dict[str, list[tuple[int, ...]]] = {}
    for spec in layout.tensors:
        boxes = spec.sharding.boxes(spec.shape).values()
        out[spec.name] = [tuple(lo for lo, _ in box) for box in boxes if all(lo < hi for lo, hi in box)]
    return out


def stamp_boxes(state: Mapping[str, torch.Tensor], starts: Mapping[str, list[tuple[int, ...]]], version: int) -> None:
    """Marks ``version`` at the first element of every trainer rank's box of every tensor, in
    place: every trainer rank's part of every tensor changes with each version."""
    from benchmarks.weight_sync._models import _STAMP_MOD

    value = float(version % _STAMP_MOD)
    for name, points in starts.items():
        for point in points:
            state[name][point] = value


def stamp_mismatches(tensors: Mapping[str, torch.Tensor], starts: Mapping[str, list[tuple[int, ...]]],
                     version: int) -> int:
    """How many tensors do not carry ``version``'s stamp at every trainer rank's box."""
    from benchmarks.weight_sync._models import _STAMP_MOD

    value = float(version % _STAMP_MOD)
    return sum(1 for name, points in starts.items() if any(float(tensors[name][p]) != value for p in points))


def digest(tensors: Mapping[str, torch.Tensor]) -> int:
    """A bit-for-bit checksum of every tensor, in name order (the same on both sides)."""
    from benchmarks.weight_sync._models import checksum

    return checksum({n: tensors[n] for n in sorted(tensors)})


def publisher_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """What the method asks of the MeshPublisher: dense versions, relays on or off (said
    explicitly both ways), and ``relay_timeout`` where the run gives one."""
    kw: dict[str, Any] = {"delta": False, "relays": bool(spec["relays"])}
    if spec["relays"] and spec.get("relay_timeout") is not None:
        kw["relay_timeout"] = spec["relay_timeout"]
    return kw


async def _signal(t: transport.Transport, peer: str, name: str, value: int, within: float) -> None:
    """Rings ``peer``'s signal, retrying while it is not up yet (bounded by ``within``)."""
    import anyio

    import transport as tr

    with anyio.fail_after(within):
        while True:
            try:
                await t.signal(peer, name, value, timeout=min(5.0, within))
                return
            except tr.TransportError:
                await anyio.sleep(0.1)


async def mesh_trainer(spec: dict[str, Any]) -> None:
    import anyio

    import transport
    from transport.weights import MeshPublisher

    rank: int = spec["rank"]
    ranks: int = spec["ranks"]
    state = _state(spec, seed=0)
    layout = trainer_layout({n: tuple(x.shape) for n, x in state.items()}, ranks)
    starts = box_starts(layout)
    shards = {s.name: state[s.name][tuple(slice(lo, hi) for lo, hi in s.sharding.boxes(s.shape)[rank])]
              for s in layout.tensors}
    gens: list[str] = spec["generators"]
    others = [trainer_name(r) for r in range(1, ranks)]
    versions: list[dict[str, Any]] = []
    record: dict[str, Any] = {"rank": rank, "versions": versions, "pid": os.getpid(), "hostname": socket.gethostname()}
    record["publisher_kwargs"] = kwargs = publisher_kwargs(spec)
    within = spec["start_timeout"]
    async with transport.Transport(trainer_name(rank), store=spec["store"], listen=spec["listen"],
                                   backends=tuple(spec["backends"]), timeout=spec["timeout"]) as t:

        async def ring(names: list[str], signal: str, value: int) -> None:
            async def one(name: str) -> None:
                await t.signal(name, signal, value, timeout=within)

            async with anyio.create_task_group() as tg:
                for name in names:
                    tg.start_soon(one, name)

        async def every(signal: str, value: int) -> None:
            for g in gens:
                await t.wait_signal(f"{signal}.{g}", at_least=value, timeout=spec["version_timeout"])

        async with MeshPublisher(t, STREAM, shards, layout, rank=rank, deadline=spec["deadline"], **kwargs) as pub:
            if rank != 0:
                await _signal(t, trainer_name(0), f"ready.{t.name}", 1, within)
            else:
                for who in [*gens, *others]:
                    await t.wait_signal(f"ready.{who}", at_least=1, timeout=within)
            for v in range(1, spec["versions"] + 1):
                row: dict[str, Any] = {"version": v}
                stamp_boxes(state, starts, v)  # (every rank stamps its copy of the state alike)
                if rank == 0:
                    row["digest"] = str(digest(state))  # (as text: a JSON reader may not keep a 61-bit int)
                    row["t0"] = time.time()
                    await ring(others, "go", v)
                else:
                    await t.wait_signal("go", at_least=v, timeout=spec["version_timeout"])
                    row["t0"] = time.time()
                report = await pub.publish(v)
                row["publish_end"] = time.time()
                await ring(gens, f"published.{rank}", v)
                row.update(publish_s=report.total_s, push_s=report.push_s, incomplete=list(report.incomplete),
                           results={k: _result(r) for k, r in report.results.items()})
                versions.append(row)
                if rank == 0:
                    await every("live", v)
                    row["all_live"] = time.time()
                    await ring(gens, "check", v)
                    await every("checked", v)
            # What the relays did (each relayed version; a failed relay; a member pushed to without it).
            record["relay_events"] = [e for e in t.flight_record()["events"] if e["event"].startswith("relay")]
            if rank == 0:  # (the other ranks keep their publishers until every version was checked)
                await ring(gens, "stop", 1)
                await ring(others, "go", spec["versions"] + 1)
            else:
                await t.wait_signal("go", at_least=spec["versions"] + 1, timeout=spec["run_timeout"])
    _write(spec, record)


async def mesh_generator(spec: dict[str, Any]) -> None:
    import anyio
    import trio

    import transport
    from transport.weights import CommitError, MeshSubscriber

    layout = generator_layout(shapes(spec))  # (the subscriber allocates the tensors)
    starts = box_starts(trainer_layout(shapes(spec), spec["ranks"]))
    name: str = spec["name"]
    leader = trainer_name(0)
    published = [f"published.{r}" for r in range(spec["ranks"])]
    lives: list[dict[str, Any]] = []
    tries = {"calls": 0, "seconds": 0.0}
    record: dict[str, Any] = {"name": name, "lives": lives, "pid": os.getpid(), "hostname": socket.gethostname(),
                              "poll_s": spec["poll_s"], "commit": tries}
    async with transport.Transport(name, store=spec["store"], listen=spec["listen"],
                                   backends=tuple(spec["backends"]), timeout=spec["timeout"]) as t:
        async with MeshSubscriber(t, STREAM, replica=name, rank=0, size=1, layout=layout, timeout=spec["timeout"],
                                  delta=False, relay=bool(spec["relays"])) as sub:

            last: dict[str, float] = {}

            async def commit() -> int | None:
                last["began"] = time.time()
                try:
                    got = await sub.commit()
                except (CommitError, transport.TransportError):  # e.g. no trainer rank listed yet: tried again
                    got = None
                last["ended"] = time.time()
                tries["calls"] += 1
                tries["seconds"] += last["ended"] - last["began"]
                return got

            async def wake(v: int) -> None:
                """Until every trainer rank said its publish of ``v`` returned, at most ``poll_s``."""
                if all((t.signal_value(s) or 0) >= v for s in published):
                    await anyio.sleep(RETRY_S)
                    return
                with anyio.move_on_after(spec["poll_s"]):
                    for s in published:
                        await t.wait_signal(s, at_least=v, timeout=spec["version_timeout"])
                    last["told"] = time.time()

            async def follow() -> None:
                for v in range(1, spec["versions"] + 1):
                    last.pop("told", None)
                    with anyio.fail_after(spec["version_timeout"]):
                        while (got := await commit()) is None or got < v:
                            await wake(v)
                    cpu = time.thread_time()
                    applied = sub.apply()
                    at = time.time()
                    # Where the time after the publishes went: when the trainer ranks were seen to have
                    # published, when the commit that took the version began and ended, the apply's CPU time.
                    when = {"told": last.get("told"), "commit_began": last["began"], "committed": last["ended"],
                            "apply_cpu_s": time.thread_time() - cpu}
                    if applied is None:
                        raise RuntimeError(f"{name}: version {got} committed, but apply() applied nothing")
                    await t.signal(leader, f"live.{name}", applied, timeout=spec["start_timeout"])
                    await t.wait_signal("check", at_least=v, timeout=spec["version_timeout"])
                    lives.append({"version": applied, "at": at, **when,
                                  "torn_tensors": stamp_mismatches(sub.tensors, starts, applied),
                                  "digest": str(digest(sub.tensors))})
                    await t.signal(leader, f"checked.{name}", applied, timeout=spec["start_timeout"])

            async def stop(cancel: trio.CancelScope) -> None:
                await t.wait_signal("stop", at_least=1, timeout=spec["run_timeout"])
                cancel.cancel()

            await _signal(t, leader, f"ready.{name}", 1, spec["start_timeout"])
            async with trio.open_nursery() as n:
                n.start_soon(follow)
                n.start_soon(stop, n.cancel_scope)
            # What it copied as a relay member (one ``relayed`` event per order, and how it ended).
            record["relay_events"] = [e for e in t.flight_record()["events"] if e["event"].startswith("relay")]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record["cpu_s"] = usage.ru_utime + usage.ru_stime
    _write(spec, record)


def main(argv: list[str] | None = None) -> None:
    import torch
    import trio

    args = sys.argv[1:] if argv is None else argv
    role, spec = args[0], json.loads(args[1])
    if role not in ("trainer", "generator"):
        raise SystemExit(f"unknown role {role!r}")
    # One intra-op thread: eight such processes share this machine's cores, where each would have
    # cores of its own. With torch's default (a thread per core), replicas applying at once
    # oversubscribe the cores with spinning OpenMP threads, and the time measured is theirs.
    torch.set_num_threads(1)
    trio.run(mesh_trainer if role == "trainer" else mesh_generator, spec)


if __name__ == "__main__":
    main()
