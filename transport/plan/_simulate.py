"""Cluster-scale simulation: the real planner on the real layouts of a job too big for this
machine, timed by the flow-level network model of :mod:`._netsim`.

Placement: trainer ranks on GPUs ``0 .. T-1``, generator replica ``r``'s TP rank ``k`` on GPU
``T + r * tp + k``; nodes of ``gpus_per_node`` consecutive GPUs (so trainers and generators
share no node unless T is not a multiple of it). Layouts are *stacked* (every layer of a kind,
and every expert, one virtual tensor), which changes nothing about which bytes go where and keeps
a 1T-parameter model to a few hundred tensors.

Relays (``relays``, see :mod:`._relays`): besides the direct plan, the same plan routed through
relay GPUs on each generator host (``host``), along a chain of hosts (``chain``), or all three
with the fastest chosen (``auto``: a fan-out with more relaying is taken only when its simulated
makespan is at least :data:`PAYS` below the one with less; ties go to fewer hops, since a relay
that fails costs its dependants a timeout). Each fan-out reports its own floor: the most loaded
resource of *its* routes, NIC or NVLink, over that resource's rate.

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
from ._layouts import ITEMSIZE, Replica, TrainerLayout
from ._models import ModelConfig, builtin_model, checkpoint_tensors, model_config, trainer_layout
from ._netsim import Network, SimResult, simulate, simulate_hops
from ._planner import Plan, Planner
from ._relays import Fanout, Relays, hop_arrays, needs_of, routes
from ._vllm import generator_replica

#: Published end-to-end figures to put beside a simulation: (model, trainer GPUs, generator GPUs).
PUBLISHED: dict[tuple[str, int, int], str] = {
    ("kimi-k2", 256, 128): "1.3 s: Perplexity, Kimi-K2 (1T) from 256 BF16 training GPUs to 128 FP8 inference GPUs, "
                           "static schedule of one-sided RDMA writes",
}


#: A fan-out with more relaying (direct -> host -> chain) must be this much faster to be chosen.
PAYS = 0.01


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


def _model(name: str | ModelConfig) -> tuple[str, ModelConfig]:
    if isinstance(name, ModelConfig):
        return name.model_type, name
    try:
        return name, builtin_model(name)
    except MeshLayoutError:
        return name, model_config(name)  # a config.json path


def job_layouts(cfg: ModelConfig, trainer_spec: str, gen: GeneratorSpec, *, trainer_dtype: str = "bfloat16",
                generator_dtype: str = "bfloat16") -> tuple[TrainerLayout, list[Replica]]:
    """The stacked trainer layout and the generator replicas (``replica0`` ...) of a job.

    Raises:
        MeshLayoutError: a spec that does not fit the model.
    """
    trainer = trainer_layout(cfg, trainer_spec, dtype=trainer_dtype, stacked=True)
    replicas = [generator_replica(cfg, f"replica{r}", tp=gen.tp, ep=gen.ep, dtype=generator_dtype, stacked=True)
                for r in range(gen.replicas)]
    if generator_dtype == FP8_DTYPE:  # block scales are planned and sent like any other tensor
        trainer = fp8_trainer_layout(trainer)
        replicas = [Replica(rep.id, tuple(fp8_generator_rank(g, trainer) for g in rep.ranks)) for rep in replicas]
    return trainer, replicas


def run(model: str | ModelConfig, trainer_spec: str, generator_spec: str, network: Network, *,
        trainer_dtype: str = "bfloat16", generator_dtype: str = "bfloat16", relays: Relays = Relays.OFF,
        ) -> dict[str, Any]:
    """Plans and simulates one job.

    Args:
        model: a built-in model name, a path to a Hugging Face ``config.json``, or a config.
        trainer_spec: e.g. ``fsdp=256`` or ``fsdp=32,tp=8`` (see ``trainer_layout``).
        generator_spec: e.g. ``tp=8,ep=8,replicas=16``.
        network: the cluster's network model.
        trainer_dtype: the trainer's parameter dtype.
        generator_dtype: the generator's weight dtype (casts happen at the source).
        relays: the fan-outs to simulate beside the direct plan (see :class:`Relays`).

    Returns:
        A JSON-ready report: bytes, makespan, floor, per-NIC extremes (all of the direct plan),
        the naive plan's figures, planning time, a published figure when one exists for this job,
        and unless ``relays`` is off, ``relays``: every fan-out simulated, the one chosen and why.

    Raises:
        MeshLayoutError: an unknown model or a spec that does not fit the model.
    """
    name, cfg = _model(model)
    gen = parse_generator(generator_spec)
    t0 = time.perf_counter()
    trainer, replicas = job_layouts(cfg, trainer_spec, gen, trainer_dtype=trainer_dtype,
                                    generator_dtype=generator_dtype)
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
    if relays is not Relays.OFF:
        report["relays"] = _relayed(plan, replicas, n_trainers, network, relays, mesh)
    return report


def _relayed(plan: Plan, replicas: list[Replica], n_trainers: int, network: Network, relays: Relays,
             direct: SimResult) -> dict[str, Any]:
    """Every fan-out of ``relays`` simulated, and the one chosen with the reason."""
    t0 = time.perf_counter()
    needs = needs_of(plan, replicas, n_trainers)
    t_needs = time.perf_counter() - t0
    n_gpus = n_trainers + len(needs)
    results: dict[Fanout, SimResult] = {}
    out: dict[str, Any] = {}
    for fanout in relays.fanouts:
        if fanout is Fanout.DIRECT:
            results[fanout] = direct
            out[fanout.value] = _fanout_figures(direct, n_trainers, n_gpus)
            continue
        t0 = time.perf_counter()
        r = results[fanout] = simulate_hops(*hop_arrays(routes(needs, fanout, network.gpus_per_node)), network)
        out[fanout.value] = {**_fanout_figures(r, n_trainers, n_gpus),
                             "route_and_simulate_s": round(time.perf_counter() - t0, 3)}
    chosen, reason = choose({f: r.makespan_s for f, r in results.items()})
    return {"asked": relays.value, "chosen": chosen.value, "reason": reason, "needs_s": round(t_needs, 3),
            "fanouts": out}


def _fanout_figures(r: SimResult, n_trainers: int, n_gpus: int) -> dict[str, Any]:
    """A fan-out's makespan, floor, busiest resource, and bytes over the trainer and generator
    sides' NICs and over NVLink."""
    per = r.per_gpu
    side = {"trainer": range(min(n_trainers, len(per.nic_out))),
            "generator": range(n_trainers, min(n_gpus, len(per.nic_out)))}
    return {
        "makespan_s": r.makespan_s, "floor_s": r.floor_s,
        "makespan_over_floor": r.makespan_s / r.floor_s if r.floor_s else 1.0,
        "busiest_resource": r.busiest_resource,
        "bytes_over_nics": r.bytes_over_nics, "bytes_over_nvlink": r.bytes_over_nvlink,
        "trainer_nic_out_bytes_max": max((per.nic_out[g] for g in side["trainer"]), default=0),
        "generator_nic_in_bytes_max": max((per.nic_in[g] for g in side["generator"]), default=0),
        "generator_nic_out_bytes_max": max((per.nic_out[g] for g in side["generator"]), default=0),
        "nvlink_out_bytes_max": max(per.nvlink_out, default=0),
        "flows": r.flows, "events": r.events,
    }


