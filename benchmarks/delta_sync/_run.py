"""Delta sync against dense, on real training updates: ``python -m benchmarks.delta_sync``.

The trainer trains the Llama-style model of ``examples.mesh_sync`` (about 100M parameters) with
AdamW on its toy next-token loss, fp32 master weights, and publishes bf16 weights after every
step twice, on two streams of the same Transport: once with delta sync (``delta`` stream) and
once forced dense (``dense`` stream, ``Publisher(delta=False)``). Two subscriber processes hold
both streams and apply every version as soon as it is complete. Per step it reports the
measured changed fraction, the bytes on the wire (dense vs delta), the diff + encode pass, the
subscribers' apply times, and the time from the start of the publish until both subscribers
hold the version (live), for each learning rate. Then a sweep of forced densities (bit flips of
that fraction of each tensor's elements) shows where dense takes over.

Each kind of stream runs ``--repeats`` times over (streams ``delta``, ``delta.1``, ...): every
version is published on each of them, and a row reports each kind's median publish. On a
2-core VM one publish varies by 5-15% from the next (two identical dense ones disagree that
much), more than the 5% a delta stream may cost over ipc; the median of three (interleaved, so
that slow moments fall on every kind alike) tells the kinds apart.

Before them, every version goes first on one more forced-dense stream, ``first``, which no row
compares: the first publish after a training step is slower than the ones that follow it, on
either kind (over the ipc rows of 2026-12-02..06, 308 of them, the first publish of a row ran at
1.05x its kind's median, 1.08x on average; every later position at 1.00, 0.99-1.01 on average;
the subscribers and the trainer's cores come out of the step's idle). Without it the kind that
went first in a row carried that cost alone, a third of the rows against the delta stream. Its
live time is reported beside the rows (``first``): what a trainer that publishes once a step
pays on top, whatever the kind.

The same-run baselines: memcpy bandwidth over the model's bf16 bytes (one thread, and split
across the copy threads as the diff is) at the start, and on all cores again just before each
reported version's publishes (its diff's baseline: the VM's bandwidth drifts over a run; see
memcpy_now), and forced-dense publishing.

Last, per backend, whether the run meets the delta stream's targets (``targets``), e.g. ``[tcp]
targets met: every step <= 1.05x dense (0.979), lr 1e-06 <= 0.2x dense (0.197), diff >= 0.5x the
same-run memcpy (0.549)``; over ipc only the first line counts (nothing is diffed there).

    python -m benchmarks.delta_sync                      # the recorded run (tcp and ipc)
    python -m benchmarks.delta_sync --short --json out   # the smoke test's tiny run
    python -m benchmarks.delta_sync --join               # step 0 follows the first, dense, version
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import platform
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import trio

import transport
from transport.weights import Publisher, Subscriber, delta_isa

from ..common import stats
from ._references import floor_s, references

ROOT = Path(__file__).resolve().parent.parent
# The delta stream, the forced-dense one, and the same forced-dense publish again: the third
# measures this run's noise (two identical publishes), against which a delta stream that sends
# dense is judged.
KINDS = ("delta", "dense", "again")
FIRST = "first"  # the forced-dense stream each version goes on first, compared in no row (see above)
REPEATS = 3  # streams of each kind (--repeats): each row reports the kind's median publish
SWEEP = (0.001, 0.01, 0.1, 0.4, 0.9)
SUBSCRIBERS = ("gen-0", "gen-1")


def stream_name(kind: str, repeat: int) -> str:
    """The stream of ``kind`` for repeat ``repeat`` (from 0): ``delta``, ``delta.1``, ..."""
    return kind if repeat == 0 else f"{kind}.{repeat}"


def stream_names(repeats: int) -> list[str]:
    """``first``, then the streams of ``repeats`` of each kind, interleaved: delta, dense, again,
    delta.1, ..."""
    return [FIRST] + [stream_name(k, i) for i in range(repeats) for k in KINDS]


def kind_of(stream: str) -> str:
    return stream.split(".")[0]


def model_config(short: bool) -> dict[str, Any]:
    from examples.mesh_sync.model import CONFIG

    if short:
        return {**CONFIG, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 512}
    return dict(CONFIG)


def bf16_state(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    from examples.mesh_sync.model import LlamaLM

    with torch.device("meta"):
        m = LlamaLM(cfg)
    return {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in m.state_dict().items()}


def freeze() -> None:
    """Moves what this process holds after its setup out of the cyclic GC's sight, as a
    long-running trainer or server would (``gc.freeze``): a full collection would otherwise
    walk the model, the optimizer and every stream's objects in the middle of a timed publish
    (tens of ms on the 2-core VM, on either kind of stream)."""
    gc.collect()
    gc.freeze()


# ---- subscriber process -----------------------------------------------------------------------

def sub_apply_s(sub: Subscriber, t0: float) -> float:
    """The last apply's own time (the copy or scatter), else the wait since ``t0``."""
    return sub.last_apply_s if sub.last_apply_s is not None else time.perf_counter() - t0


