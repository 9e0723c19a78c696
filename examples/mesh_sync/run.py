"""Mesh-to-mesh weight sync: an FSDP2-sharded trainer mesh -> tensor-parallel generator replicas.

    python -m examples.mesh_sync                          # 2 trainer ranks, 2 replicas x TP 2, local processes
    python -m examples.mesh_sync --slow-replica replica-1 # that replica lags; the other never waits for it
    python -m examples.mesh_sync --kill-rank replica-1/1 --kill-at 1   # kill -9 a generator rank, restart it
    python -m examples.mesh_sync --launcher ray           # the same roles as Ray actors

Every trainer rank pushes only its own shards, one-sidedly, into exactly the generator ranks
that need them (the plan every process computes for itself from the published layouts); each
replica applies a version only when all its ranks hold it. Every applied generator tensor is
checked bit for bit against the reference slice of the trainer's full weights of that step.
Writes ``summary.json`` (``"verified"``, per-replica sync times, bytes moved), ``sync.png`` and
the per-process logs into ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import socket
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import anyio

import transport

from .model import CONFIG
from .roles import Config, generator_name, replica_names, run_role

REPO = Path(__file__).resolve().parents[2]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.mesh_sync", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--backends", default=None, help="comma-separated preference, e.g. ipc,tcp")
    p.add_argument("--dtype", default="bfloat16", help="what generators hold (cast on the trainer ranks)")
    p.add_argument("--deadline", type=float, default=10.0, help="seconds a trainer rank waits for a generator rank")
    p.add_argument("--slow-replica", default=None, help="e.g. replica-1: its generation steps take longer")
    p.add_argument("--slow-seconds", type=float, default=1.0)
    p.add_argument("--kill-rank", default=None, help="REPLICA/RANK to kill -9 and restart, e.g. replica-1/1")
    p.add_argument("--kill-at", type=int, default=1, help="after this training step")
    p.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"], help="model size (default: ~100M)")
    p.add_argument("--hidden", type=int, default=CONFIG["hidden_size"])
    p.add_argument("--vocab", type=int, default=CONFIG["vocab_size"])
    p.add_argument("--launcher", choices=("local", "ray"), default="local")
    p.add_argument("--store", default=None, help="rendezvous URL (default: file:// temp dir; tcp:// for ray)")
    p.add_argument("--out", default="runs/mesh_sync")
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.kill_rank is not None:
        rep, _, rank = args.kill_rank.partition("/")
        if rep not in [f"replica-{i}" for i in range(args.replicas)] or not rank.isdigit() or int(rank) >= args.tp:
            p.error(f"--kill-rank {args.kill_rank!r}: expected replica-I/RANK with I < {args.replicas}, "
                    f"RANK < {args.tp}")
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Launcher:
    """The launcher's own peer (``launcher``): trainer rank 0 rings ``step`` after every step,
    generator ranks ring ``<name>.applied``. It lives for the whole run; the launch functions run
    in a worker thread and call into it through anyio's portal."""

    def __init__(self, cfg: Config, t: transport.Transport) -> None:
        self.cfg, self.t = cfg, t

    async def _finish(self, grace: float) -> None:
        names = [generator_name(r, k) for r in replica_names(self.cfg) for k in range(self.cfg.tp)]
        with anyio.move_on_after(grace):
            for n in names:
                await self.t.wait_signal(f"{n}.applied", at_least=self.cfg.steps, timeout=grace)
        for n in [*names, *(f"trainer-{i}" for i in range(self.cfg.trainers))]:
            try:
                await self.t.signal(n, "stop", 1, timeout=10)
            except transport.TransportError as exc:
                print(f"launcher: cannot stop {n}: {exc}", flush=True)

    def wait_step(self, step: int) -> None:
        """Blocks until trainer rank 0 finished ``step`` steps."""
        anyio.from_thread.run(functools.partial(self.t.wait_signal, "step", step, timeout=self.cfg.timeout))

    def finish(self, grace: float = 60.0) -> None:
        """Waits (at most ``grace`` s) until every generator rank applied the last version, then
        tells them all to stop."""
        anyio.from_thread.run(self._finish, grace)


