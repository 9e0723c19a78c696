"""Colocated weight sync: a trainer and K generator processes on one GPU, the weights moving
device to device (CUDA IPC), as in single-node RL setups where both share the GPUs (verl's hybrid
engine, OpenRLHF's colocate mode).

    python -m benchmarks.colocated                          # K=2, the largest Llama that fits (~2 min, H200)
    python -m benchmarks.colocated --quick                  # Llama-3.2-3B at most, fewer versions
    python -m benchmarks.colocated --model llama3.2-3b --json out.json --markdown out.md
    python -m benchmarks.colocated --device cpu             # no GPU: host memory, the small model (CI smoke)

One run, in K + 1 fresh processes on device 0 (see :mod:`._roles` for what each does):

* the model: a bf16 state dict with a real model's shapes (``--model``: ``llama3-8b``,
  ``llama3.2-3b``, ``llama-small``; ``auto``, the default, takes the largest that fits in the
  free GPU memory: K + 1 copies plus the slots);
* ``transport/copy``: ``transport.weights`` Publisher -> Subscribers with their slots on the
  GPU (``device="cuda:0"``), the default copy apply; ``transport/zero-copy``: the same with
  ``zero_copy=True`` (the tensors re-pointed at the slot);
* the baselines: ``ipc-handles``, the mechanism of vLLM's built-in ``ipc`` weight transfer
  (``reduce_tensor`` on each parameter once, the handles sent once over a pipe, each generator
  rebuilds the tensors and copies them into its own at every version), and the floor: one
  process copying the model's bytes K times with ``copy_`` (K generators each need one copy);
* the straggler run (copy apply): one generator SIGSTOPped during a version, the others timed,
  then SIGCONT and its catch-up, then one more version.

Per method: the median over ``--versions`` timed versions (after ``--warmup``) of the time from
the trainer's ``publish()`` (the baseline: its "version ready") until every generator has the
version live, and of the trainer's blocked time; ratios against the same run's floor and
IPC-handle baseline; after each method, every generator's weights are checked against the
trainer's (a checksum per tensor, untimed). Targets are printed, never asserted.

``--device cpu`` runs the same on the host (slots in host memory, the baseline through torch's
shared-memory tensor sharing, the floor a host ``copy_``), for a smoke test without a GPU. On the
default device without a CUDA GPU it exits with status 2 and says why.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..common.machine import CpuSample, command_line, library, meminfo, other_load
from ..common.procs import log_tail, supervise
from ..common.sizes import GiB, format_size, parse_size
from . import _models, _report
from ._roles import Spec, run_generator, run_trainer

QUICK_VERSIONS, QUICK_WARMUP = 3, 1
QUICK_LARGEST = "llama3.2-3b"  # what auto may pick with --quick
_JOIN_S = 20.0
_TAIL = 2500


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.colocated", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="where the weights and slots live (default cuda: GPU 0; cpu: host memory, a smoke test)")
    p.add_argument("--model", choices=("auto", *_models.MODELS), default="auto",
                   help="the model's shapes (default auto: on a GPU the largest of "
                        f"{', '.join(_models.AUTO_ORDER)} that fits, on the CPU {_models.SMALL})")
    p.add_argument("--k", type=int, default=2, help="generator processes (default 2)")
    p.add_argument("--versions", type=int, default=None, help="timed versions per method (default 5; --quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed versions before them (default 2; --quick 1)")
    p.add_argument("--no-straggler", action="store_true", help="skip the straggler run")
    p.add_argument("--stop-s", type=float, default=0.5,
                   help="how long the straggler stays SIGSTOPped, from the publish on (seconds, default 0.5)")
    p.add_argument("--floor-iters", type=int, default=5, help="timed rounds of the floor's K copies (default 5)")
    p.add_argument("--bucket", default=None,
                   help=f"the publisher's bucket size (default: the Publisher's, {format_size(_publisher_bucket())})")
    p.add_argument("--timeout", type=float, default=120.0, help="bound on every wait in a process (default 120 s)")
    p.add_argument("--run-timeout", type=float, default=600.0, help="bound on the whole run (default 600 s)")
    p.add_argument("--quick", action="store_true",
                   help=f"a shorter run: {QUICK_VERSIONS} timed versions after {QUICK_WARMUP}, and auto "
                        f"picks {QUICK_LARGEST} at most")
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    p.add_argument("--markdown", type=Path, default=None, help="write the Markdown report here too")
    p.add_argument("--tmp", type=Path, default=None,
                   help="keep the processes' logs and stores here (default: a temporary directory)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.versions = a.versions if a.versions is not None else (QUICK_VERSIONS if a.quick else 5)
    a.warmup = a.warmup if a.warmup is not None else (QUICK_WARMUP if a.quick else 2)
    if a.k < 1 or a.versions < 1 or a.warmup < 0 or a.floor_iters < 1:
        p.error("--k >= 1, --versions >= 1, --warmup >= 0, --floor-iters >= 1")
    if not (a.stop_s >= 0 and a.timeout > 0 and a.run_timeout > 0):
        p.error("--stop-s >= 0, --timeout > 0, --run-timeout > 0")
    try:
        a.bucket_bytes = parse_size(a.bucket) if a.bucket is not None else _publisher_bucket()
    except ValueError as exc:
        p.error(str(exc))
    return a


def _publisher_bucket() -> int:
    """``Publisher``'s default ``bucket_bytes``."""
    from transport.weights import Publisher

    return int(inspect.signature(Publisher).parameters["bucket_bytes"].default)