async def subscriber(spec: dict[str, Any]) -> None:
    cfg = model_config(spec["short"])
    streams = spec["streams"]
    applies: dict[str, list[dict[str, Any]]] = {s: [] for s in streams}
    async with transport.Transport(spec["name"], store=spec["store"], backends=(spec["backend"],), timeout=60) as t:
        # The dense stream is the forced-dense baseline on both ends (no checksums kept).
        subs = {s: Subscriber(t, bf16_state(cfg), publisher="trainer", name=s, delta=kind_of(s) == "delta")
                for s in streams}
        for sub in subs.values():
            await sub.start()

        async def follow(stream: str) -> None:
            sub = subs[stream]
            while True:  # versions are consecutive: wait for the next one, apply it, report it
                t0 = time.perf_counter()
                refused = sub.refused_deltas
                got = await sub.wait_version((sub.version or 0) + 1, timeout=600)
                applies[stream].append({"version": got, "apply_s": sub_apply_s(sub, t0),
                                        "refused": sub.refused_deltas - refused})
                await t.signal("trainer", f"live.{stream}.{spec['name']}", got)

        async def stop(cancel: trio.CancelScope) -> None:
            await t.wait_signal("stop", at_least=1, timeout=3600)
            cancel.cancel()

        freeze()
        await t.signal("trainer", f"ready.{spec['name']}", 1)
        async with trio.open_nursery() as n:
            for s in streams:
                n.start_soon(follow, s)
            n.start_soon(stop, n.cancel_scope)
        for sub in subs.values():
            await sub.aclose()
    Path(spec["out"]).write_text(json.dumps(applies))


# ---- trainer ----------------------------------------------------------------------------------

def _copy_gbps(src: torch.Tensor, dst: torch.Tensor, threads: int) -> float:
    """torch's copy of ``src`` into ``dst`` on ``threads`` threads: the best of 3, in GB/s."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        best = stats.best_s(lambda: dst.copy_(src), 3)
    finally:
        torch.set_num_threads(before)
    return src.numel() / best / 1e9


def memcpy_gbps(nbytes: int) -> dict[str, float]:
    """The same-run memcpy baseline: torch's copy of ``nbytes`` on one thread and on all."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    cores = os.cpu_count() or 1
    return {label: _copy_gbps(src, dst, threads) for label, threads in (("1 thread", 1), (f"{cores} threads", cores))}


_step_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # nbytes -> (src, dst), kept for the run
IDLE_S = 0.2  # the idle before each of a version's single baseline copies
# A delta stream's targets (``targets``): at every step at most NEVER_SLOWER of the dense stream's
# live time (a delta stream is never slower than dense: where no delta pays it sends dense); over
# a network at most NETWORK_TARGET of it at the smallest learning rate (lr 1e-6 by default); and
# the diff at least DIFF_TARGET of the same-run memcpy at every step it ran.
NEVER_SLOWER, NETWORK_TARGET, DIFF_TARGET = 1.05, 0.2, 0.5
MEMORY_BACKENDS = ("ipc",)  # same-host links, as fast as memory: no network target there


def memcpy_now(nbytes: int) -> tuple[float, float]:
    """The memcpy on all cores measured now, just before a version's publishes, on buffers kept
    for the run: what that version's diff is judged against, in GB/s, as (cold, warm).

    cold: the median of 3 single copies, each after ``IDLE_S`` of idle: the conditions of the
    diff it is compared to, one pass after the machine idled between publishes (the diff's
    figure is itself the median of single passes). warm: the best of 3 copies back to back.
    Over one run on the 2-core VM the machine's memory bandwidth moves with its neighbours'
    load (the start-of-run figure ranged 14-21 GB/s across runs of one afternoon), so a
    baseline taken minutes before would judge the diff against another machine; and a pass
    after 50 ms or more of idle runs slower than back to back there: 10% for a 199 MB copy,
    30% for the diff kernel (16 -> 21 ms at 11% changed; spinning both cores for 200 ms first
    restores it, spinning 20 ms does not).
    """
    if nbytes not in _step_buffers:
        _step_buffers[nbytes] = (torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8))
    src, dst = _step_buffers[nbytes]
    warm = _copy_gbps(src, dst, os.cpu_count() or 1)
    singles = []
    for _ in range(3):
        time.sleep(IDLE_S)
        t0 = time.perf_counter()
        dst.copy_(src)
        singles.append(time.perf_counter() - t0)
    return nbytes / stats.median(singles) / 1e9, warm


def changed_fraction(state: dict[str, torch.Tensor], prev: dict[str, torch.Tensor]) -> float:
    """The fraction of bf16 elements whose bits differ from ``prev`` (not timed: what a diff
    would find, for versions the publisher sent dense without one)."""
    changed = sum(int((v.view(torch.int16) != prev[k].view(torch.int16)).sum()) for k, v in state.items())
    return changed / sum(v.numel() for v in state.values())


