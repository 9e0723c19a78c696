"""Mesh sync benchmark: an FSDP2 trainer mesh -> TP generator replicas, ``transport.weights``
mesh sync vs "gather, then broadcast" (what RL frameworks do today), in one run.

    python -m benchmarks.mesh_sync                     # T=2 trainer ranks -> 2 replicas x TP 2, ~100M params
    python -m benchmarks.mesh_sync --layers 2 --hidden 256 --vocab 4096 --versions 3
    python -m benchmarks.mesh_sync --json out.json --markdown out.md

The trainer: ``examples.mesh_sync.model.LlamaLM`` (Hugging Face Llama names), FSDP2-sharded over
T CPU processes (gloo among themselves). The generators: R replicas x TP processes, each holding
vLLM-style fused, TP-sliced local tensors (``transport.plan.generator_rank``) in the wire dtype
(bf16 by default). Per version, in the same processes, one after the other:

* ``mesh`` (this library): every trainer rank ``await MeshPublisher.publish(v)`` of its own
  shards, one-sidedly into exactly the generator ranks that need them; each replica's rank 0
  ``commit()``s, every rank ``apply()``s. Bytes moved: the sum of the publish reports' ``nbytes``
  (what every generator rank needs, summed over ranks).
* ``baseline``: every trainer rank calls ``full_tensor()`` on every parameter (a collective
  all-gather among the trainer ranks); trainer rank 0 casts each to the wire dtype and broadcasts
  it over a gloo group of trainer rank 0 + every generator rank (a subgroup of one world that
  holds trainers and generators, ``torch.distributed.new_group``); every generator rank copies
  its pieces out of each full tensor into its fused local tensors. Bytes moved: full model bytes
  x generator ranks (what the broadcast delivers).

Time of a version, both methods: from the first trainer rank's start (min over trainer ranks of a
wall-clock timestamp taken right after a barrier of all processes) until every rank of every
replica has the version live in its local tensors (max over generator ranks): "time until all
replicas are live". The first ``--warmup`` versions (default 2) are reported separately: version
``v`` travels in slot ``v % 2`` of every generator rank, and the first publish into each slot
plans, prepares the transfer and maps that slot (seconds, once per slot; the first broadcast
connects); the medians and maxima are over the rest. The methods alternate which runs first,
version by version.

Verification: trainer rank 0 computes, from the full weights of every version (``full_tensor()``,
untimed), the SHA-256 of every local tensor of every TP rank; every generator rank hashes its
local tensors after each method and the launcher compares them all. Any difference, a missing
report, a publish that did not reach every generator rank, a mesh byte count other than what
the generator ranks need, or weights that did not change between versions fails the run (exit
status 1, after writing the outputs with ``"verified": false`` and the problems).

Output: the table on stdout; ``--json`` (every version's timestamps, the environment) and
``--markdown`` (date, machine, command, the table). Timings are measurements, never asserted.
See ``benchmarks/_mesh_roles.py`` for what each process does.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from examples.mesh_sync.model import CONFIG

from ..common.capabilities import available_backends
from ..common.errors import BenchError
from ..common.machine import CpuSample, command_line, library, library_line, machine, other_load
from ..common.procs import supervise
from ..common.stats import median
from ._roles import BASELINE, DELTA, MESH, MeshBenchSpec, order, run_rank

_JOIN_S = 30.0
LABELS = {
    MESH: "mesh (transport.weights MeshPublisher -> MeshSubscriber)",
    BASELINE: "baseline (full_tensor() gather + gloo broadcast from trainer rank 0)",
    DELTA: "mesh, delta sync (MeshPublisher(delta=True): only the changed units)",
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mesh_sync", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainers", type=int, default=2, help="trainer ranks, FSDP2 over gloo (default 2)")
    p.add_argument("--replicas", type=int, default=2, help="generator replicas (default 2)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks per replica (default 2)")
    p.add_argument("--versions", type=int, default=6, help="versions published, warm-up included (default 6)")
    p.add_argument("--warmup", type=int, default=2,
                   help="leading versions reported separately, not in the medians (default 2: the mesh's first "
                        "write into each of a generator rank's two slots prepares and maps it)")
    p.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"],
                   help=f"decoder layers (default {CONFIG['num_hidden_layers']}: the example's ~100M model)")
    p.add_argument("--hidden", type=int, default=CONFIG["hidden_size"],
                   help=f"hidden size (default {CONFIG['hidden_size']})")
    p.add_argument("--vocab", type=int, default=CONFIG["vocab_size"],
                   help=f"vocabulary (default {CONFIG['vocab_size']})")
    p.add_argument("--intermediate", type=int, default=None,
                   help="MLP size (default: the example's, scaled with --hidden, rounded to a multiple of 64)")
    p.add_argument("--dtype", default="bfloat16", help="what generators hold and what travels (default bfloat16)")
    p.add_argument("--backends", default="ipc", help="transport backends, comma-separated preference (default ipc)")
    p.add_argument("--timeout", type=float, default=300.0, help="bound of every wait in a process (s, default 300)")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="bound of the whole run (s, default 1800)")
    p.add_argument("--deadline", type=float, default=60.0,
                   help="seconds a mesh publish waits for any one generator rank (default 60)")
    p.add_argument("--poll", type=float, default=0.002,
                   help="seconds between a replica leader's commit() attempts while it waits (default 0.002)")
    p.add_argument("--json", type=Path, default=None, help="write every measurement and the environment here")
    p.add_argument("--markdown", type=Path, default=None,
                   help="write a Markdown report (date, machine, command, table)")
    p.add_argument("--note", action="append", default=[], help="a line for the record (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--update", choices=("constant", "adamw"), default="constant",
                   help="how versions differ: every parameter + 0.01 (default), or one real AdamW step each")
    p.add_argument("--lr", type=float, default=1e-6, help="the AdamW learning rate (--update adamw; default 1e-6)")
    p.add_argument("--delta-sync", action="store_true",
                   help="also run the mesh with delta sync on a second stream, in the same processes")
    p.add_argument("--warm", action="store_true",
                   help="every trainer rank calls MeshPublisher.warm() before the first version (untimed)")
    a = p.parse_args(argv)
    if min(a.trainers, a.replicas, a.tp) < 1:
        p.error("--trainers, --replicas and --tp must be >= 1")
    if a.warmup < 0 or a.versions <= a.warmup:
        p.error("need --warmup >= 0 and --versions > --warmup (at least one timed version)")
    if min(a.layers, a.hidden, a.vocab) < 1 or a.timeout <= 0 or a.run_timeout <= 0 or a.poll <= 0:
        p.error("--layers, --hidden, --vocab, --timeout, --run-timeout and --poll must be positive")
    a.backend_list = tuple(b.strip() for b in a.backends.split(",") if b.strip()) or None
    return a


def model_of(args: argparse.Namespace) -> dict[str, Any]:
    """The model's config: the example's, with the layers, hidden size and vocabulary asked for."""
    inter = args.intermediate
    if inter is None:
        inter = max(64, round(CONFIG["intermediate_size"] * args.hidden / CONFIG["hidden_size"] / 64) * 64)
    return {**CONFIG, "num_hidden_layers": args.layers, "hidden_size": args.hidden, "vocab_size": args.vocab,
            "intermediate_size": inter}


def sizes(spec: MeshBenchSpec) -> dict[str, Any]:
    """The model's size and what each method moves per version, from the model's shapes.

    Raises:
        MeshLayoutError: the model cannot be split over ``spec.tp`` ranks.
    """
    from transport.plan import ITEMSIZE, checkpoint_tensors, generator_rank, model_config, volume

    cfg = model_config(spec.model)
    params = sum(volume(tuple((0, d) for d in shape)) for _, shape in checkpoint_tensors(cfg))
    item = ITEMSIZE[spec.dtype]
    per_rank = []
    for k in range(spec.tp):
        g = generator_rank(cfg, tp=spec.tp, rank=k, dtype=spec.dtype)
        per_rank.append(sum(volume(p.box) * ITEMSIZE[lt.dtype] for lt in g.tensors for p in lt.pieces))
    generators = spec.replicas * spec.tp
    return {
        "params": params, "tensors": len(checkpoint_tensors(cfg)), "nbytes": params * item,
        "generator_ranks": generators,
        "mesh_needed_per_tp_rank": per_rank,
        "mesh_bytes_per_version": spec.replicas * sum(per_rank),
        "baseline_bytes_per_version": params * item * generators,
    }


# -- running the processes -------------------------------------------------------------------------


def run(spec: MeshBenchSpec, run_timeout: float) -> list[dict[str, Any]]:
    """Starts every process, collects their messages and joins them (bounded). Kills every
    process on failure or timeout.

    Raises:
        BenchError: a process failed or the run did not finish within ``run_timeout``.
    """
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, spec, q), name=f"global rank {r}", daemon=True)
             for r in range(spec.world)]
    t0 = time.monotonic()

    def progress(msg: dict[str, Any]) -> None:
        if msg["kind"] == "live" and msg["who"] == spec.generator_names()[-1]:
            print(f"mesh_sync: version {msg['version']} {msg['method']} done "
                  f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)

    messages, errors = supervise(procs, q, run_timeout, progress, _JOIN_S)
    if errors:
        raise BenchError("\n".join(errors))
    return messages


# -- turning messages into results -----------------------------------------------------------------


def assemble(messages: Sequence[dict[str, Any]], spec: MeshBenchSpec, size: dict[str, Any]) -> dict[str, Any]:
    """Per method and version: start, when each generator rank was live, time until all live,
    bytes moved, verification. Every problem found is listed in ``"problems"``."""
    problems: list[str] = []
    trainers = [f"trainer-{i}" for i in range(spec.trainers)]
    gens = spec.generator_names()
    refs = {m["version"]: m["sha"] for m in messages if m["kind"] == "ref"}
    starts: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    lives: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for m in messages:
        if m["kind"] == "start":
            starts.setdefault((m["method"], m["version"]), {})[m["who"]] = m
        elif m["kind"] == "live":
            lives.setdefault((m["method"], m["version"]), {})[m["who"]] = m
    for v in range(spec.versions):
        if v not in refs:
            problems.append(f"version {v}: no reference from trainer rank 0")
        elif v - 1 in refs and any(refs[v][k] == refs[v - 1][k] for k in refs[v]):
            problems.append(f"version {v}: the reference equals version {v - 1}'s (the weights did not change)")
    methods: dict[str, Any] = {}
    for method in spec.methods:
        verified = True
        versions = []
        for v in range(spec.versions):
            st, lv = starts.get((method, v), {}), lives.get((method, v), {})
            missing = [n for n in trainers if n not in st] + [n for n in gens if n not in lv]
            if missing:
                problems.append(f"{method} version {v}: no report from {missing}")
                verified = False
                continue
            mismatched = []
            for g in gens:
                ref, got = refs.get(v, {}).get(str(lv[g]["rank"]), {}), lv[g]["sha"]
                bad = sorted(n for n in set(got) | set(ref) if got.get(n) != ref.get(n))
                if bad or not ref:
                    mismatched.append(f"{g}: {len(bad)} tensors differ ({', '.join(bad[:3])}"
                                      f"{', ...' if len(bad) > 3 else ''})")
            if mismatched:
                verified = False
                problems.append(f"{method} version {v}: NOT bit-for-bit equal to the reference: "
                                + "; ".join(mismatched))
            start = min(st[n]["t_start"] for n in trainers)
            rec: dict[str, Any] = {
                "version": v, "warmup": v < spec.warmup, "first": order(v, spec.methods)[0] == method,
                "t_start": start,
                "all_live_s": max(lv[g]["t_live"] for g in gens) - start,
                "first_live_s": min(lv[g]["t_live"] for g in gens) - start,
                "replica_live_s": {r: max(lv[g]["t_live"] for g in gens if lv[g]["replica"] == r) - start
                                   for r in spec.replica_names()},
                "rank_live_s": {g: lv[g]["t_live"] - start for g in gens},
                "trainer_blocked_s": {n: st[n]["t_end"] - st[n]["t_start"] for n in trainers},
            }
            if method in (MESH, DELTA):
                rec["bytes"] = sum(st[n]["nbytes"] for n in trainers)
                rec["deltas"] = sum(st[n]["deltas"] for n in trainers)
                rec["changed"] = [st[n]["changed"] for n in trainers]
                rec["pack_s"] = {n: st[n]["pack_s"] for n in trainers}
                rec["push_s"] = {n: st[n]["push_s"] for n in trainers}
                rec["status"] = {n: st[n]["status"] for n in trainers}
                fed = {k for n in trainers for k in st[n]["status"]}
                want = {f"{r}/{k}" for r in spec.replica_names() for k in range(spec.tp)}
                bad_status = {f"{n}->{k}": s for n in trainers for k, s in st[n]["status"].items() if s != "done"}
                if bad_status or fed != want or any(st[n]["incomplete"] or st[n]["refused"] for n in trainers):
                    verified = False
                    problems.append(f"{method} version {v}: not every generator rank was served: statuses "
                                    f"{bad_status}, "
                                    f"fed {sorted(fed)}, errors {[st[n]['errors'] for n in trainers]}, "
                                    f"incomplete {[st[n]['incomplete'] for n in trainers]}, "
                                    f"refused {[st[n]['refused'] for n in trainers]}")
                if method == MESH and rec["bytes"] != size["mesh_bytes_per_version"]:
                    verified = False
                    problems.append(f"mesh version {v}: moved {rec['bytes']} bytes, the generator ranks need "
                                    f"{size['mesh_bytes_per_version']}")
            else:
                rec["bytes"] = size["baseline_bytes_per_version"]
            versions.append(rec)
        methods[method] = {"label": LABELS[method], "verified": verified, "versions": versions,
                           "summary": summarize(versions)}
    ratio, delta_ratio = {}, {}
    for stat in ("median_s", "max_s"):
        m, b = methods[MESH]["summary"].get(stat), methods[BASELINE]["summary"].get(stat)
        ratio[stat.removesuffix("_s")] = b / m if m and b else None
        d = methods[DELTA]["summary"].get(stat) if DELTA in methods else None
        delta_ratio[stat.removesuffix("_s")] = d / m if m and d else None
    peak = {m["who"]: m["peak_rss"] for m in messages if m["kind"] == "exit"}
    return {"verified": not problems, "problems": problems, "methods": methods,
            "ratio_baseline_over_mesh": ratio, "ratio_delta_over_mesh": delta_ratio, "peak_rss_bytes": peak}


def summarize(versions: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median and max of the timed versions' time until all live; the warm-up versions' times."""
    timed = [r for r in versions if not r["warmup"]]
    out: dict[str, Any] = {
        "timed_versions": len(timed),
        "warmup_s": [r["all_live_s"] for r in versions if r["warmup"]],
        "bytes_per_version": (median([r["bytes"] for r in timed]) if timed else versions[-1]["bytes"])
        if versions else None,
    }
    if timed:
        out["median_s"] = median([r["all_live_s"] for r in timed])
        out["max_s"] = max(r["all_live_s"] for r in timed)
        out["min_s"] = min(r["all_live_s"] for r in timed)
        out["first_replica_median_s"] = median([min(r["replica_live_s"].values()) for r in timed])
        out["trainer_blocked_median_s"] = median([max(r["trainer_blocked_s"].values()) for r in timed])
        if "push_s" in timed[0]:  # mesh: the slowest trainer rank's snapshot packing and pushes
            out["pack_median_s"] = median([max(r["pack_s"].values()) for r in timed])
            out["push_median_s"] = median([max(r["push_s"].values()) for r in timed])
    return out