def launch_local(cfg: Config, args: argparse.Namespace, launcher: _Launcher) -> int:
    ctx = multiprocessing.get_context("spawn")
    cfgd = asdict(cfg)
    procs: dict[str, Any] = {}
    for r in replica_names(cfg):
        for k in range(cfg.tp):
            procs[generator_name(r, k)] = ctx.Process(target=run_role, args=("generator", cfgd, r, k))
    trainers = [ctx.Process(target=run_role, args=("trainer", cfgd, i)) for i in range(cfg.trainers)]
    for p in [*procs.values(), *trainers]:
        p.start()
    try:
        if args.kill_rank is not None:
            rep, _, k = args.kill_rank.partition("/")
            victim = generator_name(rep, int(k))
            launcher.wait_step(args.kill_at + 1)
            procs[victim].kill()
            procs[victim].join(30)
            print(f"launcher: killed {victim} after step {args.kill_at}; restarting it (it pulls its slices)",
                  flush=True)
            procs[victim] = ctx.Process(target=run_role, args=("generator", cfgd, rep, int(k), True))
            procs[victim].start()
        launcher.wait_step(cfg.steps)
        launcher.finish()
        for p in trainers:
            p.join(60)
            if p.exitcode != 0:
                print(f"launcher: a trainer rank failed (exit code {p.exitcode})", file=sys.stderr)
                return 1
        for n, p in procs.items():
            p.join(60)
            if p.exitcode != 0:
                print(f"launcher: {n} exited with code {p.exitcode}", file=sys.stderr)
                return 1
        return 0
    finally:
        for p in [*procs.values(), *trainers]:
            if p.is_alive():
                p.kill()
                p.join(10)


