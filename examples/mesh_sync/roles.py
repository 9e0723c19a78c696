"""The two roles of the mesh-sync example, each one process (or Ray actor).

* trainer rank r (of T): an FSDP2-sharded Llama-style model trained with gloo; after every
  optimizer step it publishes its own shards with ``MeshPublisher`` (cast to bf16 at the
  source). Rank 0 also writes the reference: the SHA-256 of every generator rank's local tensors
  cut from the full weights of that step (``full_tensor()``), to check the generators against.
* generator rank k of replica R: holds vLLM-style fused, TP-sliced tensors
  (``transport.plan.generator_rank``) in a ``MeshSubscriber``. Between "generation steps" the
  replica's rank 0 commits the newest version all its ranks hold, and every rank applies it.

Nothing here is collective across roles: trainer ranks never wait for generators, and generator
ranks never talk to trainer ranks during a push.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import torch

import transport
from transport.plan import generator_rank, model_config, trainer_layout_from_state_dict
from transport.weights import CommitError, MeshPublisher, MeshSubscriber

from .model import LlamaLM, batch

STREAM = "policy"


@dataclass
class Config:
    store: str
    out: str
    trainers: int
    replicas: int
    tp: int
    steps: int
    backends: list[str] | None
    dtype: str
    deadline: float
    master_port: int
    model: dict[str, Any]
    seed: int = 0
    slow_replica: str | None = None
    slow_seconds: float = 0.0
    timeout: float = 600.0


def replica_names(cfg: Config) -> list[str]:
    return [f"replica-{i}" for i in range(cfg.replicas)]


def generator_name(replica: str, rank: int) -> str:
    return f"{replica}-rank{rank}"


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


# -- trainer ------------------------------------------------------------------------------------


def trainer(cfgd: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cfg = Config(**cfgd)
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(cfg.master_port)
    dist.init_process_group("gloo", rank=rank, world_size=cfg.trainers, timeout=timedelta(seconds=cfg.timeout))
    try:
        mesh = init_device_mesh("cpu", (cfg.trainers,))
        torch.manual_seed(cfg.seed)
        model = LlamaLM(cfg.model)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        # Every rank derives the same layout from its own DTensors; bf16 on the wire.
        layout = trainer_layout_from_state_dict(model.state_dict()).cast(cfg.dtype)
        return anyio.run(_train, cfg, rank, model, opt, layout, backend="trio")
    finally:
        dist.destroy_process_group()


async def _wait_for_generators(t: transport.Transport, cfg: Config) -> None:
    want = {generator_name(r, k) for r in replica_names(cfg) for k in range(cfg.tp)}
    with anyio.fail_after(cfg.timeout):
        while not want <= set(await t.peers()):
            await anyio.sleep(0.2)


async def _train(cfg: Config, rank: int, model: Any, opt: Any, layout: Any) -> dict[str, Any]:
    async with transport.Transport(f"trainer-{rank}", store=cfg.store, backends=cfg.backends,
                                   timeout=cfg.timeout) as t:
        async with MeshPublisher(t, STREAM, model.state_dict(), layout, rank=rank, deadline=cfg.deadline) as pub:
            await _wait_for_generators(t, cfg)
            history = []
            for step in range(cfg.steps):
                tokens, targets = batch(step, cfg.model["vocab_size"])
                logits = model(tokens)
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad()
                started = time.time()
                report = await pub.publish(step, model.state_dict())
                nbytes = sum(r.nbytes for r in report.results.values())
                history.append({
                    "step": step, "loss": loss.item(), "publish_start": started, "pack_s": report.pack_s,
                    "push_s": report.push_s, "total_s": report.total_s,
                    "bytes": nbytes,
                    "status": {k: r.status.value for k, r in report.results.items()},
                    "incomplete": list(report.incomplete),
                })
                _write_reference(cfg, rank, step, model)
                if rank == 0:
                    await t.signal("launcher", "step", step + 1)
                    print(f"trainer: step {step} loss {loss.item():.3f}, pushed {nbytes / 1e6:.1f} MB "
                          f"in {report.push_s * 1e3:.0f} ms: {history[-1]['status']}", flush=True)
            Path(cfg.out, f"trainer-{rank}.json").write_text(json.dumps({"history": history}))
            # A trainer lives on in a real job: stay until the launcher says so, so that a generator
            # rank restarted late can still pull its slices from this rank's snapshot.
            await t.wait_signal("stop", timeout=cfg.timeout)
    return {"rank": rank, "steps": cfg.steps}


def _write_reference(cfg: Config, rank: int, step: int, model: Any) -> None:
    """The SHA-256 of every generator rank's local tensors for ``step``, from the full weights
    (``full_tensor()`` is collective: every trainer rank calls it, rank 0 writes)."""
    dtype = getattr(torch, cfg.dtype)
    full = {k: v.full_tensor().to(dtype) for k, v in sorted(model.state_dict().items())}
    if rank != 0:
        return
    mcfg = model_config(cfg.model)
    ref = {}
    for k in range(cfg.tp):
        g = generator_rank(mcfg, tp=cfg.tp, rank=k, dtype=cfg.dtype)
        tensors = {}
        for lt in g.tensors:
            x = torch.zeros(lt.shape, dtype=dtype)
            for p in lt.pieces:
                dst = x[tuple(slice(lo, hi) for lo, hi in p.local)]
                dst.copy_(full[p.name][tuple(slice(lo, hi) for lo, hi in p.box)].reshape(dst.shape))
            tensors[lt.name] = sha(x)
        ref[str(k)] = tensors
    refs = Path(cfg.out, "refs")
    refs.mkdir(exist_ok=True)
    (refs / f"{step}.json").write_text(json.dumps(ref))


# -- generator ----------------------------------------------------------------------------------


def generator(cfgd: dict[str, Any], replica: str, rank: int, restarted: bool = False) -> dict[str, Any]:
    cfg = Config(**cfgd)
    torch.set_num_threads(1)
    return anyio.run(_generate, cfg, replica, rank, restarted, backend="trio")


async def _generate(cfg: Config, replica: str, rank: int, restarted: bool) -> dict[str, Any]:
    name = generator_name(replica, rank)
    layout = generator_rank(model_config(cfg.model), tp=cfg.tp, rank=rank, dtype=cfg.dtype)
    slow = cfg.slow_seconds if replica == cfg.slow_replica else 0.0
    applied: list[dict[str, Any]] = []
    errors: list[str] = []
    async with transport.Transport(name, store=cfg.store, backends=cfg.backends, timeout=cfg.timeout) as t:
        async with MeshSubscriber(t, STREAM, replica=replica, rank=rank, size=cfg.tp, layout=layout,
                                  timeout=30) as sub:
            pulled = None
            if restarted:
                pulled = await sub.pull(timeout=120)
                print(f"{name}: restarted, pulled version {pulled} from the trainer ranks", flush=True)
            last = None
            while t.signal_value("stop") is None:
                # A version published while this replica was incomplete (a rank down) never reaches
                # it by push: after a second without it, every rank pulls its own slices.
                await sub.catch_up(after=1.0, timeout=120)
                if rank == 0:
                    try:
                        await sub.commit(timeout=10)
                    except (CommitError, transport.TransportError) as exc:  # e.g. a rank of this replica is down
                        if not errors or errors[-1] != str(exc):
                            errors.append(str(exc))
                v = sub.apply()
                if v is not None and v != last:
                    applied.append({"version": v, "at": time.time(),
                                    "sha": {n: sha(x) for n, x in sub.tensors.items()}})
                    last = v
                    await t.signal("launcher", f"{name}.applied", v + 1)
                await anyio.sleep(0.05 + slow)  # a generation step
    suffix = "-restarted" if restarted else ""
    Path(cfg.out, f"{name}{suffix}.json").write_text(json.dumps({"applied": applied, "pulled": pulled,
                                                                 "errors": errors}))
    return {"name": name, "applied": [a["version"] for a in applied]}


def run_role(role: str, cfgd: dict[str, Any], *args: Any) -> dict[str, Any]:
    """Entry of a process or Ray actor: ``trainer`` (rank) or ``generator`` (replica, rank[, restarted])."""
    return trainer(cfgd, *args) if role == "trainer" else generator(cfgd, *args)
