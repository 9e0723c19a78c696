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
MiB = 1 << 20
# The bars the GPU data path is held to (printed, never asserted): ratio of transport to the
# same-run torch copy_ of the same kind, by op and size ((op, size): least ratio); a size with no
# row measured is skipped.
RATIO_TARGETS: dict[tuple[str, int], float] = {
    **{(op, n): 0.9 for op in ("d2d put", "d2d get") for n in (64 * MiB, GiB)},
    **{(op, MiB): 0.5 for op in ("d2d put", "d2d get")},
    **{(op, n): 0.95 for op in ("h2d put", "d2h get", "d2h put", "h2d get") for n in (64 * MiB, GiB)},
}
BATCH_TARGET_PER_S = 2e6  # a prepared d2d batch of 10,000 x 4 KiB, segments per second
CLOSE_TARGET_S = 0.05  # Transport.aclose with nothing in flight

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
    close_s: float | None = None  # the initiator's Transport.aclose, nothing in flight

    def targets(self) -> list[dict[str, Any]]:
        """Each bar of the GPU data path with what this run measured against it (``met`` is
        None when it was not measured)."""
        out: list[dict[str, Any]] = []
        rows = {(r.op, r.size): r for r in self.rows}
        for (op, n), bar in RATIO_TARGETS.items():
            r = rows.get((op, n))
            if r is not None:
                out.append({"what": f"{op} {format_size(n)} / {BASELINE_NAMES[r.baseline]}", "value": r.ratio,
                            "bar": f">= {bar}x", "met": r.ratio >= bar})
        per_s = self.batch.get("prepared_per_s")
        out.append({"what": "prepared d2d batch, segments/s", "value": per_s, "bar": f">= {BATCH_TARGET_PER_S:g}",
                    "met": None if per_s is None else per_s >= BATCH_TARGET_PER_S})
        out.append({"what": "Transport.aclose, nothing in flight (s)", "value": self.close_s,
                    "bar": f"<= {CLOSE_TARGET_S}",
                    "met": None if self.close_s is None else self.close_s <= CLOSE_TARGET_S})
        return out

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
            "close_s": self.close_s,
            "targets": self.targets(),
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
    lines.append("")
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
    if rep.close_s is not None:
        lines.append(f"Transport.aclose of the initiator, nothing in flight: {rep.close_s * 1e3:.1f} ms")
    lines += ["", "Targets (printed, never asserted):", "", "| target | measured | bar | met |",
              "| --- | --- | --- | --- |"]
    for t in rep.targets():
        value = "not measured" if t["value"] is None else f"{t['value']:.3g}"
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "**NO**")
        lines.append(f"| {t['what']} | {value} | {t['bar']} | {met} |")
    if rep.error:
        lines += ["", f"**the run failed**: {rep.error}"]
    lines += ["", f"total {rep.elapsed_s:.1f} s"]
    return "\n".join(lines)
