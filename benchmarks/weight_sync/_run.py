"""Weight sync benchmark: one-sided ``transport.weights`` vs ``torch.distributed`` broadcast.

    python -m benchmarks.weight_sync                        # the default run (~5 min on 2 cores)
    python -m benchmarks.weight_sync --quick                # a fast run (small sizes, K = 1, 2)
    python -m benchmarks.weight_sync --sizes 1GiB --ks 2 --backends ipc --straggler-delay 2
    python -m benchmarks.weight_sync --record benchmarks/results   # weight_sync-DATE.{md,json,png}

One trainer process syncs a Llama-shaped bf16 state dict (random values; see
``benchmarks/_models.py``) to K generator processes on this host, in the same run with:

* ``transport/<backend>``: ``transport.weights`` Publisher -> Subscribers, once per backend in
  ``--backends`` (default ``ipc,tcp``; name others, e.g. ``ucx``, where they are available),
  with generators that copy each version into their tensors (the default ``apply()``), and
  ``transport/<backend>/zero-copy`` with ``Subscriber(..., zero_copy=True)`` (``--apply``);
* ``broadcast/param``: a gloo process group, trainer = rank 0, one ``broadcast`` per tensor;
* ``broadcast/bucketed``: the same group, tensors packed into ``--bucket-mib`` buckets.

Per version (median over ``--versions`` timed versions after ``--warmup`` untimed ones) it
records when each generator has the version live in its tensors, measured from the trainer's
start timestamp, and how long the trainer is blocked (and the ratio of the two). Then ``--straggler-versions`` more
versions with the last generator delayed ``--straggler-delay`` seconds (it blocks in
``time.sleep`` right after the handshake), to show how much each method delays the *others*.

Before the points, the parent process measures the memory-bandwidth baseline once: a native
``memcpy`` of a pre-faulted ``--memcpy-mib`` buffer into another, by one thread and by two
threads that each copy half (median of ``--memcpy-repetitions``). A point's *floor* is
K × model bytes ÷ the 2-thread rate; each method's time is reported against it ("÷ floor").

Each (size, K) point runs in fresh processes (joined with a timeout, killed on failure); a point
whose processes would not fit in this machine's available memory is skipped with the reason.
Output: a progress bar on stderr, the summary tables on stdout, and optionally JSON (``--json``),
a PNG plot (``--plot``) and a Markdown report (``--markdown``). Timings are measurements, never
asserted.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..common import capabilities
from ..common.errors import BenchError
from ..common.machine import CpuSample, command_line, library, library_line, machine, meminfo, other_load
from ..common.procs import supervise
from ..common.sizes import parse_size  # one size syntax for every benchmark
from . import _report
from ._broadcast import Baseline
from ._models import llama_like
from ._progress import Progress
from ._report import GroupResult, MemcpyRates, size_label
from ._roles import (
    GroupSpec,
    Role,
    backend_of,
    is_transport,
    run_process,
    transport_method,
)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_SIZES = "256MiB,1GiB"
DEFAULT_KS = "1,2,4"
DEFAULT_BACKENDS = "ipc,tcp"
DEFAULT_BASELINES = "param,bucketed"
QUICK = {"sizes": "16MiB,64MiB", "ks": "1,2", "versions": 3, "straggler_versions": 2, "straggler_delay": 0.5}

_PROCESS_OVERHEAD = 450 * MiB  # Python + torch + gloo in one process (measured RSS ≈ 300-400 MiB)
_MEMORY_HEADROOM = 1 * GiB  # left for the OS and the launcher
_JOIN_S = 15.0


def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.weight_sync", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=None, help=f"state dict sizes, comma-separated (default {DEFAULT_SIZES})")
    p.add_argument("--ks", default=None, help=f"numbers of generators, comma-separated (default {DEFAULT_KS})")
    p.add_argument("--backends", default=DEFAULT_BACKENDS,
                   help=f"transport backends, one method each (default {DEFAULT_BACKENDS})")
    p.add_argument("--apply", default="copy,zero-copy",
                   help="how generators apply a version: copy (Subscriber default), zero-copy (zero_copy=True); "
                        "default both")
    p.add_argument("--baselines", default=DEFAULT_BASELINES,
                   help="broadcast variants: param, bucketed (default both; 'none' for none)")
    p.add_argument("--versions", type=int, default=None, help="timed versions per method (default 5)")
    p.add_argument("--straggler-versions", type=int, default=None,
                   help="timed versions with a straggler (default 3; 0 = none)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed versions before the timed ones (default 2: the first write into each of a "
                        "subscriber's two slots also maps its pages into the publisher)")
    p.add_argument("--straggler-delay", type=float, default=None,
                   help="seconds the straggler is busy per version (default 1.0)")
    p.add_argument("--bucket-mib", type=float, default=64.0, help="bucket size of the bucketed broadcast (default 64)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="bound on every wait inside a group (seconds, default 120)")
    p.add_argument("--group-timeout", type=float, default=900.0,
                   help="bound on one (size, K) group (seconds, default 900)")
    p.add_argument("--memcpy-mib", type=float, default=512.0,
                   help="buffer of the memcpy baseline that sets the floor (MiB, default 512)")
    p.add_argument("--memcpy-repetitions", type=int, default=5,
                   help="timed copies per thread count of the memcpy baseline (default 5; the median counts)")
    p.add_argument("--quick", action="store_true",
                   help="a fast run: sizes 16MiB,64MiB, K 1,2, 3 versions, 0.5 s straggler")
    p.add_argument("--json", type=Path, default=None, help="write every measurement and the summary here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG plot here (needs matplotlib)")
    p.add_argument("--markdown", type=Path, default=None,
                   help="write a Markdown report (date, machine, command, tables)")
    p.add_argument("--record", type=Path, default=None, help="directory: write weight_sync-DATE.md/.json/.png there")
    p.add_argument("--note", action="append", default=[], help="a line for the record (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    quick = QUICK if a.quick else {}
    a.sizes = a.sizes or quick.get("sizes", DEFAULT_SIZES)
    a.ks = a.ks or quick.get("ks", DEFAULT_KS)
    a.versions = a.versions if a.versions is not None else quick.get("versions", 5)
    if a.straggler_versions is None:
        a.straggler_versions = quick.get("straggler_versions", 3)
    a.straggler_delay = a.straggler_delay if a.straggler_delay is not None else quick.get("straggler_delay", 1.0)
    try:
        a.size_list = sorted({parse_size(s) for s in _csv(a.sizes)})
        a.k_list = sorted({int(k) for k in _csv(a.ks)})
    except ValueError as exc:
        p.error(str(exc))
    if not a.size_list or not a.k_list or min(a.k_list) < 1:
        p.error("--sizes and --ks need at least one value; K >= 1")
    if a.versions < 1 or a.straggler_versions < 0 or a.warmup < 0 or a.straggler_delay < 0:
        p.error("--versions >= 1, --straggler-versions >= 0, --warmup >= 0, --straggler-delay >= 0")
    a.memcpy_bytes = int(a.memcpy_mib * MiB) // 2 * 2  # two equal halves
    if a.memcpy_bytes < 2 or a.memcpy_repetitions < 1:
        p.error("--memcpy-mib > 0 and --memcpy-repetitions >= 1")
    names = {"param": Baseline.PER_PARAM, "bucketed": Baseline.BUCKETED}
    base = [] if a.baselines.strip() == "none" else _csv(a.baselines)
    if any(b not in names for b in base):
        p.error(f"--baselines: choose from {', '.join(names)} or none")
    applies = _csv(a.apply)
    if not applies or any(x not in ("copy", "zero-copy") for x in applies):
        p.error("--apply: copy, zero-copy or both")
    a.methods = [transport_method(b, zc) for zc in (False, True) if ("zero-copy" if zc else "copy") in applies
                 for b in _csv(a.backends)] + [names[b].value for b in base]
    if not a.methods:
        p.error("nothing to measure: no backends and no baselines")
    if a.record is not None:
        stem = a.record / f"weight_sync-{datetime.date.today().isoformat()}"
        a.json = a.json or stem.with_suffix(".json")
        a.plot = a.plot or stem.with_suffix(".png")
        a.markdown = a.markdown or stem.with_suffix(".md")
    return a


# -- memory --------------------------------------------------------------------------------------


def memory_needed(state_bytes: int, k: int, methods: Sequence[str], bucket_bytes: int) -> int:
    """Peak bytes of one group: every process holds its model; with transport the publisher holds
    two packed snapshots and each subscriber two packed slots (zero-copy: three slots, which replace
    the model's own storage); the bucketed broadcast one bucket per process."""
    staging = 2 * state_bytes if any(is_transport(m) for m in methods) else 0
    bucket = min(bucket_bytes, state_bytes) if Baseline.BUCKETED.value in methods else 0
    return (k + 1) * (state_bytes + max(staging, bucket) + _PROCESS_OVERHEAD)


def available_backends(names: Sequence[str]) -> tuple[list[str], list[str]]:
    """(available, reasons for the others)."""
    known = capabilities.available_backends()
    ok, why = [], []
    for n in names:
        reason = known[n] if n in known else "unknown backend"
        if reason is None:
            ok.append(n)
        else:
            why.append(f"{n}: {reason}")
    return ok, why


# -- the memory-bandwidth floor -------------------------------------------------------------------


def _memcpy() -> tuple[Callable[[int, int, int], object], str]:
    """The C library's single-threaded ``memcpy(dst, src, nbytes)`` through ctypes, which
    releases the GIL around the call (so threads calling it copy in parallel), and its name."""
    fn = ctypes.CDLL(None).memcpy
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    fn.restype = None
    return fn, "libc memcpy (ctypes)"


def measure_memcpy(nbytes: int, repetitions: int) -> MemcpyRates:
    """Times a copy of a pre-faulted ``nbytes`` buffer into another in this process, with one
    thread and with two threads that each copy one half, alternating, after one untimed copy of
    each; the medians of ``repetitions`` copies count. The buffers are freed before it returns.

    Args:
        nbytes: bytes per copy (even).
        repetitions: timed copies per thread count.

    Returns:
        The median seconds of each, and the rates they give.
    """
    import torch

    copy, copier = _memcpy()
    half = nbytes // 2
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)  # every page touched: no fault is timed
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    s, d = src.data_ptr(), dst.data_ptr()
    times: dict[int, list[float]] = {1: [], 2: []}
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="memcpy") as helper:

            def one() -> None:
                copy(d, s, nbytes)

            def two() -> None:  # this thread copies the first half while the helper copies the second
                second = helper.submit(copy, d + half, s + half, nbytes - half)
                copy(d, s, half)
                second.result()

            for i in range(repetitions + 1):
                for threads, run in ((1, one), (2, two)):
                    t0 = time.perf_counter()
                    run()
                    if i:  # the first round is the untimed one
                        times[threads].append(time.perf_counter() - t0)
    finally:
        del src, dst
    return MemcpyRates(nbytes, repetitions, copier, statistics.median(times[1]), statistics.median(times[2]))


