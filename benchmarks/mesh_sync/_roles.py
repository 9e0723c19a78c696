"""The processes of the mesh-sync benchmark (``python -m benchmarks.mesh_sync``).

T trainer ranks and R replicas x TP generator ranks, each a spawned process, all in ONE gloo
world (``torch.distributed``, file rendezvous in the run's temporary directory). Global ranks are
fixed by role: trainer rank ``i`` is ``i``; rank ``k`` of replica ``r`` is ``T + r * TP + k``.
Every process creates the same two subgroups, in the same order:

* ``trainers`` (``0 .. T-1``): the FSDP2 mesh (``DeviceMesh.from_group``), so ``full_tensor()``
  and FSDP's collectives involve trainer ranks only;
* ``broadcast`` (trainer rank 0 and every generator rank): the baseline's broadcasts.

The world group itself only serves the barriers between phases (outside the timed regions).

Per version ``v`` every process follows the same schedule:

1. trainer ranks change their local shards in place (``p.add_(delta)``: every version differs),
   then compute the reference: ``full_tensor()`` of every parameter (collective among trainer
   ranks), and trainer rank 0 hashes (SHA-256) every local tensor of every TP rank, cut from the
   full weights in the wire dtype as in ``examples/mesh_sync/roles.py``. Not timed.
2. both methods, one after the other (mesh first on even versions, the baseline first on odd
   ones, so that drift on the machine hits both), each between two world barriers:

   * ``mesh``: every trainer rank takes ``time.time()`` and awaits ``MeshPublisher.publish(v)``;
     each replica's rank 0 polls ``commit()`` until it commits ``v``, the other ranks
     ``wait_committed(v)``; every rank ``apply(v)``s and takes ``time.time()``: live.
   * ``baseline``: every trainer rank takes ``time.time()`` and calls ``full_tensor()`` on every
     parameter in name order; trainer rank 0 casts each to the wire dtype and broadcasts it over
     the ``broadcast`` group; every generator rank receives each into a preallocated full-size
     buffer and copies its pieces (the ``generator_rank`` layout's) into its fused local
     tensors, then takes ``time.time()``: live.

   After taking its timestamp, a generator rank hashes its local tensors (not timed) and reports.

Every process reports through a ``multiprocessing`` queue (plain dicts, ``who`` added):
``ready``, ``ref`` (trainer rank 0), ``start`` (trainer ranks), ``live`` (generator ranks),
``exit`` and ``error`` (with the traceback; the process then exits with status 1). Every wait is
bounded: the gloo process groups by ``MeshBenchSpec.timeout``, the transport waits by
``fail_after``/their own timeouts.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from ..common.procs import leave_process_group

MESH, BASELINE, DELTA = "mesh", "baseline", "delta"
STREAM = "policy"

Emit = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class MeshBenchSpec:
    """Everything the processes of one run need (pickled to each spawned process).

    Attributes:
        trainers: trainer ranks (FSDP2 degree).
        replicas: generator replicas.
        tp: ranks per replica (tensor parallel degree).
        versions: versions published, warm-up ones included.
        warmup: leading versions reported separately (not in the medians).
        model: the model's config (Hugging Face ``config.json`` terms, as ``examples.mesh_sync``).
        dtype: what generators hold and what travels (cast on the trainer ranks).
        backends: transport backends in order of preference (None: the library's default).
        tmp: the run's temporary directory (gloo rendezvous file, transport store).
        timeout: bound of every wait (seconds).
        deadline: seconds a mesh publish waits for any one generator rank.
        poll_s: how often a replica's rank 0 tries ``commit()`` while it waits for a version.
        delta: what every parameter changes by between versions (``update="constant"``).
        seed: the model's initialisation seed.
        update: ``"constant"`` (every parameter moves by ``delta``: every element changes) or
            ``"adamw"`` (one real AdamW step of the FSDP2 model per version, fp32 master
            weights, on ``examples.mesh_sync.model.batch``'s next-token loss, at ``lr``).
        lr: the AdamW learning rate.
        delta_sync: also run the ``delta`` method: a second stream whose publishers diff each
            version (``MeshPublisher(delta=True)``) and send generator ranks only what changed.
        warm: every trainer rank calls ``MeshPublisher.warm()`` once the generator ranks are
            there, before the first version (outside the timed region, as a trainer would
            beside its training step).
    """

    trainers: int
    replicas: int
    tp: int
    versions: int
    warmup: int
    model: dict[str, Any]
    dtype: str
    backends: tuple[str, ...] | None
    tmp: str
    timeout: float
    deadline: float
    poll_s: float
    delta: float = 1e-2
    seed: int = 0
    update: str = "constant"
    lr: float = 1e-6
    delta_sync: bool = False
    warm: bool = False

    @property
    def methods(self) -> tuple[str, ...]:
        return (MESH, BASELINE, DELTA) if self.delta_sync else (MESH, BASELINE)

    @property
    def world(self) -> int:
        return self.trainers + self.replicas * self.tp

    @property
    def store(self) -> str:
        return f"file://{os.path.join(self.tmp, 'store')}"

    def replica_names(self) -> list[str]:
        return [f"replica-{r}" for r in range(self.replicas)]

    def generator_names(self) -> list[str]:
        """Every generator rank's name, ``replica-R-rankK``, in global-rank order."""
        return [generator_name(r, k) for r in self.replica_names() for k in range(self.tp)]


def generator_name(replica: str, rank: int) -> str:
    return f"{replica}-rank{rank}"


def order(version: int, methods: tuple[str, ...] = (MESH, BASELINE)) -> tuple[str, ...]:
    """The methods in the order they run for ``version`` (rotating by version)."""
    k = version % len(methods)
    return methods[k:] + methods[:k]


def _box(box: Any) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


def local_tensors(layout: Any, full: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A generator rank's local tensors (``layout``: a ``GeneratorRank``) cut from the full
    weights ``full`` (name -> tensor in ``dtype``); what no piece covers (vocabulary padding) is 0."""
    out = {}
    for lt in layout.tensors:
        x = torch.zeros(lt.shape, dtype=dtype)
        for p in lt.pieces:
            dst = x[_box(p.local)]
            dst.copy_(full[p.name][_box(p.box)].reshape(dst.shape))
        out[lt.name] = x
    return out


def digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    from examples.mesh_sync.roles import sha

    return {n: sha(t) for n, t in sorted(tensors.items())}


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


async def _barrier() -> None:
    """A barrier of the whole world, in a worker thread: this process's event loop (and so its
    Transport) keeps running meanwhile."""
    import anyio
    import torch.distributed as dist

    await anyio.to_thread.run_sync(dist.barrier)


# -- trainer ---------------------------------------------------------------------------------------


def _trainer(spec: MeshBenchSpec, rank: int, groups: tuple[Any, Any], emit: Emit) -> None:
    import anyio
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from examples.mesh_sync.model import LlamaLM
    from transport.plan import checkpoint_tensors, model_config, trainer_layout_from_state_dict

    trainer_group, _ = groups
    mesh = DeviceMesh.from_group(trainer_group, "cpu")
    torch.manual_seed(spec.seed)
    model = LlamaLM(spec.model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = model.state_dict()
    expected = {n: tuple(s) for n, s in checkpoint_tensors(model_config(spec.model))}
    got = {n: tuple(t.shape) for n, t in state.items()}
    if got != expected:
        raise RuntimeError(f"the model's tensors differ from transport.plan's checkpoint_tensors: "
                           f"{sorted(set(got.items()) ^ set(expected.items()))[:6]}")
    layout = trainer_layout_from_state_dict(state).cast(spec.dtype)
    anyio.run(_trainer_loop, spec, rank, model, layout, groups, emit, backend="trio")


async def _trainer_loop(spec: MeshBenchSpec, rank: int, model: Any, layout: Any, groups: tuple[Any, Any],
                        emit: Emit) -> None:
    import anyio

    import transport
    from transport.weights import MeshPublisher

    async with transport.Transport(f"trainer-{rank}", store=spec.store, backends=spec.backends,
                                   timeout=spec.timeout) as t:
        pubs = {MESH: MeshPublisher(t, STREAM, model.state_dict(), layout, rank=rank, deadline=spec.deadline,
                                    delta=False)}
        if spec.delta_sync:
            pubs[DELTA] = MeshPublisher(t, STREAM + "-delta", model.state_dict(), layout, rank=rank,
                                        deadline=spec.deadline, delta=True)
        for pub in pubs.values():
            await pub.start()
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr) if spec.update == "adamw" else None
        try:
            await _barrier()  # every publisher and subscriber is registered in the store
            emit({"kind": "ready"})
            if spec.warm:
                for method, pub in pubs.items():
                    t0 = time.perf_counter()
                    warmed = await pub.warm()
                    emit({"kind": "warm", "method": method, "rank": rank, "warm_s": time.perf_counter() - t0,
                          "warmed": warmed})
            for v in range(spec.versions):
                if optimizer is not None:
                    await anyio.to_thread.run_sync(_adamw_step, spec, model, optimizer, v)
                else:
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(spec.delta)
                await anyio.to_thread.run_sync(_reference, spec, rank, model, v, emit)
                for method in order(v, spec.methods):
                    await _barrier()
                    if method in pubs:
                        state = model.state_dict()
                        started = time.time()
                        report = await pubs[method].publish(v, state)
                        ended = time.time()
                        emit({
                            "kind": "start", "method": method, "version": v, "rank": rank, "t_start": started,
                            "t_end": ended, "pack_s": report.pack_s, "push_s": report.push_s,
                            "nbytes": sum(r.nbytes for r in report.results.values()),
                            "deltas": sum(r.delta for r in report.results.values()), "changed": report.changed,
                            "status": {k: r.status.value for k, r in sorted(report.results.items())},
                            "errors": {k: r.error for k, r in sorted(report.results.items()) if r.error},
                            "incomplete": list(report.incomplete), "refused": dict(report.refused),
                        })
                    else:
                        started, ended = await anyio.to_thread.run_sync(_gather_and_broadcast, spec, rank, model,
                                                                        groups[1])
                        emit({"kind": "start", "method": BASELINE, "version": v, "rank": rank, "t_start": started,
                              "t_end": ended})
            await _barrier()  # every generator rank applied the last version: the regions may go
        finally:
            for pub in pubs.values():
                pub.close()


def _adamw_step(spec: MeshBenchSpec, model: Any, optimizer: Any, version: int) -> None:
    """One real training step: the next-token loss on the toy batch of ``version``."""
    from examples.mesh_sync.model import batch

    x, y = batch(version, spec.model["vocab_size"])
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _reference(spec: MeshBenchSpec, rank: int, model: Any, version: int, emit: Emit) -> None:
    """The SHA-256 of every TP rank's local tensors for ``version``, from the full weights
    (``full_tensor()`` is collective: every trainer rank calls it; rank 0 hashes and reports)."""
    from transport.plan import generator_rank, model_config

    dtype = getattr(torch, spec.dtype)
    full = {k: v.full_tensor().to(dtype) for k, v in sorted(model.state_dict().items())}
    if rank != 0:
        return
    cfg = model_config(spec.model)
    ref = {str(k): digests(local_tensors(generator_rank(cfg, tp=spec.tp, rank=k, dtype=spec.dtype), full, dtype))
           for k in range(spec.tp)}
    emit({"kind": "ref", "version": version, "sha": ref})


def _gather_and_broadcast(spec: MeshBenchSpec, rank: int, model: Any, group: Any) -> tuple[float, float]:
    """The baseline's trainer side: every parameter gathered (``full_tensor()``) in name order;
    rank 0 casts it and broadcasts it to every generator rank. Returns (start, end) timestamps."""
    import torch.distributed as dist

    dtype = getattr(torch, spec.dtype)
    state = sorted(model.state_dict().items())
    started = time.time()
    for _, p in state:
        full = p.full_tensor()
        if rank == 0:
            dist.broadcast(full.to(dtype).contiguous(), src=0, group=group)
    return started, time.time()


# -- generator -------------------------------------------------------------------------------------


def _generator(spec: MeshBenchSpec, replica: str, rank: int, groups: tuple[Any, Any], emit: Emit) -> None:
    import anyio

    from transport.plan import checkpoint_tensors, generator_rank, model_config

    cfg = model_config(spec.model)
    layout = generator_rank(cfg, tp=spec.tp, rank=rank, dtype=spec.dtype)
    dtype = getattr(torch, spec.dtype)
    # The baseline's receive buffers (one per parameter, allocated and touched once) and where
    # each one's pieces go in this rank's fused local tensors (separate from the mesh method's).
    buffers = {n: torch.zeros(shape, dtype=dtype) for n, shape in sorted(checkpoint_tensors(cfg))}
    local = {lt.name: torch.zeros(lt.shape, dtype=dtype) for lt in layout.tensors}
    pieces: dict[str, list[tuple[torch.Tensor, tuple[slice, ...]]]] = {n: [] for n in buffers}
    for lt in layout.tensors:
        for p in lt.pieces:
            pieces[p.name].append((local[lt.name][_box(p.local)], _box(p.box)))
    anyio.run(_generator_loop, spec, replica, rank, layout, (buffers, local, pieces), groups[1], emit,
              backend="trio")


async def _generator_loop(spec: MeshBenchSpec, replica: str, rank: int, layout: Any, baseline: tuple[Any, Any, Any],
                          group: Any, emit: Emit) -> None:
    import anyio

    import transport
    from transport.weights import MeshSubscriber

    name = generator_name(replica, rank)
    _, local, _ = baseline
    async with transport.Transport(name, store=spec.store, backends=spec.backends, timeout=spec.timeout) as t:
        subs = {MESH: MeshSubscriber(t, STREAM, replica=replica, rank=rank, size=spec.tp, layout=layout,
                                     timeout=spec.timeout, delta=False)}
        if spec.delta_sync:
            subs[DELTA] = MeshSubscriber(t, STREAM + "-delta", replica=replica, rank=rank, size=spec.tp,
                                         layout=layout, timeout=spec.timeout)
        for sub in subs.values():
            await sub.start()
        try:
            await _barrier()
            emit({"kind": "ready"})
            for v in range(spec.versions):
                for method in order(v, spec.methods):
                    await _barrier()
                    if method in subs:
                        sub = subs[method]
                        with anyio.fail_after(spec.timeout):
                            if rank == 0:
                                while (c := await sub.commit(timeout=spec.timeout)) is None or c < v:
                                    await anyio.sleep(spec.poll_s)
                            else:
                                await sub.wait_committed(v, timeout=spec.timeout)
                            sub.apply(v)
                        live = time.time()
                        tensors = sub.tensors
                    else:
                        live = await anyio.to_thread.run_sync(_receive_and_slice, baseline, group)
                        tensors = local
                    emit({"kind": "live", "method": method, "version": v, "replica": replica, "rank": rank,
                          "t_live": live, "sha": digests(tensors)})
            await _barrier()
        finally:
            for sub in subs.values():
                sub.close()


def _receive_and_slice(baseline: tuple[Any, Any, Any], group: Any) -> float:
    """The baseline's generator side: every full tensor received by broadcast, in name order,
    then this rank's pieces copied out of it. Returns the timestamp when all are in place."""
    import torch.distributed as dist

    buffers, _, pieces = baseline
    for n, buf in buffers.items():
        dist.broadcast(buf, src=0, group=group)
        for dst, box in pieces[n]:
            dst.copy_(buf[box].reshape(dst.shape))
    return time.time()


# -- process entry point ---------------------------------------------------------------------------


def run_rank(global_rank: int, spec: MeshBenchSpec, queue: Any) -> None:
    """Entry point of one spawned process: trainer rank ``global_rank`` (< ``spec.trainers``) or
    the generator rank at that place (see the module docstring).

    Joins the gloo world, creates the subgroups, runs every version and reports through
    ``queue``. On any failure it reports an ``error`` message with the traceback and exits with
    status 1 (the launcher then kills the others).
    """
    import torch.distributed as dist

    torch.set_num_threads(1)  # the processes share this host's cores: no intra-op oversubscription
    if global_rank < spec.trainers:
        who = f"trainer-{global_rank}"
    else:
        replica, k = divmod(global_rank - spec.trainers, spec.tp)
        who = generator_name(f"replica-{replica}", k)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {who} %(name)s: %(message)s")

    def emit(msg: dict[str, Any]) -> None:
        queue.put({"who": who, **msg})

    joined = False
    try:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(spec.tmp, 'gloo-init')}",
                                rank=global_rank, world_size=spec.world, timeout=timedelta(seconds=spec.timeout))
        joined = True
        trainers = dist.new_group(list(range(spec.trainers)))
        broadcast = dist.new_group([0, *range(spec.trainers, spec.world)])
        if global_rank < spec.trainers:
            _trainer(spec, global_rank, (trainers, broadcast), emit)
        else:
            replica, k = divmod(global_rank - spec.trainers, spec.tp)
            _generator(spec, f"replica-{replica}", k, (trainers, broadcast), emit)
        emit({"kind": "exit", "peak_rss": _peak_rss()})
    except BaseException as exc:  # noqa: BLE001 - report anything, then fail: the launcher kills the rest
        emit({"kind": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        sys.exit(1)
    finally:
        if joined:
            leave_process_group()
