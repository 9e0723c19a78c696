"""A trainer and vLLM engines on this machine: after every optimizer step the trainer pushes its
weights into every engine with ``transport`` and checks that each engine now generates exactly
what the trainer's own ``transformers`` model does on the same weights.

    python -m examples.vllm_sync                     # 2 offline LLM engines, TP=1, fp32
    python -m examples.vllm_sync --tp 2              # each engine TP=2 (both ranks load each version)
    python -m examples.vllm_sync --serve             # engines are OpenAI servers (HTTP weight-sync routes)
    python -m examples.vllm_sync --trainers 2        # 2 FSDP2 trainer ranks push their own shards (mesh path)
    python -m examples.vllm_sync --kill-engine       # kill -9 engine-1 after step 1, start a new one
    python -m examples.vllm_sync --slow-engine       # SIGSTOP engine-1 during a sync: engine-0 is not delayed
    python -m examples.vllm_sync --trainers 2 --kill-trainer   # trainer rank 1 dies mid-push

The model is a tiny Llama-style one built locally (``model.py``); the training step is SFT on
the engine's own greedy outputs toward a fixed target continuation, so the weights really
change. ``summary.json`` (``"verified"``, per-engine sync and pause times) and ``sync.png`` go to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from . import model as tiny
from .engines import Generation, OfflineEngine, ServedEngine, free_port, signal_all

TOL = {"float32": 2e-4, "bfloat16": 0.15}  # max |logprob(vLLM) - logprob(trainer)|: fp32 exact, bf16 noise
PROMPTS, MAX_TOKENS = 4, 6


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.vllm_sync", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--trainers", type=int, default=1, choices=(1, 2))
    p.add_argument("--serve", action="store_true", help="engines are vLLM OpenAI servers driven over HTTP")
    p.add_argument("--dtype", default="float32", choices=tuple(TOL))
    p.add_argument("--kill-engine", action="store_true", help="kill -9 engine-1 after step 1 and start a new one")
    p.add_argument("--slow-engine", action="store_true", help="SIGSTOP engine-1 for the sync of step 2")
    p.add_argument("--kill-trainer", action="store_true", help="trainer rank 1 dies before pushing the last step")
    p.add_argument("--receive", default="whole", choices=("whole", "slices"),
                   help="each engine rank receives whole tensors or only its TP slices")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds one engine's update may take")
    p.add_argument("--store", default=None, help="rendezvous URL (default: a fresh file:// dir)")
    p.add_argument("--out", default="runs/vllm_sync")
    a = p.parse_args(argv)
    if a.kill_trainer and a.trainers != 2:
        p.error("--kill-trainer needs --trainers 2")
    if (a.kill_engine or a.slow_engine) and a.engines < 2:
        p.error("--kill-engine / --slow-engine need --engines >= 2")
    return a


# -- training -----------------------------------------------------------------------------------


def sft_step(model: Any, opt: Any, prompt_ids: list[list[int]], step: int) -> float:
    """One SFT step: teach the model to continue each prompt with a fixed target (the prompt's
    words shifted by ``step + 1``), so every version really differs."""
    words = tiny.VOCAB - len(tiny.SPECIALS)
    seqs = [ids + [len(tiny.SPECIALS) + (i - len(tiny.SPECIALS) + step + 1) % words for i in ids] for ids in prompt_ids]
    x = torch.tensor(seqs)
    logits = model(x[:, :-1]).logits
    n = len(prompt_ids[0])
    loss = torch.nn.functional.cross_entropy(logits[:, n - 1 :].reshape(-1, logits.shape[-1]), x[:, n:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def compare(ref: Any, gens: list[Generation]) -> tuple[bool, float]:
    """Whether ``ref`` picks the same greedy tokens, and the largest logprob difference."""
    same, worst = True, 0.0
    for g in gens:
        greedy, lp = tiny.reference_logprobs(ref, g.prompt_ids, g.tokens)
        same &= greedy == g.tokens
        worst = max(worst, max(abs(a - b) for a, b in zip(lp, g.logprobs, strict=True)))
    return same, worst


def _dist(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))


def _sharded(model: Any) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def trainer_rank1(cfg: dict[str, Any]) -> None:
    """Trainer rank 1 of 2: trains in step with rank 0 and pushes its own shards."""
    from transport.vllm import ShardSource, TransportTrainerEngine, TransportTrainerInitInfo

    torch.set_num_threads(1)
    _dist(1, 2, cfg["port"])
    model = _sharded(tiny.load(cfg["model"], cfg["dtype"]))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    info = TransportTrainerInitInfo(rank=1, store=cfg["store"], timeout=cfg["timeout"], deadline=cfg["timeout"])
    eng = TransportTrainerEngine.trainer_init(info, client=[], source=ShardSource(model))
    for step in range(cfg["steps"]):
        prompt_ids = _recv()
        sft_step(model, opt, prompt_ids, step)
        {k: v.full_tensor() for k, v in model.state_dict().items()}  # rank 0's reference copy
        if cfg["kill_trainer"] and step == cfg["steps"] - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # dies mid-push: rank 0's pieces of this version land, not ours
        eng.send_weights()
        torch.distributed.barrier()
    eng.shutdown()
    torch.distributed.destroy_process_group()


def _recv() -> list[list[int]]:
    obj: list[Any] = [None]
    torch.distributed.broadcast_object_list(obj, src=0)
    return list(obj[0])


def _send(prompt_ids: list[list[int]]) -> None:
    torch.distributed.broadcast_object_list([prompt_ids], src=0)


# -- the run ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vllm_sync-"))
    store = a.store or f"file://{work / 'store'}"
    model_dir = str(tiny.build(work / "model", dtype=a.dtype))
    torch.manual_seed(0)
    t_start = time.time()
    summary: dict[str, Any] = {"args": vars(a), "steps": [], "engines": {}, "verified": False}
    engines: dict[str, Any] = {}
    rank1 = None
    try:
        from vllm.distributed.weight_transfer.base import ModuleSource

        from transport.vllm import ShardSource, TransportTrainerEngine, TransportTrainerInitInfo

        names = [f"engine-{i}" for i in range(a.engines)]
        engines = start_engines(a, names, model_dir, out)
        for n, e in engines.items():
            summary["engines"][n] = {"start_s": e.started_s}
        ref = tiny.load(model_dir, a.dtype)  # the trainer's own copy of each version, for the check
        prev = tiny.load(model_dir, a.dtype)  # ... and of the version before
        if a.trainers == 2:
            port = free_port()
            cfg = {"model": model_dir, "dtype": a.dtype, "lr": a.lr, "store": store, "timeout": a.timeout,
                   "steps": a.steps, "port": port, "kill_trainer": a.kill_trainer}
            rank1 = multiprocessing.get_context("spawn").Process(target=trainer_rank1, args=(cfg,))
            rank1.start()
            _dist(0, 2, port)
            model = _sharded(tiny.load(model_dir, a.dtype))
            source: Any = ShardSource(model)
        else:
            model = tiny.load(model_dir, a.dtype)
            source = ModuleSource(model)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
        info = TransportTrainerInitInfo(rank=0, store=store, engines=names, timeout=a.timeout, deadline=a.timeout,
                                        receive=a.receive)
        trainer = TransportTrainerEngine.trainer_init(info, client=[engines[n].client for n in names], source=source)
        prompts = tiny.prompts(PROMPTS, seed=1)
        all_ok = True
        for step in range(a.steps):
            first = next(e for n, e in engines.items() if not trainer.busy(n))
            gens = first.generate(prompts, MAX_TOKENS)
            prompt_ids = [g.prompt_ids for g in gens]
            if a.trainers == 2:
                _send(prompt_ids)
            prev.load_state_dict(ref.state_dict())
            loss = sft_step(model, opt, prompt_ids, step)
            if a.trainers == 2:
                ref.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
            else:
                ref.load_state_dict(model.state_dict())
            # The check is sharp: before the push, the engine does not match the new weights.
            stale, _ = _exact(a, ref, first.generate(prompts, MAX_TOKENS))
            stopped: list[int] = []
            if a.slow_engine and step == min(1, a.steps - 1):
                stopped = engines["engine-1"].pids()
                signal_all(stopped, signal.SIGSTOP)
            report = trainer.send_weights()
            if stopped:
                signal_all(stopped, signal.SIGCONT)
            row: dict[str, Any] = {"step": step, "version": report.version, "loss": loss, "publish_s": report.publish_s,
                   "total_s": report.total_s, "at": time.time() - t_start,
                   # sync_s: from the start of the publish until the engine serves it; pause_s: its
                   # update round (the engine's step loop is held only for those RPCs)
                   "engines": {n: {"status": r.status.value, "sync_s": report.publish_s + r.seconds,
                                   "pause_s": r.seconds, "error": r.error}
                               for n, r in report.engines.items()}}
            ok = verify_step(a, step, report, engines, trainer, ref, prev, prompts, row) and not stale
            row["matched_before_push"] = stale
            all_ok &= ok
            summary["steps"].append(row)
            print(f"step {step}: loss {loss:.3f}; " + ", ".join(
                f"{n} {r['status']} in {r['sync_s'] * 1e3:.0f} ms" for n, r in row["engines"].items())
                + f"; checked: {row['checked']}", flush=True)
            if a.trainers == 2 and not (a.kill_trainer and step == a.steps - 1):
                torch.distributed.barrier()
            if a.kill_engine and step == 0:
                restart_engine(a, "engine-1", engines, trainer, model_dir, out, ref, prompts, summary)
        summary["verified"] = bool(all_ok and summary["steps"] and not summary.get("restart_failed"))
        trainer.shutdown()
    finally:
        for e in engines.values():
            e.close()
        if rank1 is not None:
            rank1.join(30)
            if rank1.is_alive():
                rank1.kill()
    summary["wall_s"] = time.time() - t_start
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(summary, out / "sync.png")
    print(json.dumps({"verified": summary["verified"], "out": str(out)}))
    return 0 if summary["verified"] else 1


def start_engines(a: argparse.Namespace, names: list[str], model_dir: str, out: Path) -> dict[str, Any]:
    if a.serve:
        engines = {n: ServedEngine.launch(n, model_dir, a.tp, a.dtype, out) for n in names}
        for e in engines.values():
            e.wait_ready(600)
        return engines
    return {n: OfflineEngine.start(n, model_dir, a.tp, a.dtype) for n in names}


def _exact(a: argparse.Namespace, ref: Any, gens: list[Generation]) -> tuple[bool, float]:
    same, worst = compare(ref, gens)
    return same and worst <= TOL[a.dtype], worst


def verify_step(a: argparse.Namespace, step: int, report: Any, engines: dict[str, Any], trainer: Any, ref: Any,
                prev: Any, prompts: list[str], row: dict[str, Any]) -> bool:
    """Checks every engine that is not busy against the trainer's model, and says what it found."""
    from transport.vllm import EngineStatus

    killed_trainer = a.kill_trainer and step == a.steps - 1
    checked: dict[str, Any] = {}
    ok = True
    for n, e in engines.items():
        if trainer.busy(n):
            checked[n] = "busy (straggler)"
            ok &= a.slow_engine and n == "engine-1" and step == min(1, a.steps - 1)
            continue
        r = report.engines[n]
        gens = e.generate(prompts, MAX_TOKENS)
        same, worst = compare(ref, gens)
        exact = same and worst <= TOL[a.dtype]
        if killed_trainer:  # the version never completed: the engine must serve the previous one, not this one
            still, _ = _exact(a, prev, gens)
            good = r.status is EngineStatus.FAILED and not exact and still
            checked[n] = {"tokens_equal": same, "max_abs_dlogprob": worst, "serves_previous": still, "ok": good}
            ok &= good
            continue
        elif a.slow_engine and n == "engine-1" and r.status is EngineStatus.STRAGGLER:
            good = True  # checked once its round ends
        else:
            good = r.status is EngineStatus.LOADED and exact
        checked[n] = {"tokens_equal": same, "max_abs_dlogprob": worst, "ok": good}
        ok &= good
    row["checked"] = checked
    if a.slow_engine and step == min(1, a.steps - 1):
        r0, r1 = report.engines["engine-0"], report.engines["engine-1"]
        row["slow"] = {"engine-0": r0.status.value, "engine-1": r1.status.value}
        ok &= r0.status is EngineStatus.LOADED and r1.status is EngineStatus.STRAGGLER
    return ok