# -- one group -------------------------------------------------------------------------------------


def run_group(spec: GroupSpec, size: int, progress: Progress, group_timeout: float) -> GroupResult:
    """Starts the trainer and K generators for one (size, K) point, collects their messages and
    joins them (bounded). Kills every process of the group on failure or timeout.

    Raises:
        BenchError: a process failed, the group timed out, or wrong weights arrived.
    """
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=run_process, args=(Role.TRAINER, 0, spec, q), name="trainer", daemon=True)]
    procs += [ctx.Process(target=run_process, args=(Role.GENERATOR, i, spec, q), name=g, daemon=True)
              for i, g in enumerate(spec.generators)]
    t0 = time.monotonic()
    label = f"{size_label(size)} K={spec.k}"
    progress.describe(f"{label}: starting {spec.k + 1} processes")

    def report(msg: dict[str, Any]) -> None:
        if msg["kind"] == "version":
            progress.update()
            what = "straggler" if msg["straggle"] else ("warm-up" if msg["warmup"] else "timed")
            progress.describe(f"{label} {msg['method']} v{msg['version']} ({what})")

    messages, errors = supervise(procs, q, group_timeout, report, _JOIN_S)
    if errors:
        raise BenchError(f"{label} failed:\n" + "\n".join(errors))
    straggler = spec.generators[spec.straggler] if spec.straggler is not None else None
    records, verified, problems = _report.assemble(messages, spec.generators)
    if problems:
        raise BenchError(f"{label}: " + "; ".join(problems))
    peak = {m["who"]: m["peak_rss"] for m in messages if m["kind"] == "exit"}
    return GroupResult(size, spec.k, spec.config.describe(), spec.methods, straggler, spec.straggler_delay,
                       records, verified, wall_s=time.monotonic() - t0, peak_rss=peak)