async def publish_both(t: transport.Transport, pubs: dict[str, Publisher], version: int,
                       kinds: tuple[str, ...] = KINDS, changed: float | None = None) -> dict[str, Any]:
    """Publishes ``version`` on every stream (of ``kinds``), one after the other, and waits on
    each until both subscribers hold it; a kind's figures are those of its median publish (all
    its live times under ``repeats``). ``changed``: the version's changed fraction as the
    trainer measured it, reported where the delta stream's publisher did not diff."""
    row: dict[str, Any] = {"version": version, "changed_fraction": changed, "order": []}
    # Alternate which kind goes first: the first publish after a training step reads live
    # tensors the optimizer just wrote.
    k = version % len(KINDS)  # which kind goes first rotates with the version
    order = [kind for kind in KINDS[k:] + KINDS[:k] if kind in kinds]
    samples: dict[str, list[dict[str, Any]]] = {kind: [] for kind in order}
    if FIRST in pubs:  # the first publish after the step, compared in no row
        row[FIRST] = (await _publish_one(t, pubs[FIRST], FIRST, version))["stream"]
    for i in range(sum(kind_of(s) == KINDS[0] for s in pubs)):  # the repeats, each in that order
        for kind in order:
            stream = stream_name(kind, i)
            samples[kind].append(await _publish_one(t, pubs[stream], stream, version))
            row["order"].append(stream)
    for kind, got in samples.items():
        median = sorted(got, key=lambda x: x["stream"]["live_s"])[(len(got) - 1) // 2]
        row[kind] = {**median["stream"], "repeats": [x["stream"]["live_s"] for x in got],
                     "repeats_as_delta": [x["stream"]["as_delta"] for x in got]}
        for key, v in median.items():
            if key not in ("stream", "density", "base"):
                row[key] = v
        if "density" in median and (median["base"] is not None or median["sampled"] or changed is None):
            row["changed_fraction"] = median["density"]
    # The diff: the median of the delta stream's repeats (each diffs the same version against
    # the same base), not only that of its median publish.
    diffs = sorted(x["diff_encode_s"] for x in samples.get("delta", []) if x.get("diff_encode_s"))
    if diffs and row.get("diff_gbps"):
        row["diff_repeats_s"] = diffs
        row["diff_encode_s"] = diffs[(len(diffs) - 1) // 2]
        row["diff_gbps"] = row["dense_bytes"] / row["diff_encode_s"] / 1e9
    return row


async def _publish_one(t: transport.Transport, pub: Publisher, stream: str, version: int) -> dict[str, Any]:
    """Publishes ``version`` on ``stream`` and waits until both subscribers hold it: its
    figures (``stream``), and for a delta stream what its delta machinery did."""
    t0 = time.perf_counter()
    report = await pub.publish(version)
    for name in SUBSCRIBERS:
        await t.wait_signal(f"live.{stream}.{name}", at_least=version, timeout=120)
    live_s = time.perf_counter() - t0
    # Its snapshot's completion (a dense version's fill reads the whole version back from a
    # subscriber) ends before the next stream publishes: in a real run it has the training
    # step to itself.
    await pub.wait_snapshot()
    res = [report.results[n] for n in SUBSCRIBERS]
    out: dict[str, Any] = {"stream": {
        "name": stream, "live_s": live_s, "publish_s": report.total_s, "pack_s": report.pack_s,
        "discover_s": report.discover_s, "push_s": report.push_s, "snapshot_s": report.snapshot_s,
        "wire_bytes": max(r.nbytes for r in res), "as_delta": [r.delta for r in res]}}
    if report.delta is not None:
        d = report.delta
        out.update({"density": d.density, "base": d.base, "diff_encode_s": d.encode_s,
                    "diff_gbps": d.dense_bytes / d.encode_s / 1e9 if d.encode_s else None, "kinds": d.kinds,
                    # dense without a full diff: the sample was above the crossover
                    "sampled": d.sampled, "crossover": d.crossover, "dense_bytes": d.dense_bytes})
    return out


def _e4m3(t: torch.Tensor) -> torch.Tensor:
    """Per-tensor scaled float8 e4m3, as the publisher's fp8 path makes it (scale = amax / 448,
    or 1 where that is not positive; round to nearest even, saturated)."""
    x = t.detach().float()
    amax = x.abs().max()
    scale = amax / 448.0 if bool(amax > 0) else torch.ones((), dtype=torch.float32)
    return (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def fp8_change(state: dict[str, torch.Tensor], prev: dict[str, torch.Tensor] | None
               ) -> tuple[float | None, dict[str, torch.Tensor]]:
    """The fraction of float8 e4m3 bytes (per-tensor scale, as ``Publisher(fp8=...)`` sends)
    that differ from ``prev``'s after requantizing ``state`` (not timed; fp8 entries always
    travel dense, this measures whether a delta of them would pay)."""
    now = {k: _e4m3(v).view(torch.uint8) for k, v in state.items() if v.dim() == 2}
    if prev is None:
        return None, now
    changed = sum(int((now[k] != prev[k]).sum()) for k in now)
    return changed / sum(v.numel() for v in now.values()), now


def flip(state: dict[str, torch.Tensor], fraction: float, g: torch.Generator) -> None:
    """Changes ``fraction`` of each tensor's elements (their lowest bit)."""
    for t in state.values():
        flat = t.view(-1).view(torch.int16)
        k = int(flat.numel() * fraction)
        if k:
            idx = torch.randperm(flat.numel(), generator=g)[:k]
            flat[idx] ^= 1


async def trainer(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    from examples.mesh_sync.model import LlamaLM

    tmp = Path(args.tmp) / f"{backend}-{uuid.uuid4().hex[:6]}"
    tmp.mkdir(parents=True)
    store = f"file://{tmp / 'store'}"
    cfg = model_config(args.short)
    torch.manual_seed(0)
    model = LlamaLM(cfg)
    published = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    dense_bytes = sum(v.numel() * 2 for v in published.values())
    procs, outs = [], []
    for name in SUBSCRIBERS:
        out = tmp / f"{name}.json"
        spec = {"name": name, "store": store, "backend": backend, "short": args.short, "out": str(out),
                "streams": stream_names(args.repeats)}
        procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.delta_sync", "--role", "sub",
                                       json.dumps(spec)], cwd=ROOT))
        outs.append(out)
    steps: list[dict[str, Any]] = []
    sweep: list[dict[str, Any]] = []
    windows: list[dict[str, Any]] = []
    try:
        async with transport.Transport("trainer", store=store, backends=(backend,), timeout=120) as t:
            crossover = {} if args.crossover is None else {"delta_crossover": args.crossover}
            async with contextlib.AsyncExitStack() as stack:
                pubs = {}
                for stream in stream_names(args.repeats):
                    delta = kind_of(stream) == "delta"
                    pubs[stream] = await stack.enter_async_context(
                        Publisher(t, published, name=stream, delta=delta, **(crossover if delta else {})))
                await run_steps(args, t, model, published, cfg, pubs, backend, steps, sweep,
                                windows)
        for p in procs:
            p.wait(timeout=120)
        applies = [json.loads(o.read_text()) for o in outs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rows in (steps, sweep, windows):
        for row in rows:
            for kind in (k for k in (FIRST, *KINDS) if k in row):  # the apply of the kind's median publish
                stream = row[kind]["name"]
                row[kind]["apply_s"] = [next((a["apply_s"] for a in sub[stream] if a["version"] == row["version"]),
                                             None) for sub in applies]
    # Deltas the subscribers refused (each then pulls the version dense): none, where the codec is right.
    refused = sum(a["refused"] for sub in applies for got in sub.values() for a in got)
    if refused:
        print(f"[{backend}] the subscribers refused {refused} delta versions", flush=True)
    return {"backend": backend, "dense_bytes": dense_bytes, "steps": steps, "sweep": sweep, "windows": windows,
            "refused": refused}


def adamw_step(model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: dict[str, Any], args: argparse.Namespace,
               seed: int) -> float:
    """One AdamW step of ``model`` on the toy next-token batch ``seed``; returns its loss."""
    from examples.mesh_sync.model import batch

    x, y = batch(seed, cfg["vocab_size"], batch_size=args.batch, seq=args.seq)
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def to_published(model: torch.nn.Module, published: dict[str, torch.Tensor]) -> None:
    """fp32 master -> bf16 published, in place."""
    with torch.no_grad():
        for k, v in model.state_dict().items():
            published[k].copy_(v)


async def publish_changed(t: transport.Transport, pubs: dict[str, Publisher], version: int,
                          published: dict[str, torch.Tensor], change: Callable[[], None]) -> dict[str, Any]:
    """Applies ``change`` to the published tensors and publishes them as ``version`` on every
    stream (:func:`publish_both`), with the changed fraction measured against what they held."""
    before = {k: v.clone() for k, v in published.items()}
    change()
    changed = changed_fraction(published, before)
    cold, warm = memcpy_now(sum(v.numel() * v.element_size() for v in published.values()))
    return {**await publish_both(t, pubs, version, changed=changed), "memcpy_gbps": cold, "memcpy_warm_gbps": warm}


async def run_steps(args: argparse.Namespace, t: transport.Transport, model: torch.nn.Module,
                    published: dict[str, torch.Tensor], cfg: dict[str, Any], pubs: dict[str, Publisher], backend: str,
                    steps: list[dict[str, Any]], sweep: list[dict[str, Any]], windows: list[dict[str, Any]]) -> None:
    for name in SUBSCRIBERS:
        await t.wait_signal(f"ready.{name}", at_least=1, timeout=300)
    freeze()
    version = 1
    steps.append({"lr": None, "loss": None, **await publish_both(t, pubs, version)})  # the base
    # Warm-up, not reported: two more dense versions (90% of the bits flipped, then the true
    # weights again), so that each subscriber slot has had a dense push (a first push to a slot
    # maps and faults in the subscriber's memory); step 0 is then the first delta after a
    # version that went dense by its sample. With --join they run on the dense stream only: the
    # delta stream readies its pushes with Publisher.warm(), as an application would, and its
    # first delta follows its first, dense, version, as after a generator joins (the subscriber
    # memory that delta lands in is touched for the first time then; it pays for that).
    warm = {k: v.clone() for k, v in published.items()}
    flip(published, 0.9, torch.Generator().manual_seed(9))
    for _ in range(2):
        version += 1
        await publish_both(t, pubs, version, kinds=("dense", "again") if args.join else KINDS)
        for k, v in published.items():
            v.copy_(warm[k])
    if args.join:
        for stream in (s for s in pubs if kind_of(s) == "delta"):
            await pubs[stream].warm()
    _, fp8_prev = fp8_change(published, None)
    for lr in args.lr:
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        for s in range(args.steps):
            loss = adamw_step(model, opt, cfg, args, version)
            version += 1
            row = await publish_changed(t, pubs, version, published, lambda: to_published(model, published))
            row["fp8_changed_fraction"], fp8_prev = fp8_change(published, fp8_prev)
            steps.append({"lr": lr, "step": s, "loss": loss, **row})
            print(f"[{backend}] lr={lr:g} step {s}: changed {row['changed_fraction']:.4%}, wire "
                  f"{row['delta']['wire_bytes'] / 1e6:.2f} MB vs {row['dense']['wire_bytes'] / 1e6:.2f} MB, "
                  f"live {row['delta']['live_s'] * 1e3:.1f} ms vs {row['dense']['live_s'] * 1e3:.1f} ms, "
                  f"diff {diff_cell(row)}", flush=True)
    if args.window:
        # A generator that skipped versions: the change across ``window`` AdamW steps at the
        # first learning rate, published as one version against the base both subscribers
        # hold (the trainer published nothing between): the delta a lagging generator would
        # need, and whether the publisher sends it dense when it should.
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr[0])
        for s in range(args.window):
            adamw_step(model, opt, cfg, args, version + s + 1)
        version += 1
        row = await publish_changed(t, pubs, version, published, lambda: to_published(model, published))
        windows.append({"lr": args.lr[0], "steps": args.window, **row})
        print(f"[{backend}] {args.window} steps at lr={args.lr[0]:g} in one version: changed "
              f"{row['changed_fraction']:.4%}, as delta {row['delta']['as_delta']}, live "
              f"{row['delta']['live_s'] * 1e3:.1f} ms vs {row['dense']['live_s'] * 1e3:.1f} ms", flush=True)
    g = torch.Generator().manual_seed(5)
    # Unreported: a small delta first, so that the first swept version does not carry the one
    # read of the live tensors a subscriber makes when a delta follows dense versions.
    flip(published, 0.0001, g)
    version += 1
    await publish_both(t, pubs, version)
    for f in args.sweep:
        version += 1
        row = await publish_changed(t, pubs, version, published, functools.partial(flip, published, f, g))
        sweep.append({"forced": f, **row})
        print(f"[{backend}] forced {f:.1%}: measured {row['changed_fraction']:.4%}, kinds {row['kinds']}, "
              f"wire {row['delta']['wire_bytes'] / 1e6:.2f} MB vs {row['dense']['wire_bytes'] / 1e6:.2f} MB, "
              f"live {row['delta']['live_s'] * 1e3:.1f} ms vs {row['dense']['live_s'] * 1e3:.1f} ms",
              flush=True)
    for name in SUBSCRIBERS:
        await t.signal(name, "stop", 1)


def summarize(run: dict[str, Any], memcpy: float) -> dict[str, Any]:
    """The done-when figures of one backend's run, from its rows (``memcpy``: the same run's
    memcpy on all cores, GB/s, for rows recorded before each measured their own)."""
    out: dict[str, Any] = {}
    for lr in sorted({r["lr"] for r in run["steps"] if r["lr"] is not None}):
        rows = [r for r in run["steps"] if r["lr"] == lr]
        live_ratio = [r["delta"]["live_s"] / r["dense"]["live_s"] for r in rows]
        diffed = [r for r in rows if r["diff_gbps"]]
        out[f"lr={lr:g}"] = {
            "changed_fraction_mean": sum(r["changed_fraction"] for r in rows) / len(rows),
            "wire_ratio_mean": sum(r["delta"]["wire_bytes"] / r["dense"]["wire_bytes"] for r in rows) / len(rows),
            "wire_over_2f_dense_max": max((r["delta"]["wire_bytes"]
                                           / (2 * r["changed_fraction"] * r["dense"]["wire_bytes"])
                                           for r in rows if all(r["delta"]["as_delta"])), default=float("nan")),
            "live_ratio_mean": sum(live_ratio) / len(live_ratio),
            "live_ratio_max": max(live_ratio),
            "diff_gbps_mean": (sum(r["diff_gbps"] for r in diffed) / len(diffed)) if diffed else float("nan"),
            "fp8_changed_fraction_mean": sum(r.get("fp8_changed_fraction") or 0 for r in rows) / len(rows),
            "delta_versions": sum(1 for r in rows if all(r["delta"]["as_delta"])),
        }
    every = [r["delta"]["live_s"] / r["dense"]["live_s"] for r in run["steps"][1:]]
    noise = [r["again"]["live_s"] / r["dense"]["live_s"] for r in run["steps"][1:] + run["sweep"]]
    first = [r[FIRST]["live_s"] / r["dense"]["live_s"] for r in run["steps"][1:] + run["sweep"] if FIRST in r]

    def diff_over(baseline: str) -> float:
        """The least ratio of a step's diff to its ``baseline`` memcpy (``memcpy`` where unrecorded)."""
        return min((r["diff_gbps"] / r.get(baseline, memcpy) for r in run["steps"][1:] if r.get("diff_gbps")),
                   default=float("nan"))

    out["every step"] = {"live_ratio_max": max(every, default=float("nan")),
                         "noise_ratio_min": min(noise, default=float("nan")),
                         "noise_ratio_max": max(noise, default=float("nan")),
                         # the first publish after the step (forced dense) over the dense median
                         "first_over_dense_mean": sum(first) / len(first) if first else float("nan"),
                         "diff_over_memcpy_min": diff_over("memcpy_gbps"),
                         "diff_over_warm_memcpy_min": diff_over("memcpy_warm_gbps"),
                         "refused_deltas": run.get("refused", 0)}
    out["targets"] = targets(run, out)
    out["windows"] = [{"lr": r["lr"], "steps": r["steps"], "changed": r["changed_fraction"],
                       "as_delta": r["delta"]["as_delta"], "live_ratio": r["delta"]["live_s"] / r["dense"]["live_s"]}
                      for r in run.get("windows", [])]
    out["sweep"] = [{"forced": r["forced"], "measured": r["changed_fraction"], "kinds": r["kinds"],
                     "wire_ratio": r["delta"]["wire_bytes"] / r["dense"]["wire_bytes"],
                     "live_ratio": r["delta"]["live_s"] / r["dense"]["live_s"],
                     "apply_s": r["delta"]["apply_s"], "dense_apply_s": r["dense"]["apply_s"]} for r in run["sweep"]]
    return out


def targets(run: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """Whether one backend's run meets the delta stream's targets (see ``NEVER_SLOWER``), line by
    line: each line's figure from ``summary`` (:func:`summarize`'s) and whether it is met, then
    ``met`` for all of them. Over a same-host link (``MEMORY_BACKENDS``) only the first applies:
    there no delta pays and none is diffed. A line with no figure (no step, no diff) is not met."""
    every = summary["every step"]
    lines: dict[str, Any] = {"every_step_max": every["live_ratio_max"],
                             "every_step_met": every["live_ratio_max"] <= NEVER_SLOWER}
    if run["backend"] not in MEMORY_BACKENDS:
        lr = min((r["lr"] for r in run["steps"] if r["lr"] is not None), default=None)
        smallest = float("nan") if lr is None else summary[f"lr={lr:g}"]["live_ratio_max"]
        lines.update({"network_lr": lr, "network_max": smallest, "network_met": smallest <= NETWORK_TARGET,
                      "diff_min": every["diff_over_memcpy_min"],
                      "diff_met": every["diff_over_memcpy_min"] >= DIFF_TARGET})
    lines["met"] = all(v for k, v in lines.items() if k.endswith("_met"))
    return lines


def targets_line(t: dict[str, Any]) -> str:
    """``targets`` in words, e.g. ``met: every step <= 1.05x dense (1.021), ...``."""

    def line(words: str, figure: str, met: str) -> str:
        return f"{words} ({t[figure]:.3f}{'' if t[met] else ': missed'})"

    parts = [line(f"every step <= {NEVER_SLOWER:g}x dense", "every_step_max", "every_step_met")]
    if "network_met" in t:
        parts += [line(f"lr {t['network_lr']:g} <= {NETWORK_TARGET:g}x dense", "network_max", "network_met"),
                  line(f"diff >= {DIFF_TARGET:g}x the same-run memcpy", "diff_min", "diff_met")]
    return ("met: " if t["met"] else "not met: ") + ", ".join(parts)


def summary_lines(s: dict[str, Any]) -> list[str]:
    """One backend's summary (:func:`summarize`'s) as lines, its targets' verdict last (the
    markdown's list and the printout; the windows and the sweep have lines of their own)."""
    out = [f"{key}: " + ", ".join(f"{k} {x:.4g}" for k, x in v.items())
           for key, v in s.items() if key not in ("sweep", "windows", "targets")]
    return out + ([f"targets {targets_line(s['targets'])}"] if "targets" in s else [])


def floor_cell(refs: dict[str, Any] | None, r: dict[str, Any]) -> str:
    """The step's floor (read both versions + a bare scatter at its density) and its ratio to the
    dense version's live time (records made before the references: none)."""
    if refs is None or f"{r['changed_fraction']:.6f}" not in refs["scatter_s"]:
        return "-"
    floor = floor_s(refs, r["changed_fraction"])
    return f"{floor * 1e3:.0f} ({floor / r['dense']['live_s']:.2f})"


def references_md(refs: dict[str, Any] | None) -> list[str]:
    """The physical references section (see benchmarks/delta_sync/_references.py)."""
    if refs is None:
        return []
    cells = ", ".join(f"{float(f):.2%} {t * 1e3:.1f} ms ({t / refs['copy_s']:.2f}x the copy)"
                      for f, t in refs["scatter_s"].items())
    return ["Physical references (same run, this machine, one process alone on all cores, plain torch on "
            "buffers of the version's size; see `benchmarks/delta_sync/_references.py`): read both versions "
            f"once {refs['read_both_s'] * 1e3:.1f} ms, copy the version {refs['copy_s'] * 1e3:.1f} ms, bare "
            f"scatter of new values at a density: {cells}. floor = read both + scatter at the step's density: the "
            "least a diff and one subscriber's apply take here over a link of no cost; it leaves out the "
            "network, the second subscriber and every fixed cost.", ""]


def diff_cell(r: dict[str, Any]) -> str:
    if r.get("crossover") == 0.0:
        return "none (no delta pays on either path: dense)"
    if not r.get("diff_gbps"):
        return "none (sample above the crossover: dense)"
    cell = f"{r['diff_encode_s'] * 1e3:.0f} ({r['diff_gbps']:.2f})"
    if r.get("memcpy_gbps"):
        cell += f" {r['diff_gbps'] / r['memcpy_gbps']:.2f}x of {r['memcpy_gbps']:.1f}"
    if r.get("memcpy_warm_gbps"):
        cell += f" ({r['diff_gbps'] / r['memcpy_warm_gbps']:.2f}x of {r['memcpy_warm_gbps']:.1f} warm)"
    return cell


def markdown(result: dict[str, Any]) -> str:
    """The results file: per backend, the training steps and the density sweep, with the
    same-run baselines (forced dense, memcpy)."""
    m = result["machine"]
    repeats = result.get("args", {}).get("repeats", 1)
    out = [f"# Delta sync vs dense on real AdamW updates ({result['date']})", "",
           f"Machine: {m['platform']}, {m['cpus']} CPUs ({m['threads']} copy threads), no GPU; torch "
           f"{m['torch']}; diff ISA {m['diff_isa']}. Model: {result['model']} "
           f"({result['bf16_bytes'] / 1e6:.1f} MB of bf16). Two subscriber processes per backend; each "
           "version published on the delta stream, on the forced-dense stream (`delta=False` both ends) and "
           "once more on a second forced-dense stream (the run's noise: two identical publishes); which goes "
           "first rotates by version. "
           + ("Before them, the version goes on one more forced-dense stream that no row compares (the first "
              "publish after a training step runs slower, on either kind). " if result["runs"]
              and any(FIRST in r for r in result["runs"][0]["steps"]) else "")
           + (f"Each kind of stream {repeats} times over, interleaved; a row gives each kind's median publish "
              "(the live times of every repeat are listed below the steps). " if repeats > 1 else "")
           + "Load average at the start: "
           f"{result.get('load_before', 'not recorded')}; commit {result.get('commit', 'not recorded')}.",
           "", "live = from the start of the publish until both subscribers report the version applied; apply = "
           "the subscriber's own copy or checked scatter (the slower of the two); diff = the diff + encode "
           "pass, which reads both versions and writes only the encodings (and the tensors that went dense "
           "into the new snapshot), in GB/s of the dense version: the median of the delta stream's repeats, and "
           "(where recorded) its ratio to the memcpy on all cores measured just before the version's publishes "
           "(x of GB/s: the median of 3 single copies, each after 0.2 s idle, as the diff runs once after "
           "the machine idled; in brackets against the best of 3 copies back to back); changed = the full "
           "diff's measured fraction (for versions that went dense by their sample, the sample's).",
           "", "Same-run memcpy at the start: "
           + ", ".join(f"{k} {v:.2f} GB/s" for k, v in result["memcpy_gbps"].items())
           + f". Command: `python -m benchmarks.delta_sync {' '.join(result.get('argv', []))}`", ""]
    out += [f"Note: {n}" for n in result.get("args", {}).get("note", [])]
    out += [""] if result.get("args", {}).get("note") else []
    out += references_md(result.get("references"))
    for run in result["runs"]:
        b = run["backend"]
        refs = result.get("references")
        out += [f"## {b}", "", "| lr | step | loss | changed | wire delta / dense (MB) | diff ms (GB/s) | "
                "apply ms delta / dense | live ms delta / dense | ratio | dense again / dense | "
                "floor ms (/ dense live) |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in run["steps"][1:]:
            d, n = r["delta"], r["dense"]
            out.append(f"| {r['lr']:g} | {r['step']} | {r['loss']:.3f} | {r['changed_fraction']:.3%} | "
                       f"{d['wire_bytes'] / 1e6:.2f} / {n['wire_bytes'] / 1e6:.2f} | {diff_cell(r)} | "
                       f"{max(d['apply_s']) * 1e3:.0f} / {max(n['apply_s']) * 1e3:.0f} | "
                       f"{d['live_s'] * 1e3:.0f} / {n['live_s'] * 1e3:.0f} | {d['live_s'] / n['live_s']:.2f} | "
                       f"{r['again']['live_s'] / n['live_s']:.2f} | {floor_cell(refs, r)} |")
        if repeats > 1:
            out += ["", f"Each repeat's live ms ({b}; the median is the row's), after the version's first publish "
                    "(forced dense, on a stream of its own, compared in no row):", "",
                    "| lr | step | first | delta | dense | again |", "|---|---|---|---|---|---|"]
            for r in run["steps"][1:]:
                first = f"{r[FIRST]['live_s'] * 1e3:.0f}" if FIRST in r else "-"
                out.append(f"| {r['lr']:g} | {r['step']} | {first} | " + " | ".join(
                    " / ".join(f"{x * 1e3:.0f}" for x in r[kind]["repeats"]) for kind in KINDS) + " |")
        out += ["", f"Forced densities ({b}): bit flips of that fraction of every tensor.", "",
                "| forced | measured | kinds | wire ratio | apply ms delta / dense | live ms delta / dense | ratio | "
                "dense again / dense |",
                "|---|---|---|---|---|---|---|---|"]
        for r in run["sweep"]:
            d, n = r["delta"], r["dense"]
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["kinds"].items()))
            out.append(f"| {r['forced']:.1%} | {r['changed_fraction']:.3%} | {kinds} | "
                       f"{d['wire_bytes'] / n['wire_bytes']:.3f} | {max(d['apply_s']) * 1e3:.0f} / "
                       f"{max(n['apply_s']) * 1e3:.0f} | {d['live_s'] * 1e3:.0f} / {n['live_s'] * 1e3:.0f} | "
                       f"{d['live_s'] / n['live_s']:.2f} | {r['again']['live_s'] / n['live_s']:.2f} |")
        out += ["", f"Where the time goes ({b}, delta stream; ms): publish = pack (sample + diff) + discover + "
                "push + snapshot (what the publish does after the pushes: the fill's copies; its patches run "
                "after it returns); after = live - publish (the doorbell, the subscribers' checked apply, their "
                "signal back).", "",
                "| lr | step | live | publish | pack | diff | push | snapshot | after | apply (both subscribers) |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in run["steps"][1:]:
            d = r["delta"]
            ms = [x * 1e3 for x in (d["live_s"], d["publish_s"], d["pack_s"], r["diff_encode_s"], d["push_s"],
                                    d["snapshot_s"], d["live_s"] - d["publish_s"])]
            out.append(f"| {r['lr']:g} | {r['step']} | " + " | ".join(f"{x:.0f}" for x in ms) + " | "
                       + " / ".join(f"{a * 1e3:.0f}" for a in d["apply_s"] if a is not None) + " |")
        if run.get("windows"):
            out += ["", f"Skipped versions ({b}): the change of several AdamW steps published as one version against "
                    "the base both subscribers hold, as a generator that skipped the versions between would "
                    "need it (the publisher diffs only against its previous version: a generator that holds "
                    "an older one gets the version dense).", "",
                    "| lr | AdamW steps | changed | wire delta / dense (MB) | diff ms (GB/s) | live ms delta / dense | "
                    "ratio |", "|---|---|---|---|---|---|---|"]
            for r in run["windows"]:
                d, n = r["delta"], r["dense"]
                out.append(f"| {r['lr']:g} | {r['steps']} | {r['changed_fraction']:.3%} | "
                           f"{d['wire_bytes'] / 1e6:.2f} / {n['wire_bytes'] / 1e6:.2f} | {diff_cell(r)} | "
                           f"{d['live_s'] * 1e3:.0f} / {n['live_s'] * 1e3:.0f} | {d['live_s'] / n['live_s']:.2f} |")
        s = result["summary"][b]
        out += ["", f"Summary ({b}):", ""]
        out += [f"- {line}" for line in summary_lines(s)]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.delta_sync", description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=("trainer", "sub"), default="trainer")
    p.add_argument("spec", nargs="?", help="(subscriber processes) their JSON spec")
    p.add_argument("--backends", nargs="+", default=["tcp", "ipc"])
    p.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    p.add_argument("--steps", type=int, default=3, help="AdamW steps per learning rate")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--sweep", type=float, nargs="*", default=list(SWEEP))
    p.add_argument("--window", type=int, default=10,
                   help="then this many AdamW steps published as one version (as a generator that skipped versions "
                        "needs them; 0: none)")
    p.add_argument("--short", action="store_true", help="a tiny model (the test suite's smoke run)")
    p.add_argument("--join", action="store_true",
                   help="the delta stream's first delta follows its first, dense, version (no dense warm-up there)")
    p.add_argument("--crossover", type=float, help="Publisher(delta_crossover=...) (default: the library's)")
    p.add_argument("--repeats", type=int, default=REPEATS,
                   help="streams of each kind; a row reports each kind's median publish")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--markdown", help="write the results as markdown here")
    p.add_argument("--note", action="append", default=[],
                   help="a line for the record, e.g. how the link was shaped (repeatable)")
    p.add_argument("--render", help="only render this results JSON (with --markdown)")
    p.add_argument("--tmp", default=f"/tmp/delta_sync-{os.getpid()}")
    args = p.parse_args(argv)
    if args.role == "sub":
        trio.run(subscriber, json.loads(args.spec))
        return
    if args.render:
        Path(args.markdown).write_text(markdown(json.loads(Path(args.render).read_text())))
        return
    load_before = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False).stdout.strip() or "unknown"
    torch.set_num_threads(os.cpu_count() or 1)
    cfg = model_config(args.short)
    nbytes = sum(v.numel() * 2 for v in bf16_state(cfg).values())
    memcpy = memcpy_gbps(nbytes)
    print(f"model: {nbytes / 1e6:.1f} MB of bf16; memcpy {', '.join(f'{k}: {v:.2f} GB/s' for k, v in memcpy.items())}",
          flush=True)
    runs = [trio.run(trainer, args, b) for b in args.backends]
    densities = [r["changed_fraction"] for run in runs for r in run["steps"][1:] + run["sweep"]]
    refs = references(nbytes, densities)
    result: dict[str, Any] = {
        "benchmark": "delta_sync", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": os.cpu_count() or 1,
                    "torch": torch.__version__, "diff_isa": delta_isa()},
        "model": {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")}, "bf16_bytes": nbytes,
        "memcpy_gbps": memcpy, "args": {k: v for k, v in vars(args).items() if k not in ("spec", "role")},
        "runs": runs, "summary": {r["backend"]: summarize(r, max(memcpy.values())) for r in runs},
        "load_before": load_before, "commit": commit, "references": refs,
    }
    summary: dict[str, dict[str, Any]] = result["summary"]
    for b, s in summary.items():
        for line in summary_lines(s):
            print(f"[{b}] {line}", flush=True)
        for r in s["windows"]:
            print(f"[{b}] {r['steps']} steps at lr={r['lr']:g} as one version: changed {r['changed']:.4%}, as delta "
                  f"{r['as_delta']}, live x{r['live_ratio']:.3f}", flush=True)
        for r in s["sweep"]:
            print(f"[{b}] sweep {r['forced']:.1%}: wire x{r['wire_ratio']:.3f}, live x{r['live_ratio']:.3f}, "
                  f"apply {r['apply_s']} vs dense {r['dense_apply_s']}", flush=True)
    result["argv"] = sys.argv[1:] if argv is None else argv
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(markdown(result))