def needs_gpu_reason() -> str | None:
    """None when a CUDA GPU and transport's CUDA support are usable here, else why not."""
    from ..gpu_bench._run import needs_gpu_reason as why

    return why()


def free_memory(device: str) -> tuple[int, int]:
    """(free GPU 0 memory, available host memory), bytes (GPU: 0 on the CPU)."""
    gpu = 0
    if device == "cuda":
        import torch

        gpu = int(torch.cuda.mem_get_info(0)[0])
    return gpu, meminfo("MemAvailable")


def run_group(spec: Spec) -> tuple[list[dict[str, Any]], list[str]]:
    """Starts the trainer and the K generators, collects their messages and joins them (every
    one, bounded; all are killed on a failure or when ``--run-timeout`` passes).

    Returns:
        The messages, and the errors (each failed process's with the tail of its log).
    """
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    barrier = ctx.Barrier(spec.k + 1)
    pipes = [ctx.Pipe() for _ in spec.generators]
    procs = [ctx.Process(target=run_trainer, args=(spec, q, barrier, [a for a, _ in pipes]), name="trainer",
                         daemon=True)]
    procs += [ctx.Process(target=run_generator, args=(spec, i, q, barrier, b), name=g, daemon=True)
              for i, (g, (_, b)) in enumerate(zip(spec.generators, pipes, strict=True))]
    started = time.monotonic()

    def progress(msg: dict[str, Any]) -> None:
        kind, at = msg["kind"], f"[{time.monotonic() - started:6.1f} s]"
        if kind == "state" and msg["who"] == "trainer":
            print(f"colocated: {at} state dicts built", file=sys.stderr, flush=True)
        elif kind == "floor":
            print(f"colocated: {at} floor: {msg['copies']} copies in {_report.fmt_s(msg['seconds'])} "
                  f"({msg['gbps']:.1f} GB/s)", file=sys.stderr, flush=True)
        elif kind == "version":
            print(f"colocated: {at} {msg['method']} v{msg['version']} ({msg['step']}): trainer blocked "
                  f"{_report.fmt_s(msg['blocked_s'])}", file=sys.stderr, flush=True)

    try:
        messages, errors = supervise(procs, q, spec.run_timeout_s, progress, _JOIN_S)
    finally:
        for a, b in pipes:
            a.close()
            b.close()
    if errors:  # what else the failed processes wrote (native errors, warnings, a crash)
        for p in procs:
            tail = log_tail(spec.log_path(p.name), _TAIL).strip()
            if p.exitcode != 0 and tail:
                how = "killed by the harness" if p.exitcode == -signal.SIGKILL else f"exit code {p.exitcode}"
                errors.append(f"{p.name} ({how}); its log ends with:\n{tail}")
    return messages, errors


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.device == "cuda":
        why = needs_gpu_reason()
        if why is not None:
            print(f"colocated: needs a CUDA GPU: {why} (--device cpu runs it in host memory, as a smoke test)",
                  file=sys.stderr)
            return 2
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        if "expandable_segments:true" in conf.lower().replace(" ", ""):
            # Memory of expandable segments cannot be exported over legacy CUDA IPC (either side).
            print(f"colocated: PYTORCH_CUDA_ALLOC_CONF={conf} is unset for the benchmark's processes: expandable "
                  "segments cannot be shared over CUDA IPC", file=sys.stderr)
            del os.environ["PYTORCH_CUDA_ALLOC_CONF"]

    # A step limit (e.g. `timeout` in the GPU check) ends the run through the harness, which stops
    # the processes and writes what was measured.
    signal.signal(signal.SIGTERM, _terminated)
    started = time.perf_counter()
    load0 = CpuSample.take()
    free_gpu, free_host = free_memory(args.device)
    cap = QUICK_LARGEST if args.quick else None
    model, why_model = _models.choose(args.model, args.k, args.device, free_gpu, free_host, largest=cap)
    info: dict[str, Any] = {
        "machine": _report.machine_record(args.device), "library": library(),
        "command": command_line(argv, "benchmarks.colocated"),
    }
    print(f"colocated: {model} ({_models.model_bytes(model) / GiB:.2f} GiB), K={args.k}, on {args.device}: "
          f"{why_model}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="colocated-") as scratch:
        tmp = args.tmp if args.tmp is not None else Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        spec = Spec(device=args.device, model=model, k=args.k, warmup=args.warmup, versions=args.versions,
                    straggler=not args.no_straggler, stop_s=args.stop_s, timeout=args.timeout,
                    bucket_bytes=args.bucket_bytes, floor_iters=args.floor_iters, tmp=str(tmp), seed=args.seed,
                    run_timeout_s=args.run_timeout)
        info["config"] = {
            "device": args.device, "device_name": "cuda:0" if args.device == "cuda" else "the host",
            "model": _models.describe(model), "model_choice": why_model, "k": args.k, "warmup": args.warmup,
            "versions": args.versions, "straggler": spec.stopped is not None, "stop_s": args.stop_s,
            "bucket_bytes": args.bucket_bytes, "timeout": args.timeout, "floor_iters": args.floor_iters,
            "free_gpu_bytes": free_gpu, "free_host_bytes": free_host, "backend": "ipc",
        }
        error = None
        try:
            messages, errors = run_group(spec)
        except Exception as exc:  # noqa: BLE001 - reported below with what was measured
            messages, errors = [], [f"{type(exc).__name__}: {exc}"]
        if errors:
            error = "\n".join(errors)
        results = _report.assemble(messages, spec)
    if error is None and not results.verified:
        error = "the data was not verified: " + "; ".join(results.problems or ["a method did not run"])
    info["error"] = error
    info["elapsed_s"] = time.perf_counter() - started
    info["other_load"] = other_load(load0, CpuSample.take())
    doc = _report.to_json(results, info)
    text = _report.format_markdown(results, info)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_finite(doc), indent=2, allow_nan=False) + "\n")
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text + "\n")
    print(text, flush=True)
    if error:
        print(f"colocated: failed: {error}", file=sys.stderr)
        return 1
    return 0


class Terminated(Exception):
    """The benchmark was sent SIGTERM."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated(f"terminated by signal {signum} before the run ended")


def _finite(value: Any) -> Any:
    """``value`` with every float that is not finite (a figure not measured) as None: strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
