"""The GPU micro-benchmark's results: the operations it measures, its rows, its report (JSON and
Markdown) and the machine facts recorded with them. See :mod:`benchmarks.gpu_bench`.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import transport

from ..common.sizes import GiB, format_size

DEV_KEY, HOST_KEY = "bench.dev", "bench.host"  # the target's device and host regions
CRITERION = 0.8  # the bar: d2d put across processes >= 0.8x the same-run device copy

# op -> (direction, local memory, remote region key, baseline)
OPS: dict[str, tuple[str, str, str, str]] = {
    "d2d put": ("put", "dev", DEV_KEY, "d2d"),
    "d2d get": ("get", "dev", DEV_KEY, "d2d"),
    "d2h get": ("get", "pinned", DEV_KEY, "d2h"),
    "h2d put": ("put", "pinned", DEV_KEY, "h2d"),
    "d2h put": ("put", "dev", HOST_KEY, "d2h"),
    "h2d get": ("get", "dev", HOST_KEY, "h2d"),
}
BASELINE_NAMES = {"d2d": "device copy_", "h2d": "pinned->device copy_", "d2h": "device->pinned copy_"}


# -------------------------------------------------------------------------------------------------
# Machine facts


def _run_text(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def driver_version() -> str:
    v = _run_text(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if v:
        return v.splitlines()[0].strip()
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # noqa: BLE001 - any failure just means "unknown"
        return "unknown"


def machine() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "gpu": torch.cuda.get_device_name(0),
        "gpu_count": torch.cuda.device_count(),
        "gpu_memory_gib": round(props.total_memory / GiB, 1),
        "gpu_sms": props.multi_processor_count,
        "driver": driver_version(),
        "cuda_torch": torch.version.cuda,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "transport": transport.__version__,
        "cpu_count": os.cpu_count(),
    }


# -------------------------------------------------------------------------------------------------
# Results


@dataclass
class Row:
    op: str
    size: int
    iters: int
    gbps: float
    baseline: str
    baseline_gbps: float
    baseline_events_gbps: float

    @property
    def ratio(self) -> float:
        return self.gbps / self.baseline_gbps if self.baseline_gbps > 0 else float("nan")


@dataclass
class Report:
    machine: dict[str, Any]
    config: dict[str, Any]
    rows: list[Row]
    baselines: dict[str, dict[int, tuple[float, float]]]  # kind -> size -> (wall GB/s, events GB/s)
    nccl: dict[str, Any]
    error: str | None = None
    elapsed_s: float = 0.0
    batch: dict[str, Any] = field(default_factory=dict)  # the d2d prepared batch (gpu_bench.measure_batch)

    def criterion(self) -> dict[str, Any] | None:
        puts = [r for r in self.rows if r.op == "d2d put"]
        if not puts:
            return None
        r = max(puts, key=lambda r: r.size)
        return {"op": "d2d put", "size": r.size, "ratio": r.ratio, "threshold": CRITERION, "met": r.ratio >= CRITERION}

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": 1,
            **self.machine,
            "config": self.config,
            "rows": [{**asdict(r), "ratio": r.ratio} for r in self.rows],
            "baselines": {
                k: [{"size": n, "gbps": w, "events_gbps": e} for n, (w, e) in sorted(v.items())]
                for k, v in self.baselines.items()
            },
            "nccl_broadcast": self.nccl,
            "d2d_batch": self.batch,
            "criterion": self.criterion(),
            "error": self.error,
            "elapsed_s": self.elapsed_s,
        }


def format_markdown(rep: Report) -> str:
    m, c = rep.machine, rep.config
    lines = [
        "# transport GPU micro-benchmark",
        "",
        f"- date: {m['date']} on {m['hostname']}",
        (
            f"- GPU: {m['gpu']} ({m['gpu_sms']} SMs, {m['gpu_memory_gib']} GiB; {m['gpu_count']} visible), "
            f"driver {m['driver']}"
        ),
        f"- torch {m['torch']} (CUDA {m['cuda_torch']}), Python {m['python']}, transport {m['transport']}",
        (
            f"- two processes on GPU 0 over `ipc`; median of the timed operations after {c['warmup']} warm-up ones, "
            "one at a time; GB/s = 1e9 bytes/s; ratio = transport / the same-run torch `copy_` baseline, "
            "both timed with synchronize + perf_counter"
            " (the events column: the baseline's kernel time alone, CUDA events)"
        ),
        "",
        "| op | size | transport GB/s | baseline | baseline GB/s | ratio | baseline GB/s (events) | iters |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    order = list(OPS)
    for r in sorted(rep.rows, key=lambda r: (order.index(r.op), r.size)):
        lines.append(
            f"| {r.op} | {format_size(r.size)} | {r.gbps:.1f} | {BASELINE_NAMES[r.baseline]} | {r.baseline_gbps:.1f} | "
            f"{r.ratio:.2f} | {r.baseline_events_gbps:.1f} | {r.iters} |"
        )
    crit = rep.criterion()
    lines.append("")
    if crit is not None:
        verdict = "met" if crit["met"] else "NOT met"
        lines.append(
            f"d2d put at {format_size(crit['size'])}: {crit['ratio']:.2f}x the same-run device copy "
            f"(criterion >= {CRITERION}: {verdict})"
        )
    b = rep.batch
    if "skipped" in b:
        lines.append(f"d2d batch: skipped: {b['skipped']}")
    elif b:
        lines.append(
            f"d2d batch of {b['segments']} x {format_size(b['segment_bytes'])} at a {format_size(b['stride'])} "
            f"stride: prepared put {b['prepared_per_s'] / 1e3:.1f}k segments/s, single puts "
            f"{b['single_per_s'] / 1e3:.1f}k segments/s ({b['prepared_per_s'] / b['single_per_s']:.1f}x)"
        )
    nccl = rep.nccl
    if "skipped" in nccl:
        lines.append(f"nccl broadcast: skipped: {nccl['skipped']}")
    elif "error" in nccl:
        lines.append(f"nccl broadcast: failed: {nccl['error']}")
    else:
        lines += ["", "nccl broadcast (rank 0 on GPU 0 -> rank 1 on GPU 1, timed on the receiver):", "",
                  "| size | GB/s | iters |", "| --- | --- | --- |"]
        for s in nccl.get("sizes", []):
            lines.append(f"| {format_size(s['size'])} | {s['gbps']:.1f} | {s['iters']} |")
    if rep.error:
        lines += ["", f"**the run failed**: {rep.error}"]
    lines += ["", f"total {rep.elapsed_s:.1f} s"]
    return "\n".join(lines)
