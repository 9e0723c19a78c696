"""A trainer rank or a generator rank of a mesh stream, as a real process, for the mesh tests.

``python -m tests.mesh_peer SPEC_JSON``. Rounds are driven by the test process (peer ``ctl``)
with signals: ``go`` = v + 1 starts round v here; this process answers ``<name>.done`` = v + 1.
Trainer ranks publish version v of :func:`full` (deterministic, so every process can compute
the reference); generator ranks commit (the leader) or wait for the commit, apply, and check
their tensors bit for bit against the reference slices of the version they applied. Results go
to ``SPEC["out"]`` as JSON when the test rings ``exit``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import anyio
import torch

import transport
from transport.plan import (
    GeneratorRank,
    LocalTensor,
    MeshSharding,
    Piece,
    Replicate,
    Shard,
    TensorSpec,
    TrainerLayout,
)
from transport.weights import CommitError, MeshPublisher, MeshSubscriber

SHAPES = {"a": (64, 48), "b": (5,), "c": (30, 14)}
TRAINERS = 2


def layout() -> TrainerLayout:
    """``a`` and ``c`` sharded over the two trainer ranks (``c`` on its columns, unevenly
    sized pieces for the generators), ``b`` replicated on both."""
    ranks = tuple(range(TRAINERS))
    return TrainerLayout.of([
        TensorSpec("a", SHAPES["a"], "float32", MeshSharding((TRAINERS,), (Shard(0),), ranks)),
        TensorSpec("b", SHAPES["b"], "float32", MeshSharding((TRAINERS,), (Replicate(),), ranks)),
        TensorSpec("c", SHAPES["c"], "float32", MeshSharding((TRAINERS,), (Shard(1),), ranks)),
    ])


def full(version: int) -> dict[str, torch.Tensor]:
    """The global tensors of ``version``."""
    out = {}
    for i, (name, shape) in enumerate(sorted(SHAPES.items())):
        g = torch.Generator().manual_seed(1000 * version + i)
        out[name] = torch.randn(shape, generator=g)
    return out


def generator_layout(tp: int, rank: int) -> GeneratorRank:
    """TP rank ``rank`` of ``tp``: a column block of ``a`` (column-parallel), a row block of
    ``c`` (cut across the trainers' column shards) with two padding rows, ``b`` whole (a norm)."""
    ca, rc = SHAPES["a"][1] // tp, SHAPES["c"][0] // tp
    rows_a, cols_c = SHAPES["a"][0], SHAPES["c"][1]
    a_local = LocalTensor("a_cols", (rows_a, ca), "float32",
                          (Piece("a", ((0, rows_a), (rank * ca, (rank + 1) * ca)), ((0, rows_a), (0, ca))),))
    c_local = LocalTensor("c_rows", (rc + 2, cols_c), "float32",
                          (Piece("c", ((rank * rc, (rank + 1) * rc), (0, cols_c)), ((0, rc), (0, cols_c))),))
    b_local = LocalTensor("b", SHAPES["b"], "float32", (Piece("b", ((0, SHAPES["b"][0]),), ((0, SHAPES["b"][0]),)),))
    return GeneratorRank.of([a_local, b_local, c_local])


def reference(g: GeneratorRank, version: int) -> dict[str, torch.Tensor]:
    src = full(version)
    out = {}
    for lt in g.tensors:
        t = torch.zeros(lt.shape)
        for p in lt.pieces:
            t[tuple(slice(lo, hi) for lo, hi in p.local)] = src[p.name][tuple(slice(lo, hi) for lo, hi in p.box)]
        out[lt.name] = t
    return out


async def trainer(spec: dict, t: transport.Transport) -> dict:
    rank = spec["rank"]
    lay = layout()
    boxes = {s.name: s.sharding.boxes(s.shape)[rank] for s in lay.tensors}

    def shards(version: int) -> dict[str, torch.Tensor]:
        f = full(version)
        return {n: f[n][tuple(slice(lo, hi) for lo, hi in boxes[n])].contiguous() for n in boxes}

    live = shards(0)
    reports, incomplete = [], []
    pub = MeshPublisher(t, "m", live, lay, rank=rank, deadline=spec.get("deadline", 10.0))
    pub.start()
    if spec.get("die_at") is not None:
        real_prepare = pub._prepare

        def prepare(*args, **kwargs):
            prepared = real_prepare(*args, **kwargs)
            version = spec["die_at"]

            class Dying:
                def start(self, **kw):
                    xfer = prepared.start(**kw)
                    if pub._version == version:  # mid-push: the done word is never written
                        os.kill(os.getpid(), signal.SIGKILL)
                    return xfer
            return Dying()

        pub._prepare = prepare  # type: ignore[method-assign]
    await t.signal("ctl", f"{spec['name']}.ready", spec.get("ready_value", 1))
    for v in range(spec["versions"]):
        await t.wait_signal("go", at_least=v + 1, timeout=120)
        for n, x in shards(v).items():
            live[n].copy_(x)
        rep = await pub.publish(v)
        reports.append({k: [r.status.name, r.error] for k, r in rep.results.items()})
        incomplete.append(list(rep.incomplete))
        await t.signal("ctl", f"{spec['name']}.done", v + 1)
    return {"reports": reports, "incomplete": incomplete}


async def generator(spec: dict, t: transport.Transport) -> dict:
    g = generator_layout(spec["size"], spec["rank"])
    sub = MeshSubscriber(t, "m", replica=spec["replica"], rank=spec["rank"], size=spec["size"], layout=g, timeout=30)
    sub.start()
    rounds = []
    first = spec.get("first", 0)
    if spec.get("pull"):
        pulled = await sub.pull(timeout=60)
        rounds.append({"pulled": pulled})
    await t.signal("ctl", f"{spec['name']}.ready", spec.get("ready_value", 1))
    for v in range(first, spec["versions"]):
        await t.wait_signal("go", at_least=v + 1, timeout=120)
        committed = None
        if spec["rank"] == 0:
            with anyio.move_on_after(spec.get("commit_wait", 10.0)):
                while True:
                    try:
                        committed = await sub.commit(timeout=10)
                    except (CommitError, transport.TransportError) as exc:
                        committed = f"{type(exc).__name__}: {exc}"
                        break
                    if committed is not None and committed >= v:
                        break
                    await anyio.sleep(0.01)
        else:
            try:
                committed = await sub.wait_committed(v, timeout=spec.get("commit_wait", 10.0))
            except transport.TransferTimeoutError:
                committed = sub.committed()
        if spec.get("slow_s"):
            await anyio.sleep(spec["slow_s"])
        applied = sub.apply()
        ok = None
        if applied is not None:
            ref = reference(g, applied)
            ok = all(torch.equal(sub.tensors[n], ref[n]) for n in ref)
        rounds.append({"version": v, "committed": committed, "applied": applied, "ok": ok})
        await t.signal("ctl", f"{spec['name']}.done", v + 1)
    return {"rounds": rounds}


async def main(spec: dict) -> None:
    async with transport.Transport(spec["name"], store=spec["store"], backends=tuple(spec["backends"]),
                                   timeout=30) as t:
        out = await (trainer(spec, t) if spec["role"] == "trainer" else generator(spec, t))
        await t.wait_signal("exit", timeout=300)
    Path(spec["out"]).write_text(json.dumps(out))


if __name__ == "__main__":
    anyio.run(main, json.loads(sys.argv[1]), backend="trio")
