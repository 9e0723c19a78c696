"""A trainer rank or a generator rank of a mesh stream, as a real process, for the mesh tests.

``python -m tests.peers.mesh_peer SPEC_JSON``. Rounds are driven by the test process (peer ``ctl``)
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
    fp8_generator_rank,
    fp8_trainer_layout,
)
from transport.weights import CommitError, DeltaRefusedError, MeshPublisher, MeshSubscriber
from transport.weights._codec.policy import RUNS_CROSSOVER
from transport.weights._mesh_control import MAT0

SHAPES = {"a": (64, 48), "b": (5,), "c": (30, 14), "w8": (300, 260)}
TRAINERS = 2
SPARSE: float | None = None  # spec["sparse"]: each version changes this fraction of every tensor


def layout(fp8: bool = False) -> TrainerLayout:
    """``a`` and ``c`` sharded over the two trainer ranks (``c`` on its columns, unevenly
    sized pieces for the generators), ``b`` replicated on both; ``w8`` sharded on its rows, which
    cuts its second row of 128x128 blocks in two (with ``fp8``: sent as FP8 with block scales)."""
    ranks = tuple(range(TRAINERS))
    out = TrainerLayout.of([
        TensorSpec("a", SHAPES["a"], "float32", MeshSharding((TRAINERS,), (Shard(0),), ranks)),
        TensorSpec("b", SHAPES["b"], "float32", MeshSharding((TRAINERS,), (Replicate(),), ranks)),
        TensorSpec("c", SHAPES["c"], "float32", MeshSharding((TRAINERS,), (Shard(1),), ranks)),
        TensorSpec("w8", SHAPES["w8"], "float32", MeshSharding((TRAINERS,), (Shard(0),), ranks)),
    ])
    return fp8_trainer_layout(out, select=lambda t: t.name == "w8") if fp8 else out


def quantize_whole(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 values and 128x128 block scales of a whole tensor (the reference quantizer)."""
    rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
    padded = torch.zeros(rows * 128, cols * 128)
    padded[: w.shape[0], : w.shape[1]] = w
    scale = (padded.view(rows, 128, cols, 128).abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    q = (padded.view(rows, 128, cols, 128) / scale[:, None, :, None]).view(rows * 128, cols * 128)
    return q[: w.shape[0], : w.shape[1]].to(torch.float8_e4m3fn), scale


def full(version: int) -> dict[str, torch.Tensor]:
    """The global tensors of ``version``: fresh random ones, or with ``SPARSE`` those of version
    0 with that fraction of elements set anew by each later version (as a small update does)."""
    out = {}
    for i, (name, shape) in enumerate(sorted(SHAPES.items())):
        g = torch.Generator().manual_seed(1000 * (0 if SPARSE else version) + i)
        out[name] = torch.randn(shape, generator=g)
        for k in range(1, version + 1 if SPARSE else 0):
            g = torch.Generator().manual_seed(7919 * k + i)
            flat = out[name].view(-1)
            where = torch.rand(flat.numel(), generator=g) < SPARSE
            flat[where] = torch.randn(int(where.sum()), generator=g)
    return out


def generator_layout(tp: int, rank: int, fp8: bool = False) -> GeneratorRank:
    """TP rank ``rank`` of ``tp``: a column block of ``a`` (column-parallel), a row block of
    ``c`` (cut across the trainers' column shards) with two padding rows, ``b`` whole (a norm),
    and ``w8``'s columns from ``128 * rank`` (all of them for tp=1), with its block scales when
    ``fp8``."""
    ca, rc = SHAPES["a"][1] // tp, SHAPES["c"][0] // tp
    rows_a, cols_c = SHAPES["a"][0], SHAPES["c"][1]
    a_local = LocalTensor("a_cols", (rows_a, ca), "float32",
                          (Piece("a", ((0, rows_a), (rank * ca, (rank + 1) * ca)), ((0, rows_a), (0, ca))),))
    c_local = LocalTensor("c_rows", (rc + 2, cols_c), "float32",
                          (Piece("c", ((rank * rc, (rank + 1) * rc), (0, cols_c)), ((0, rc), (0, cols_c))),))
    b_local = LocalTensor("b", SHAPES["b"], "float32", (Piece("b", ((0, SHAPES["b"][0]),), ((0, SHAPES["b"][0]),)),))
    r8, c8 = SHAPES["w8"]
    lo, hi = (0, c8) if tp == 1 else (128 * rank, c8 if rank == tp - 1 else 128 * (rank + 1))
    w8 = LocalTensor("w8_cols", (r8, hi - lo), "float8_e4m3fn" if fp8 else "float32",
                     (Piece("w8", ((0, r8), (lo, hi)), ((0, r8), (0, hi - lo))),))
    g = GeneratorRank.of([a_local, b_local, c_local, w8])
    return fp8_generator_rank(g, layout(fp8=True)) if fp8 else g


def reference(g: GeneratorRank, version: int) -> dict[str, torch.Tensor]:
    """Every local tensor of ``g`` cut from the global tensors of ``version`` (FP8 ones from the
    whole-tensor quantizer's values and scales)."""
    src = full(version)
    q8, scales = quantize_whole(src["w8"])
    out = {}
    for lt in g.tensors:
        fp8 = lt.dtype == "float8_e4m3fn"
        t = torch.zeros(lt.shape, dtype=getattr(torch, lt.dtype))
        for p in lt.pieces:
            whole = q8.view(torch.uint8) if fp8 else scales if p.name == "w8_scale_inv" else src[p.name]
            dst = t[tuple(slice(lo, hi) for lo, hi in p.local)]
            (dst.view(torch.uint8) if fp8 else dst).copy_(whole[tuple(slice(lo, hi) for lo, hi in p.box)])
        out[lt.name] = t
    return out


async def trainer(spec: dict, t: transport.Transport) -> dict:
    rank = spec["rank"]
    lay = layout(spec.get("fp8", False))
    boxes = {s.name: s.sharding.boxes(s.shape)[rank] for s in lay.tensors if s.scale_of is None}

    def shards(version: int) -> dict[str, torch.Tensor]:
        f = full(version)
        return {n: f[n][tuple(slice(lo, hi) for lo, hi in boxes[n])].contiguous() for n in boxes}

    live = shards(0)
    reports, incomplete, changed, warmed, departed = [], [], [], [], []
    # These tests check the protocol: a version goes as a delta wherever the words allow (the
    # crossover given, as it was the default); the measured one is tested in test_mesh_crossover.py.
    pub = MeshPublisher(t, "m", live, lay, rank=rank, deadline=spec.get("deadline", 10.0),
                        delta=spec.get("delta", "auto"), delta_crossover=RUNS_CROSSOVER)
    await pub.start()
    if spec.get("die_at") is not None:
        real_prepare = pub._pushes.prepare

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

        pub._pushes.prepare = prepare  # type: ignore[method-assign]
    await t.signal("ctl", f"{spec['name']}.ready", spec.get("ready_value", 1))
    for v in range(spec["versions"]):
        await t.wait_signal("go", at_least=v + 1, timeout=120)
        for n, x in shards(v).items():
            live[n].copy_(x)
        if spec.get("warm"):
            warmed.append(await pub.warm())
        rep = await pub.publish(v)
        reports.append({k: [r.status.name, r.error, r.delta, r.nbytes] for k, r in rep.results.items()})
        incomplete.append(list(rep.incomplete))
        changed.append(rep.changed)
        departed.append({"left": list(rep.left), "dead": sorted(rep.dead)})
        await t.signal("ctl", f"{spec['name']}.done", v + 1)
    return {"reports": reports, "incomplete": incomplete, "changed": changed, "warmed": warmed, "departed": departed}


async def generator(spec: dict, t: transport.Transport) -> dict:
    g = generator_layout(spec["size"], spec["rank"], spec.get("fp8", False))
    sub = MeshSubscriber(t, "m", replica=spec["replica"], rank=spec["rank"], size=spec["size"], layout=g, timeout=30,
                         delta=spec.get("take_delta", True))
    await sub.start()
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
        extra: dict = {}
        if v == spec.get("skip_apply_at"):
            # This rank does not read the version, then a scribbled MAT word claims it did: the
            # next delta into that slot is made against a base the slot does not hold.
            sub._c[MAT0 + v % 2] = v + 1
            rounds.append({"version": v, "committed": committed, "applied": sub.applied(), "ok": None})
            await t.signal("ctl", f"{spec['name']}.done", v + 1)
            continue
        try:
            applied = sub.apply()
        except DeltaRefusedError as exc:
            extra = {"refused": str(exc), "kept": sub.applied()}
            applied = await sub.pull(version=committed if isinstance(committed, int) else v, timeout=30)
            applied = sub.apply()
        extra["delta"] = list(sub.last_delta)
        ok = None
        if applied is not None:
            ref = reference(g, applied)
            ok = all(torch.equal(sub.tensors[n].view(torch.uint8), ref[n].view(torch.uint8)) for n in ref)
            if spec.get("fp8"):  # and the FP8 weights dequantize to the source within e4m3's error
                w, scale = sub.tensors["w8_cols"].float(), sub.tensors["w8_cols_scale_inv"]
                deq = w * scale.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
                lo = 128 * spec["rank"] if spec["size"] > 1 else 0
                src = full(applied)["w8"][:, lo : lo + w.shape[1]]
                bound = torch.maximum(src.abs() * 2.0**-4, scale.max() * 2.0**-9)
                ok = ok and bool(((deq - src).abs() <= bound).all())
        rounds.append({"version": v, "committed": committed, "applied": applied, "ok": ok, **extra})
        await t.signal("ctl", f"{spec['name']}.done", v + 1)
    return {"rounds": rounds}


async def main(spec: dict) -> None:
    global SPARSE
    SPARSE = spec.get("sparse")
    async with transport.Transport(spec["name"], store=spec["store"], backends=tuple(spec["backends"]),
                                   timeout=30) as t:
        out = await (trainer(spec, t) if spec["role"] == "trainer" else generator(spec, t))
        await t.wait_signal("exit", timeout=300)
    Path(spec["out"]).write_text(json.dumps(out))


if __name__ == "__main__":
    anyio.run(main, json.loads(sys.argv[1]), backend="trio")
