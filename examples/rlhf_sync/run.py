"""Launches the RL weight-sync example: one trainer, N generators, local processes or Ray actors.

    python -m examples.rlhf_sync                       # 2 generators, local processes, file store
    python -m examples.rlhf_sync --slow-generator gen-1 --slow-seconds 0.5
    python -m examples.rlhf_sync --kill-at 40          # kill gen-1 at step 40, start a replacement
    python -m examples.rlhf_sync --backends tcp        # force a backend
    python -m examples.rlhf_sync --launcher ray        # the same roles as Ray actors

It prints one line per training step (reward, staleness of the rollouts used, sync time per
generator), then a summary, and writes ``trainer.json`` (the per-step log), ``summary.json`` and
``sync.png`` (reward and sync time vs step) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import anyio

import transport

from .roles import Config, run_role

REPO = Path(__file__).resolve().parents[2]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.rlhf_sync", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--generators", type=int, default=2, help="number of generator processes (>= 2)")
    p.add_argument("--backends", default=None, help="comma-separated preference, e.g. ipc,tcp (default: all available)")
    p.add_argument("--slow-generator", default=None, help="name of a generator to slow down, e.g. gen-1")
    p.add_argument("--slow-seconds", type=float, default=0.5,
                   help="extra seconds per batch for the slow generator (blocking)")
    p.add_argument("--kill-at", type=int, default=None,
                   help="kill the last generator at this step and start a replacement")
    p.add_argument("--deadline", type=float, default=5.0, help="publish deadline per generator (seconds)")
    p.add_argument("--launcher", choices=("local", "ray"), default="local")
    p.add_argument("--store", default=None, help="rendezvous URL (default: a fresh file:// temp dir; tcp:// for ray)")
    p.add_argument("--out", default="runs/rlhf_sync", help="directory for trainer.json, summary.json, sync.png")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="bound on the whole run (seconds)")
    args = p.parse_args(argv)
    if args.generators < 2:
        p.error("--generators must be >= 2")
    return args


def make_config(args: argparse.Namespace, store: str) -> Config:
    gens = [f"gen-{i}" for i in range(args.generators)]
    if args.slow_generator and args.slow_generator not in gens:
        raise SystemExit(f"--slow-generator {args.slow_generator!r} is not one of {gens}")
    return Config(
        store=store,
        out=str(Path(args.out).resolve()),
        generators=gens,
        steps=args.steps,
        backends=args.backends.split(",") if args.backends else None,
        deadline=args.deadline,
        seed=args.seed,
        slow={args.slow_generator: args.slow_seconds} if args.slow_generator else {},
        notify="launcher",
    )


async def wait_for_step(cfg: Config, step: int, timeout: float) -> None:
    async with transport.Transport("launcher", store=cfg.store, backends=cfg.backends, timeout=timeout) as t:
        await t.wait_signal("step", at_least=step, timeout=timeout)


# -- local processes ----------------------------------------------------------------------------


def launch_local(cfg: Config, args: argparse.Namespace) -> int:
    ctx = multiprocessing.get_context("spawn")
    cfgd = asdict(cfg)
    procs = {g: ctx.Process(target=run_role, args=("generator", cfgd, g), name=g) for g in cfg.generators}
    procs["trainer"] = ctx.Process(target=run_role, args=("trainer", cfgd), name="trainer")
    for p in procs.values():
        p.start()
    deadline = time.monotonic() + args.timeout
    try:
        if args.kill_at is not None:
            victim = cfg.generators[-1]
            anyio.run(wait_for_step, cfg, args.kill_at, args.timeout)
            procs[victim].kill()
            procs[victim].join(30)
            print(f"launcher: killed {victim} (pid {procs[victim].pid}) at step {args.kill_at}; "
                  "starting a replacement", flush=True)
            procs[victim] = ctx.Process(target=run_role, args=("generator", cfgd, victim), name=victim + "-replacement")
            procs[victim].start()
        procs["trainer"].join(max(1.0, deadline - time.monotonic()))
        if procs["trainer"].exitcode != 0:
            print(f"launcher: trainer failed (exit code {procs['trainer'].exitcode})", file=sys.stderr)
            return 1
        for g in cfg.generators:
            procs[g].join(30)
            print(f"launcher: {g} exited with code {procs[g].exitcode}", flush=True)
        return 0
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join(10)


# -- Ray actors ---------------------------------------------------------------------------------


def launch_ray(cfg: Config, args: argparse.Namespace) -> int:
    try:
        import ray
    except ImportError:
        raise SystemExit(
            "--launcher ray needs Ray: pip install 'ray>=2.40' (or pip install -e '.[examples]')"
        ) from None
    ray.init(num_cpus=len(cfg.generators) + 2, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        Role = ray.remote(num_cpus=1)(_RayRole)
        cfgd = asdict(cfg)
        # Ray adds `.remote` to an actor's methods at runtime, which its type hints do not model: handles are Any.
        actors: dict[str, Any] = {g: Role.options(name=g).remote() for g in cfg.generators}
        actors["trainer"] = Role.options(name="trainer").remote()
        futures = {g: actors[g].run.remote("generator", cfgd, g) for g in cfg.generators}
        futures["trainer"] = actors["trainer"].run.remote("trainer", cfgd)
        if args.kill_at is not None:
            victim = cfg.generators[-1]
            anyio.run(wait_for_step, cfg, args.kill_at, args.timeout)
            ray.kill(actors[victim])
            print(f"launcher: killed Ray actor {victim} at step {args.kill_at}; starting a replacement", flush=True)
            actors[victim] = Role.options(name=victim + "-replacement").remote()
            futures[victim] = actors[victim].run.remote("generator", cfgd, victim)
        ray.get(futures["trainer"], timeout=args.timeout)
        for g in cfg.generators:
            # A generator's task may fail in any way (Ray wraps every error), e.g. a replacement that came up
            # after the trainer finished: reported, not fatal.
            try:
                print(f"launcher: {g} finished: {ray.get(futures[g], timeout=60)}", flush=True)
            except Exception as exc:  # noqa: BLE001 - reported, not fatal
                last = str(exc).splitlines()[-1]
                print(f"launcher: {g} did not finish cleanly: {type(exc).__name__}: {last}", flush=True)
        return 0
    finally:
        ray.shutdown()


class _RayRole:
    def run(self, role: str, cfgd: dict, name: str | None = None) -> dict:
        return run_role(role, cfgd, name)


# -- report -------------------------------------------------------------------------------------


def summarize(out: Path) -> dict:
    history = json.loads((out / "trainer.json").read_text())["history"]
    n = max(1, min(10, len(history) // 5))
    first = sum(r["reward"] for r in history[:n]) / n
    last = sum(r["reward"] for r in history[-n:]) / n
    gens = sorted({g for r in history for g in r["sync_s"]})
    sync = {}
    for g in gens:
        xs = [r["sync_s"][g] for r in history if g in r["sync_s"] and r["sync_status"][g] == "done"]
        sync[g] = {"mean_ms": round(1e3 * sum(xs) / max(1, len(xs)), 2), "done": len(xs),
                   "not_done": sum(1 for r in history if g in r["sync_status"] and r["sync_status"][g] != "done")}
    summary = {
        "steps": len(history),
        f"reward_first_{n}": round(first, 3),
        f"reward_last_{n}": round(last, 3),
        "reward_gain": round(last - first, 3),
        "staleness_mean": round(sum(r["staleness_mean"] for r in history) / len(history), 3),
        "sync": sync,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def plot(out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: pip install matplotlib (or pip install -e '.[examples]')", file=sys.stderr)
        return None
    history = json.loads((out / "trainer.json").read_text())["history"]
    steps = [r["step"] for r in history]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    ax1.plot(steps, [r["reward"] for r in history], color="tab:green")
    ax1.set_ylabel("reward (fraction sorted)")
    ax1.set_title("RL weight sync with transport: trainer → generators, no barrier")
    ax1.grid(alpha=0.3)
    for g in sorted({g for r in history for g in r["sync_s"]}):
        xs = [r["step"] for r in history if g in r["sync_s"]]
        ys = [1e3 * r["sync_s"][g] for r in history if g in r["sync_s"]]
        ax2.plot(xs, ys, marker=".", linestyle="-", label=g)
    ax2.set_yscale("log")
    ax2.set_xlabel("training step")
    ax2.set_ylabel("sync time per generator (ms)")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "sync.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rlhf-sync-") as tmp:
        store_host = None
        store = args.store
        if store is None and args.launcher == "ray":
            import transport

            store_host = transport.serve_store("127.0.0.1:0")  # this process hosts it; actors join
            store = store_host.url
        cfg = make_config(args, store or f"file://{tmp}/store")
        print(f"rlhf_sync: trainer + {len(cfg.generators)} generators ({args.launcher}), store {cfg.store}, "
              f"backends {cfg.backends or 'all available'}, {cfg.steps} steps", flush=True)
        t0 = time.perf_counter()
        rc = launch_ray(cfg, args) if args.launcher == "ray" else launch_local(cfg, args)
        if store_host is not None:
            store_host.close()
    if rc != 0:
        return rc
    summary = summarize(out)
    png = plot(out)
    print(f"rlhf_sync: done in {time.perf_counter() - t0:.1f}s")
    print(json.dumps(summary, indent=2))
    print(f"log: {out / 'trainer.json'}  summary: {out / 'summary.json'}" + (f"  plot: {png}" if png else ""))
    return 0