def restart_engine(a: argparse.Namespace, name: str, engines: dict[str, Any], trainer: Any, model_dir: str,
                   out: Path, ref: Any, prompts: list[str], summary: dict[str, Any]) -> None:
    """kill -9 ``name``; start a new engine that joins by itself (TRANSPORT_VLLM_INIT) and must
    serve the current version before the trainer does anything."""
    from transport.vllm import INIT_ENV

    old = engines.pop(name)
    signal_all(old.pids(), signal.SIGKILL)
    trainer.remove_engine(name)
    env = {INIT_ENV: trainer.worker_init_info(name).to_env()}
    t0 = time.perf_counter()
    if a.serve:
        new: Any = ServedEngine.launch(name, model_dir, a.tp, a.dtype, out, env=env)
        new.wait_ready(600)
    else:
        old.close()
        new = OfflineEngine.start(name, model_dir, a.tp, a.dtype, env=env)
    same, worst = compare(ref, new.generate(prompts, MAX_TOKENS))
    summary["restart"] = {"engine": name, "start_s": time.perf_counter() - t0, "tokens_equal": same,
                          "max_abs_dlogprob": worst, "ok": same and worst <= TOL[a.dtype]}
    print(f"{name}: killed and restarted; serves the current version: {summary['restart']['ok']}", flush=True)
    if not summary["restart"]["ok"]:
        summary["restart_failed"] = True
    engines[name] = new
    trainer.add_engine(name, new.client, join=False)


def plot(summary: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    names = sorted({n for s in summary["steps"] for n in s["engines"]})
    for n in names:
        xs = [s["step"] for s in summary["steps"] if n in s["engines"]]
        ys = [s["engines"][n]["sync_s"] * 1e3 for s in summary["steps"] if n in s["engines"]]
        ax.plot(xs, ys, marker="o", label=n)
    ax.set_xlabel("step")
    ax.set_xticks([s["step"] for s in summary["steps"]])
    ax.set_ylabel("publish -> engine serves it (ms)")
    ax.set_title(f"vLLM weight sync, verified={summary['verified']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