# -- output ----------------------------------------------------------------------------------------


def render(groups: Sequence[GroupResult], args: argparse.Namespace, notes: Sequence[str],
           memcpy: MemcpyRates) -> tuple[str, dict[str, Any]]:
    """(the text report, its JSON summary)."""
    rows = _report.summary_rows(groups, memcpy)
    tg = _report.targets(rows, args.straggler_delay)
    mode_t = _report.mode_targets(rows, memcpy.two_thread_gbps)
    parts = [
        (f"Memory-bandwidth baseline, this run, in the benchmark's parent process before the points: "
         f"{memcpy.describe()}. Floor of a point = K × model bytes ÷ the 2-thread rate."),
        "",
        ("Medians in seconds, from the trainer's start timestamp of a version until the generator has it live in "
         "its tensors (transport: `await sub.wait_version(v)` returned, i.e. applied; broadcast: its last "
         "broadcast/unpack returned). \"all have it\" = the slowest generator; \"trainer blocked\" = `publish()` / the "
         "trainer's broadcast loop; \"÷ faster broadcast\" = this method's time / the faster broadcast baseline's "
         "(below 1 is faster); \"others\" = every generator but the straggler, without and with the straggler "
         f"busy for {args.straggler_delay:g} s per version."),
        "",
        _report.table(rows),
        "",
        "Best transport backend vs the faster broadcast baseline (all generators have the version):",
        "",
        _report.speedup_table(rows),
        "",
        ("Where transport's time goes (medians: snapshot packing in `publish`, every byte in every generator's "
         "slot per the publisher's report, every generator applied, trainer blocked; \"blocked ÷ applied\" = "
         "trainer blocked ÷ all applied; \"floor\" = K × model bytes ÷ the 2-thread memcpy rate above, "
         "\"÷ floor\" = all applied ÷ floor):"),
        "",
        _report.breakdown_table(rows),
        "",
        _report.mode_targets_text(mode_t),
        "",
        _report.targets_text(tg),
    ]
    for n in notes:
        parts += ["", f"Note: {n}"]
    summary = {"memcpy": memcpy.to_json(), "rows": rows, "speedups": _report.speedups(rows), "targets": tg,
               "mode_targets": mode_t}
    return "\n".join(parts), summary