# -- output ----------------------------------------------------------------------------------------


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def table(result: dict[str, Any], size: dict[str, Any]) -> str:
    rows = [
        "| method | verified | bytes moved / version | warm-up (s) | median, all replicas live (s) | "
        "max, all live (s) | median, first replica live (s) | trainer blocked, median (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for method in result["methods"]:
        m = result["methods"][method]
        s = m["summary"]
        b = s["bytes_per_version"]
        rows.append(
            f"| {m['label']} | {'yes' if m['verified'] else 'NO'} | "
            f"{'—' if b is None else f'{b / 1e6:.1f} MB'} | {', '.join(_s(x) for x in s['warmup_s']) or '—'} | "
            f"{_s(s.get('median_s'))} | {_s(s.get('max_s'))} | {_s(s.get('first_replica_median_s'))} | "
            f"{_s(s.get('trainer_blocked_median_s'))} |")
    r = result["ratio_baseline_over_mesh"]

    def x(v: float | None) -> str:
        return "—" if v is None else f"{v:.2f}×"

    base, mesh = size["baseline_bytes_per_version"], size["mesh_bytes_per_version"]
    rows += ["", f"baseline ÷ mesh, time until all replicas live: median {x(r['median'])}, max {x(r['max'])}; "
                 f"bytes moved: {base / mesh:.2f}× ({base / 1e6:.1f} MB vs {mesh / 1e6:.1f} MB)."]
    d = result.get("ratio_delta_over_mesh", {})
    if DELTA in result["methods"]:
        timed = [r for r in result["methods"][DELTA]["versions"] if not r["warmup"]]
        changed = [max(c for c in r["changed"] if c is not None) for r in timed if any(c is not None
                                                                                       for c in r["changed"])]
        rows += ["", f"delta ÷ dense mesh, time until all replicas live: median {x(d.get('median'))}, max "
                     f"{x(d.get('max'))}; timed versions sent as deltas to {sum(r['deltas'] for r in timed)} of "
                     f"{len(timed) * spec_pushes(result)} (trainer rank, generator rank) pushes; changed units per "
                     f"trainer rank since the version two back: "
                     f"{', '.join(f'{100 * c:.2f}%' for c in changed) or '—'}."]
    ms = result["methods"][MESH]["summary"]
    if "push_median_s" in ms:
        rows += ["", f"mesh, medians of the slowest trainer rank: snapshot packing {ms['pack_median_s']:.3f} s, "
                     f"pushes {ms['push_median_s']:.3f} s (the rest until all live: each replica's commit and every "
                     "rank's apply, a copy from its slot into its tensors)."]
    return "\n".join(rows)


def spec_pushes(result: dict[str, Any]) -> int:
    """(trainer rank, generator rank) pushes per version of the dense mesh."""
    versions = result["methods"][MESH]["versions"]
    return sum(len(s) for s in versions[0]["status"].values()) if versions else 0


def per_version_table(result: dict[str, Any]) -> str:
    rows = ["| version | method | ran first | all live (s) | bytes (MB) | per replica live (s) |",
            "| --- | --- | --- | --- | --- | --- |"]
    for method in result["methods"]:
        for r in result["methods"][method]["versions"]:
            reps = ", ".join(f"{k} {v:.3f}" for k, v in r["replica_live_s"].items())
            what = "warm-up" if r["warmup"] else "timed"
            rows.append(f"| {r['version']} ({what}) | {method} | {'yes' if r['first'] else 'no'} | "
                        f"{r['all_live_s']:.3f} | {r['bytes'] / 1e6:.2f} | {reps} |")
    return "\n".join(rows)


def describe(spec: MeshBenchSpec, size: dict[str, Any]) -> str:
    m = spec.model
    return (f"{spec.trainers} trainer ranks (FSDP2, gloo) -> {spec.replicas} replicas x TP {spec.tp} "
            f"({size['generator_ranks']} generator ranks); model: Llama-style, {m['num_hidden_layers']} layers, "
            f"hidden {m['hidden_size']}, intermediate {m['intermediate_size']}, vocab {m['vocab_size']}: "
            f"{size['params'] / 1e6:.1f}M parameters in {size['tensors']} tensors, {size['nbytes'] / 1e6:.1f} MB "
            f"in {spec.dtype}; transport backends {','.join(spec.backends or ('default',))}; "
            f"{spec.versions} versions ({spec.warmup} warm-up)")


def write_outputs(args: argparse.Namespace, doc: dict[str, Any], text: str) -> list[Path]:
    written = []
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
        written.append(args.json)
    if args.markdown:
        info = doc["machine"]
        md = [
            f"# Mesh sync benchmark: transport mesh sync vs gather + broadcast, {doc['date'][:10]}",
            "",
            (f"Machine: {info['nproc']} cores ({info['cpu']}), {info['memory_gib']} GiB, no GPU; "
             f"Python {info['python']}, torch {info['torch']} ({info['platform']}). Load average before the run: "
             f"{', '.join(f'{x:.2f}' for x in info['loadavg_before'])}."),
            "",
            f"Command: `{doc['command']}` (run from the repository root; {doc['wall_s'] / 60:.1f} min).",
            "",
            library_line(info["library"]),
            "",
            f"Started {doc['date']}. Setup: {doc['setup']}.",
            "",
            ("Time until all replicas are live: from the first trainer rank's start (mesh: `publish(v)` called; "
             "baseline: the first `full_tensor()` called) until the last generator rank of every replica has the "
             "version in its local tensors (mesh: `apply(v)` returned; baseline: its last piece copied). Medians "
             f"and maxima over the {doc['config']['versions'] - doc['config']['warmup']} timed versions; "
             "\"trainer blocked\" = the slowest trainer rank's `publish()` / gather-and-broadcast loop. "
             "Bytes moved: mesh = the publish reports' bytes (each generator rank's slices); baseline = full "
             "model bytes x generator ranks (what the broadcast delivers)."),
            "",
            text,
            "",
            "Every version:",
            "",
            per_version_table(doc["result"]),
        ]
        for n in doc["notes"]:
            md += ["", f"Note: {n}"]
        if args.json:
            md += ["", f"Every version's timestamps and the environment: `{args.json.name}`."]
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text("\n".join(md) + "\n")
        written.append(args.markdown)
    return written


# -- main ------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cmd = command_line(argv, "benchmarks.mesh_sync")
    started = datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds")
    info = machine()
    info["library"] = library()
    info["loadavg_before"] = list(os.getloadavg())
    notes: list[str] = list(args.note)
    known = available_backends()
    unusable = [f"{b}: {known.get(b, 'unknown backend')}" for b in args.backend_list or () if known.get(b, "?")]
    if unusable:
        print(f"mesh_sync: --backends: {'; '.join(unusable)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="mesh-sync-bench-") as tmp:
        spec = MeshBenchSpec(trainers=args.trainers, replicas=args.replicas, tp=args.tp, versions=args.versions,
                             warmup=args.warmup, model=model_of(args), dtype=args.dtype, backends=args.backend_list,
                             tmp=tmp, timeout=args.timeout, deadline=args.deadline, poll_s=args.poll, seed=args.seed,
                             update=args.update, lr=args.lr, delta_sync=args.delta_sync,
                             warm=args.warm)
        try:
            size = sizes(spec)
        except ValueError as exc:  # MeshLayoutError: e.g. a dimension not divisible by --tp
            print(f"mesh_sync: this model cannot be split over TP {spec.tp}: {exc}", file=sys.stderr)
            return 2
        setup = describe(spec, size)
        print(f"mesh_sync: {info['nproc']}-core {info['cpu']}; torch {info['torch']}; {setup}", flush=True)
        t0 = time.monotonic()
        cpu0 = CpuSample.take()
        try:
            messages = run(spec, args.run_timeout)
        except BenchError as exc:
            print(f"mesh_sync: FAILED:\n{exc}", file=sys.stderr)
            return 1
        wall_s = time.monotonic() - t0
        load = other_load(cpu0, CpuSample.take())
    info["other_load_during_run"] = load
    notes.append(f"other processes on this machine used {load['other_cpu_s']:g} CPU-seconds during the run "
                 f"(on average {load['other_cores_avg']:g} of {info['nproc']} cores, {100 * load['other_share']:.0f}%)"
                 + ("; the timings are disturbed: rerun on a quiet machine" if load["other_share"] > 0.05 else ""))
    result = assemble(messages, spec, size)
    for m in sorted((m for m in messages if m["kind"] == "warm"), key=lambda m: (m["method"], m["rank"])):
        notes.append(f"warm() before version 0 (untimed): trainer rank {m['rank']} ({m['method']}) warmed "
                     f"{m['warmed']} prepared transfers in {m['warm_s']:.3f} s")
    text = table(result, size)
    doc = {
        "benchmark": "mesh_sync", "date": started, "command": cmd, "machine": info, "wall_s": round(wall_s, 1),
        "setup": setup,
        "config": {"trainers": spec.trainers, "replicas": spec.replicas, "tp": spec.tp,
                   "generator_ranks": size["generator_ranks"], "versions": spec.versions, "warmup": spec.warmup,
                   "dtype": spec.dtype, "backends": list(spec.backends or ()), "timeout_s": spec.timeout,
                   "deadline_s": spec.deadline, "poll_s": spec.poll_s, "delta": spec.delta, "seed": spec.seed,
                   "update": spec.update, "lr": spec.lr, "delta_sync": spec.delta_sync, "warm": spec.warm,
                   "broadcast_group": "trainer rank 0 + every generator rank: a torch.distributed.new_group of the "
                                      "one gloo world of trainers and generators",
                   "order": "the methods rotate by version: " + ", ".join(spec.methods) + " first on versions "
                            "0, 1, ... modulo their number"},
        "model": {"config": spec.model, "params": size["params"], "tensors": size["tensors"],
                  "nbytes": size["nbytes"]},
        "bytes": {"mesh_per_version": size["mesh_bytes_per_version"],
                  "mesh_needed_per_tp_rank": size["mesh_needed_per_tp_rank"],
                  "baseline_per_version": size["baseline_bytes_per_version"]},
        "verified": {m: result["methods"][m]["verified"] for m in spec.methods},
        "notes": notes,
        "result": result,
    }
    print()
    print(text)
    print()
    print(per_version_table(result))
    for n in notes:
        print(f"Note: {n}")
    for path in write_outputs(args, doc, text):
        print(f"wrote {path}")
    if result["problems"]:
        print("mesh_sync: VERIFICATION FAILED:\n  " + "\n  ".join(result["problems"]), file=sys.stderr)
        return 1
    print("mesh_sync: every method verified bit for bit against the trainer's full weights, every version")
    return 0
