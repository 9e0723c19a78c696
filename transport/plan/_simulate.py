"""Cluster-scale simulation: the real planner on the real layouts of a job too big for this
machine, timed by the flow-level network model of :mod:`._netsim`.

Placement: trainer ranks on GPUs ``0 .. T-1``, generator replica ``r``'s TP rank ``k`` on GPU
``T + r * tp + k``; nodes of ``gpus_per_node`` consecutive GPUs (so trainers and generators
share no node unless T is not a multiple of it). Layouts are *stacked* (every layer of a kind,
and every expert, one virtual tensor), which changes nothing about which bytes go where and keeps
a 1T-parameter model to a few hundred tensors.

The naive plan, for comparison, is what frameworks do today, modelled generously: the trainer
ranks all-gather the full weights (a ring: every rank sends ``(T-1)/T`` of the model to its
neighbour), then trainer rank 0 broadcasts the whole model, at the generator's dtype, along a
pipelined ring through every generator GPU (each link carries the model once); each generator
rank slices its part locally.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import MeshLayoutError
from ._fp8 import FP8_DTYPE, fp8_generator_rank, fp8_trainer_layout
from ._layouts import ITEMSIZE, Replica
from ._models import ModelConfig, builtin_model, checkpoint_tensors, model_config, trainer_layout
from ._netsim import Network, SimResult, simulate
from ._planner import Planner
from ._vllm import generator_replica

#: Published end-to-end figures to put beside a simulation: (model, trainer GPUs, generator GPUs).
PUBLISHED: dict[tuple[str, int, int], str] = {
    ("kimi-k2", 256, 128): "1.3 s: Perplexity, Kimi-K2 (1T) from 256 BF16 training GPUs to 128 FP8 inference GPUs, "
                           "static schedule of one-sided RDMA writes",
}


@dataclass(frozen=True)
class GeneratorSpec:
    tp: int
    ep: int
    replicas: int


def parse_generator(spec: str) -> GeneratorSpec:
    """``tp=8,ep=8,replicas=16`` (ep and replicas default to 1).

    Raises:
        MeshLayoutError: an unknown key or a value that is not a positive integer.
    """
    values = {"tp": 1, "ep": 1, "replicas": 1}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, raw = part.partition("=")
        if key not in values or not raw.isdigit() or int(raw) < 1:
            raise MeshLayoutError(f"generator spec {spec!r}: expected tp=N[,ep=N][,replicas=N], got {part!r}")
        values[key] = int(raw)
    return GeneratorSpec(values["tp"], values["ep"], values["replicas"])


def _model(name: str) -> tuple[str, ModelConfig]:
    try:
        return name, builtin_model(name)
    except MeshLayoutError:
        return name, model_config(name)  # a config.json path


def run(model: str, trainer_spec: str, generator_spec: str, network: Network, *, trainer_dtype: str = "bfloat16",
        generator_dtype: str = "bfloat16") -> dict[str, Any]:
    """Plans and simulates one job.

    Args:
        model: a built-in model name or a path to a Hugging Face ``config.json``.
        trainer_spec: e.g. ``fsdp=256`` or ``fsdp=32,tp=8`` (see ``trainer_layout``).
        generator_spec: e.g. ``tp=8,ep=8,replicas=16``.
        network: the cluster's network model.
        trainer_dtype: the trainer's parameter dtype.
        generator_dtype: the generator's weight dtype (casts happen at the source).

    Returns:
        A JSON-ready report: bytes, makespan, floor, per-NIC extremes, the naive plan's figures,
        planning time, and a published figure when one exists for this job.

    Raises:
        MeshLayoutError: an unknown model or a spec that does not fit the model.
    """
    name, cfg = _model(model)
    gen = parse_generator(generator_spec)
    t0 = time.perf_counter()
    trainer = trainer_layout(cfg, trainer_spec, dtype=trainer_dtype, stacked=True)
    replicas = [generator_replica(cfg, f"replica{r}", tp=gen.tp, ep=gen.ep, dtype=generator_dtype, stacked=True)
                for r in range(gen.replicas)]
    if generator_dtype == FP8_DTYPE:  # block scales are planned and sent like any other tensor
        trainer = fp8_trainer_layout(trainer)
        replicas = [Replica(rep.id, tuple(fp8_generator_rank(g, trainer) for g in rep.ranks)) for rep in replicas]
    t_layout = time.perf_counter() - t0
    planner = Planner(trainer)
    plan = planner.plan(replicas)
    t_plan = time.perf_counter() - t0 - t_layout
    n_trainers = len(trainer.ranks())
    src, dst, nbytes = [], [], []
    for r, rep in enumerate(replicas):
        for k, rp in enumerate(plan.replicas[rep.id].ranks):
            for s, n in rp.bytes_by_source().items():
                src.append(s)
                dst.append(n_trainers + r * gen.tp + k)
                nbytes.append(n)
    mesh = simulate(np.array(src), np.array(dst), np.array(nbytes), network)
    naive = _naive(cfg, n_trainers, gen, network, trainer_dtype, generator_dtype)
    n_gen = gen.tp * gen.replicas
    report: dict[str, Any] = {
        "model": name,
        "parameters": sum(int(np.prod(s)) for _, s in checkpoint_tensors(cfg, stacked=True)),
        "trainer": trainer_spec, "trainer_gpus": n_trainers, "trainer_dtype": trainer_dtype,
        "generator": generator_spec, "generator_gpus": n_gen, "generator_dtype": generator_dtype,
        "network": {"gpus_per_node": network.gpus_per_node, "nic_gbps": network.nic_gbps,
                    "nvlink_gbps": network.nvlink_gbps},
        "layout_s": round(t_layout, 3), "plan_s": round(t_plan, 3),
        "moves": sum(len(rp.moves) for r in plan.replicas.values() for rp in r.ranks),
        **mesh.as_dict(),
        "makespan_over_floor": mesh.makespan_s / mesh.floor_s if mesh.floor_s else 1.0,
        "naive": naive,
        "speedup_vs_naive": naive["makespan_s"] / mesh.makespan_s if mesh.makespan_s else None,
    }
    published = PUBLISHED.get((name, n_trainers, n_gen))
    if published is not None:
        report["published"] = published
    return report


def _naive(cfg: ModelConfig, n_trainers: int, gen: GeneratorSpec, network: Network, trainer_dtype: str,
           generator_dtype: str) -> dict[str, Any]:
    elems = sum(int(np.prod(s)) for _, s in checkpoint_tensors(cfg, stacked=True))
    full_train, full_gen = elems * ITEMSIZE[trainer_dtype], elems * ITEMSIZE[generator_dtype]
    # All-gather as a ring over the trainer ranks.
    ring = np.arange(n_trainers)
    gather: SimResult | None = None
    if n_trainers > 1:
        per = full_train * (n_trainers - 1) // n_trainers
        gather = simulate(ring, (ring + 1) % n_trainers, np.full(n_trainers, per), network)
    # Rank 0 broadcasts along a pipelined ring through every generator GPU.
    chain = [0, *range(n_trainers, n_trainers + gen.tp * gen.replicas)]
    bcast = simulate(np.array(chain[:-1]), np.array(chain[1:]), np.full(len(chain) - 1, full_gen), network)
    gather_s = gather.makespan_s if gather is not None else 0.0
    return {
        "makespan_s": gather_s + bcast.makespan_s,
        "gather_s": gather_s,
        "broadcast_s": bcast.makespan_s,
        "bytes_total": (gather.bytes_total if gather is not None else 0) + bcast.bytes_total,
    }


def format_report(r: dict[str, Any]) -> str:
    """The report as the lines ``python -m transport.plan simulate`` prints."""
    gb = 1e9
    lines = [
        f"model {r['model']} ({r['parameters'] / 1e9:.1f}B parameters), trainer {r['trainer']} "
        f"({r['trainer_gpus']} GPUs, {r['trainer_dtype']}) -> generator {r['generator']} "
        f"({r['generator_gpus']} GPUs, {r['generator_dtype']})",
        f"network: {r['network']['gpus_per_node']} GPUs per node, one {r['network']['nic_gbps']:g} Gbit/s NIC per GPU, "
        f"NVLink {r['network']['nvlink_gbps']:g} Gbit/s per GPU",
        f"plan: {r['moves']} moves, layouts {r['layout_s']:.2f} s, planning {r['plan_s']:.2f} s",
        f"bytes_total {r['bytes_total'] / gb:.2f} GB (over NICs {r['bytes_over_nics'] / gb:.2f} GB)",
        f"makespan_s {r['makespan_s']:.3f}   floor_s {r['floor_s']:.3f}   makespan/floor "
        f"{r['makespan_over_floor']:.3f}   (busiest: {r['busiest_resource']})",
        f"per-NIC out: max {r['nic_out_bytes_max'] / gb:.2f} GB, min {r['nic_out_bytes_min_nonzero'] / gb:.2f} GB; "
        f"in: max {r['nic_in_bytes_max'] / gb:.2f} GB, min {r['nic_in_bytes_min_nonzero'] / gb:.2f} GB",
        f"naive (all-gather, then rank 0 ring-broadcasts everything): {r['naive']['makespan_s']:.3f} s "
        f"(gather {r['naive']['gather_s']:.3f} s + broadcast {r['naive']['broadcast_s']:.3f} s); "
        f"mesh plan {r['speedup_vs_naive']:.1f}x faster",
    ]
    if "published" in r:
        lines.append(f"published for this job: {r['published']}")
    return "\n".join(lines)