def launch_ray(cfg: Config, args: argparse.Namespace, launcher: _Launcher) -> int:
    try:
        import ray
    except ImportError:
        raise SystemExit("--launcher ray needs Ray: pip install 'ray>=2.40' (or pip install -e '.[ray]')") from None
    ray.init(num_cpus=cfg.trainers + cfg.replicas * cfg.tp + 1, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        role = ray.remote(num_cpus=1)(_RayRole)
        cfgd = asdict(cfg)
        # Ray adds `.remote` at run time, which its type hints do not model: handles are Any.
        actors: dict[str, Any] = {}
        futures: dict[str, Any] = {}
        for r in replica_names(cfg):
            for k in range(cfg.tp):
                n = generator_name(r, k)
                actors[n] = role.options(name=n).remote()
                futures[n] = actors[n].run.remote("generator", cfgd, r, k)
        trainer_futures = []
        for i in range(cfg.trainers):
            actors[f"trainer-{i}"] = role.options(name=f"trainer-{i}").remote()
            trainer_futures.append(actors[f"trainer-{i}"].run.remote("trainer", cfgd, i))
        if args.kill_rank is not None:
            rep, _, k = args.kill_rank.partition("/")
            victim = generator_name(rep, int(k))
            launcher.wait_step(args.kill_at + 1)
            ray.kill(actors[victim])
            print(f"launcher: killed Ray actor {victim} after step {args.kill_at}; restarting it", flush=True)
            actors[victim] = role.options(name=victim + "-restarted").remote()
            futures[victim] = actors[victim].run.remote("generator", cfgd, rep, int(k), True)
        launcher.wait_step(cfg.steps)
        launcher.finish()
        ray.get(trainer_futures, timeout=60)
        for n, f in futures.items():
            print(f"launcher: {n} finished: {ray.get(f, timeout=60)}", flush=True)
        return 0
    finally:
        ray.shutdown()


class _RayRole:
    def run(self, role: str, cfgd: dict[str, Any], *args: Any) -> dict[str, Any]:
        return run_role(role, cfgd, *args)


async def _launch(cfg: Config, args: argparse.Namespace) -> int:
    async with transport.Transport("launcher", store=cfg.store, backends=cfg.backends, timeout=cfg.timeout) as t:
        launch = launch_ray if args.launcher == "ray" else launch_local
        return await anyio.to_thread.run_sync(launch, cfg, args, _Launcher(cfg, t))


# -- report -------------------------------------------------------------------------------------


def summarize(out: Path, cfg: Config) -> dict[str, Any]:
    trainers = [json.loads((out / f"trainer-{i}.json").read_text())["history"] for i in range(cfg.trainers)]
    starts = {h["step"]: min(t[h["step"]]["publish_start"] for t in trainers) for h in trainers[0]}
    refs = {int(p.stem): json.loads(p.read_text()) for p in (out / "refs").glob("*.json")}
    last = cfg.steps - 1
    verified, problems = True, []
    replicas: dict[str, Any] = {}
    for r in replica_names(cfg):
        at: dict[int, list[float]] = {}
        restarted = {}
        for k in range(cfg.tp):
            name = generator_name(r, k)
            logs = [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}*.json"))]
            final = None
            for log in logs:
                if log["pulled"] is not None:
                    restarted[name] = {"pulled": log["pulled"], "then_applied": [a["version"] for a in log["applied"]]}
                for a in log["applied"]:
                    if a["sha"] != refs[a["version"]][str(k)]:
                        verified = False
                        problems.append(f"{name}: version {a['version']} differs from the reference")
                    at.setdefault(a["version"], []).append(a["at"])
                    final = a["version"]
            if final != last:
                verified = False
                problems.append(f"{name}: ended on version {final}, not {last}")
        lat = {v: max(ts) - starts[v] for v, ts in sorted(at.items()) if len(ts) == cfg.tp}
        stragglers = sum(1 for t in trainers for h in t for k, s in h["status"].items()
                         if k.startswith(r + "/") and s != "done")
        replicas[r] = {
            "versions_applied": sorted(lat),  # by every rank (a killed rank's own log is lost)
            "sync_ms_mean": round(1e3 * sum(lat.values()) / max(1, len(lat)), 1),
            "sync_ms_max": round(1e3 * max(lat.values(), default=0.0), 1),
            "sync_ms": {str(v): round(1e3 * s, 1) for v, s in lat.items()},
            "pushes_not_done": stragglers,
            "restarted_ranks": restarted,
        }
    summary = {
        "verified": verified,
        "problems": problems,
        "trainer_ranks": cfg.trainers, "replicas": cfg.replicas, "tp": cfg.tp, "steps": cfg.steps,
        "dtype": cfg.dtype,
        "loss_first": round(trainers[0][0]["loss"], 4), "loss_last": round(trainers[0][-1]["loss"], 4),
        "bytes_moved": sum(h["bytes"] for t in trainers for h in t),
        "bytes_per_version": [sum(t[s]["bytes"] for t in trainers) for s in range(len(trainers[0]))],
        "push_ms_mean": round(1e3 * sum(h["push_s"] for t in trainers for h in t) / sum(len(t) for t in trainers), 1),
        "per_replica": replicas,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def plot(out: Path, summary: dict[str, Any]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: pip install matplotlib (or pip install -e '.[examples]')", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for r, s in summary["per_replica"].items():
        xs = [int(v) for v in s["sync_ms"]]
        ax.plot(xs, list(s["sync_ms"].values()), marker="o", label=r)
    ax.set_xlabel("version (training step)")
    ax.set_ylabel("publish start -> applied on every rank (ms)")
    ax.set_title(f"mesh sync: {summary['trainer_ranks']} FSDP2 trainer ranks -> "
                 f"{summary['replicas']} replicas x TP {summary['tp']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / "sync.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.json"), *out.glob("refs/*.json")]:
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="mesh-sync-") as tmp:
        host = None
        store = args.store
        if store is None and args.launcher == "ray":
            host = transport.serve_store("127.0.0.1:0")  # this process hosts the store; actors join it
            store = host.url
        cfg = Config(store=store or f"file://{tmp}/store", out=str(out), trainers=args.trainers,
                     replicas=args.replicas, tp=args.tp, steps=args.steps,
                     backends=args.backends.split(",") if args.backends else None, dtype=args.dtype,
                     deadline=args.deadline, master_port=_free_port(), slow_replica=args.slow_replica,
                     slow_seconds=args.slow_seconds, timeout=args.timeout,
                     model={**CONFIG, "num_hidden_layers": args.layers, "hidden_size": args.hidden,
                            "vocab_size": args.vocab, "intermediate_size": CONFIG["intermediate_size"] * args.hidden
                            // CONFIG["hidden_size"]})
        print(f"mesh_sync: {cfg.trainers} trainer ranks (FSDP2, gloo) -> {cfg.replicas} replicas x TP {cfg.tp} "
              f"({args.launcher}), store {cfg.store}, {cfg.steps} steps", flush=True)
        t0 = time.perf_counter()
        rc = anyio.run(_launch, cfg, args, backend="trio")
        if host is not None:
            host.close()
    if rc != 0:
        return rc
    summary = summarize(out, cfg)
    png = plot(out, summary)
    print(f"mesh_sync: done in {time.perf_counter() - t0:.1f}s")
    print(json.dumps({k: v for k, v in summary.items() if k != "per_replica"}, indent=2))
    for r, s in summary["per_replica"].items():
        print(f"  {r}: applied {s['versions_applied']}, sync mean {s['sync_ms_mean']} ms, max {s['sync_ms_max']} ms, "
              f"pushes not done {s['pushes_not_done']}")
    print(f"summary: {out / 'summary.json'}" + (f"  plot: {png}" if png else ""))
    return 0 if summary["verified"] else 1