def choose(makespans: dict[Fanout, float]) -> tuple[Fanout, str]:
    """The fan-out to use and why: direct, unless one with more relaying (host, then chain) is
    at least :data:`PAYS` faster than the best so far.

    Args:
        makespans: the simulated makespan of each fan-out (direct among them).

    Returns:
        The fan-out and a sentence that gives the figures.
    """
    best = Fanout.DIRECT
    notes = []
    for f in (Fanout.HOST, Fanout.CHAIN):
        if f not in makespans:
            continue
        t, t_best = makespans[f], makespans[best]
        if t < t_best * (1 - PAYS):
            notes.append(f"{f.value} {t:.3f} s is {t_best / t:.2f}x faster than {best.value} {t_best:.3f} s")
            best = f
        else:
            notes.append(f"{f.value} {t:.3f} s is not {PAYS:.0%} faster than {best.value} {t_best:.3f} s")
    return best, "; ".join(notes) if notes else "no relays asked"


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
    if "relays" in r:
        lines.extend(_format_relays(r["relays"]))
    return "\n".join(lines)


def _format_relays(rel: dict[str, Any]) -> list[str]:
    gb = 1e9
    lines = [f"relays ({rel['asked']}): {rel['chosen']} chosen: {rel['reason']}",
             f"  {'fan-out':<8}{'makespan_s':>11}{'floor_s':>9}{'ratio':>7}  {'busiest':<24}"
             f"{'train out':>10}{'gen in':>9}{'gen out':>9}{'NVLink out':>11}  (max GB per GPU)"]
    for name, f in rel["fanouts"].items():
        lines.append(f"  {name:<8}{f['makespan_s']:>11.3f}{f['floor_s']:>9.3f}{f['makespan_over_floor']:>7.3f}  "
                     f"{f['busiest_resource']:<24}{f['trainer_nic_out_bytes_max'] / gb:>10.2f}"
                     f"{f['generator_nic_in_bytes_max'] / gb:>9.2f}{f['generator_nic_out_bytes_max'] / gb:>9.2f}"
                     f"{f['nvlink_out_bytes_max'] / gb:>11.2f}")
    return lines