def write_outputs(text: str, summary: dict[str, Any], groups: Sequence[GroupResult], args: argparse.Namespace,
                  info: dict[str, Any], cmd: str, started: str, wall_s: float, notes: Sequence[str]) -> list[Path]:
    written = []
    if args.json:
        doc = {
            "benchmark": "weight_sync", "date": started, "command": cmd, "machine": info, "wall_s": round(wall_s, 1),
            "config": {"sizes": args.size_list, "ks": args.k_list, "methods": args.methods, "versions": args.versions,
                       "straggler_versions": args.straggler_versions, "warmup": args.warmup,
                       "straggler_delay_s": args.straggler_delay, "bucket_bytes": int(args.bucket_mib * MiB),
                       "timeout_s": args.timeout, "memcpy_bytes": args.memcpy_bytes,
                       "memcpy_repetitions": args.memcpy_repetitions},
            "notes": list(notes), "summary": summary, "groups": [g.to_json() for g in groups],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
        written.append(args.json)
    if args.plot:
        title = (f"Weight sync, trainer → K generators, bf16 Llama-shaped state dict "
                 f"({info['nproc']}-core {info['cpu']}, {started[:10]})")
        png = _report.plot(groups, args.plot, title)
        if png is None:
            print("plot skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        else:
            written.append(png)
    if args.markdown:
        md = [
            f"# Weight sync benchmark: transport vs broadcast, {started[:10]}",
            "",
            (f"Machine: {info['nproc']} cores ({info['cpu']}), {info['memory_gib']} GiB, no GPU; "
             f"Python {info['python']}, torch {info['torch']} ({info['platform']})."),
            "",
            f"Command: `{cmd}` (run from the repository root; {wall_s / 60:.1f} min).",
            "",
            library_line(info["library"]),
            "",
            f"Started {started}. Models (Llama-shaped, bf16): "
            + "; ".join(sorted({f"{size_label(g.size)}: hidden {g.model['hidden']}, {g.model['layers']} layers, vocab "
                                f"{g.model['vocab']}, {g.model['tensors']} tensors, {g.model['nbytes'] / GiB:.3f} GiB"
                                for g in groups if g.model})) + ".",
            "",
            "Peak resident memory per process (the publisher's RSS also counts the subscribers' slots it maps, "
            "pages shared with them): "
            + "; ".join(f"{size_label(g.size)} K={g.k}: trainer {g.peak_rss.get('trainer', 0) / GiB:.1f} GiB, "
                        f"generators {_peak_generator_rss(g) / GiB:.1f} GiB"
                        for g in groups) + ".",
            "",
            text,
        ]
        if args.json:
            md += ["", f"Every version's timestamps: `{args.json.name}`."]
        if args.plot:
            md += ["", f"![time vs size]({args.plot.name})"]
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text("\n".join(md) + "\n")
        written.append(args.markdown)
    return written


def _peak_generator_rss(group: GroupResult) -> int:
    """The largest peak RSS (bytes) among the group's generators, 0 without any."""
    return max((v for k, v in group.peak_rss.items() if k != "trainer"), default=0)


# -- main ------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cmd = command_line(argv, "benchmarks.weight_sync")
    started = datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds")
    info = machine()
    info["library"] = library()
    notes: list[str] = list(args.note)
    backends = list(dict.fromkeys(backend_of(m) for m in args.methods if is_transport(m)))
    ok, why = available_backends(backends)
    for w in why:
        notes.append(f"backend skipped: {w}")
    methods = tuple(m for m in args.methods if not is_transport(m) or backend_of(m) in ok)
    bucket_bytes = int(args.bucket_mib * MiB)
    print(f"weight_sync: {info['nproc']}-core {info['cpu']}, {info['memory_gib']} GiB; torch {info['torch']}; "
          f"sizes {', '.join(size_label(s) for s in args.size_list)}; K {', '.join(map(str, args.k_list))}; "
          f"methods {', '.join(methods)}; {args.versions} timed versions (+{args.warmup} warm-up), "
          f"{args.straggler_versions} with a {args.straggler_delay:g} s straggler", flush=True)
    memcpy = measure_memcpy(args.memcpy_bytes, args.memcpy_repetitions)  # before the points: none is running
    print(f"weight_sync: {memcpy.describe()}", flush=True)

    plan: list[tuple[int, GroupSpec]] = []
    with tempfile.TemporaryDirectory(prefix="weight-sync-") as tmp:
        for size in args.size_list:
            config = llama_like(size)
            for k in args.k_list:
                need = memory_needed(config.nbytes, k, methods, bucket_bytes)
                have = meminfo("MemAvailable") - _MEMORY_HEADROOM
                if have > 0 and need > have:
                    notes.append(f"skipped {size_label(size)} K={k}: needs ~{need / GiB:.1f} GiB "
                                 f"({k + 1} processes × (model + 2 staging copies + runtime)), "
                                 f"{have / GiB:.1f} GiB available")
                    print(notes[-1], file=sys.stderr)
                    continue
                gdir = os.path.join(tmp, f"{size}-{k}")
                os.makedirs(gdir)
                plan.append((size, GroupSpec(config, k, methods, args.versions, args.straggler_versions, args.warmup,
                                             args.straggler_delay, bucket_bytes, gdir, args.timeout, args.seed)))
        total = sum(len(spec.steps()) * len(methods) for _, spec in plan)
        progress = Progress(total, enabled=not args.no_progress)
        groups: list[GroupResult] = []
        t0 = time.monotonic()
        cpu0 = CpuSample.take()
        try:
            for size, spec in plan:
                g = run_group(spec, size, progress, args.group_timeout)
                groups.append(g)
                progress.write(f"{size_label(size)} K={spec.k}: done in {g.wall_s:.0f} s")
        except BenchError as exc:
            print(f"weight_sync: {exc}", file=sys.stderr)
            return 1
        finally:
            progress.close()
        wall_s = time.monotonic() - t0
        load = other_load(cpu0, CpuSample.take())
    lib_end = library()
    lib_start = info["library"]
    if (lib_end.get("commit"), lib_end.get("uncommitted")) != (lib_start.get("commit"), lib_start.get("uncommitted")):
        notes.append(f"the library changed during the run ({library_line(lib_start)} -> {library_line(lib_end)}): "
                     "groups started after the change measured the new code; rerun")
    info["other_load_during_run"] = load
    notes.append(f"other processes on this machine used {load['other_cpu_s']:g} CPU-seconds during the run "
                 f"(on average {load['other_cores_avg']:g} of {info['nproc']} cores, {100 * load['other_share']:.0f}%)"
                 + ("; the timings are disturbed: rerun on a quiet machine" if load["other_share"] > 0.05 else ""))
    text, summary = render(groups, args, notes, memcpy)
    print()
    print(text)
    for path in write_outputs(text, summary, groups, args, info, cmd, started, wall_s, notes):
        print(f"wrote {path}")
    return 0
