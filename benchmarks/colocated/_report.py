"""The colocated benchmark's results: what the processes reported, put together per method
(medians, ratios against the same-run baselines, the targets, the straggler run, the data
checks), and its report as JSON and Markdown. See :mod:`benchmarks.colocated`.
"""

from __future__ import annotations

import datetime
import math
import platform
import socket
from dataclasses import dataclass, field
from typing import Any

import torch

import transport

from ..common.machine import library_line
from ..common.machine import machine as host_machine
from ..common.sizes import GiB
from ..common.stats import median
from ._models import shapes
from ._roles import Kind, Method, Spec

FLOOR_TARGET = 1.2  # transport live <= 1.2x the floor (printed, not asserted)
SHOWN = 5  # mismatching tensors named in a problem before "and N more"


def labels(device: str) -> dict[str, str]:
    """What each method and baseline is called in the report."""
    copy = "device" if device == "cuda" else "host"
    handles = ("CUDA IPC handles (vLLM `ipc` backend's mechanism), per-tensor copy_" if device == "cuda"
               else "shared-memory handles (torch reduce_tensor on CPU tensors), per-tensor copy_")
    return {
        Method.COPY.value: "transport.weights, copy apply",
        Method.ZERO_COPY.value: "transport.weights, zero-copy apply",
        Method.IPC_HANDLES.value: f"baseline: {handles}",
        "floor": f"floor: K × {copy} copy_ of the model's bytes, one process",
    }


def machine_record(device: str) -> dict[str, Any]:
    """The machine, for the record: the GPU benchmark's fields on a GPU (date, GPU, driver, torch
    and CUDA versions, ...), the host's otherwise."""
    if device == "cuda":
        from ..gpu_bench._report import machine

        return machine()
    host = host_machine()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds"),
        "hostname": socket.gethostname(), "gpu": None, "cuda_torch": torch.version.cuda, "torch": torch.__version__,
        "python": platform.python_version(), "transport": transport.__version__, "cpu": host["cpu"],
        "cpu_count": host["nproc"], "memory_gib": host["memory_gib"],
    }


@dataclass
class MethodResult:
    """One method's versions, put together."""

    method: str
    live_s: float  # median over the timed versions: until every generator has it live
    blocked_s: float  # median: the trainer's call
    live_all: list[float]
    blocked_all: list[float]
    per_generator_s: dict[str, float]  # median per generator
    versions: list[dict[str, Any]]
    verified: bool
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"live_s": self.live_s, "blocked_s": self.blocked_s, "live_s_all": self.live_all,
                "blocked_s_all": self.blocked_all, "per_generator_live_s": self.per_generator_s,
                "verified": self.verified, "problems": self.problems, "versions": self.versions}


@dataclass
class Results:
    """Everything one run measured (what it could, when it failed)."""

    spec: Spec
    floor: dict[str, Any] | None
    methods: dict[str, MethodResult]
    straggler: dict[str, Any] | None
    problems: list[str]

    @property
    def verified(self) -> bool:
        return bool(self.methods) and all(r.verified for r in self.methods.values()) and not self.problems

    def ratios(self) -> dict[str, dict[str, float]]:
        """Per method: live ÷ floor, and the IPC-handle baseline's live ÷ this one's (above 1: faster)."""
        floor = self.floor["seconds"] if self.floor else math.nan
        handles = self.methods.get(Method.IPC_HANDLES.value)
        out = {}
        for name, r in self.methods.items():
            out[name] = {"live_over_floor": r.live_s / floor if floor > 0 else math.nan,
                         "handles_over_live": handles.live_s / r.live_s if handles and r.live_s > 0 else math.nan}
        return out

    def targets(self) -> list[dict[str, Any]]:
        """The targets (printed, never asserted): each transport method's live time within
        ``FLOOR_TARGET`` × the floor, and below the IPC-handle baseline's."""
        ratios = self.ratios()
        out = []
        for m in (Method.COPY, Method.ZERO_COPY):
            r = ratios.get(m.value)
            if r is None:
                continue
            out.append({"method": m.value, "target": f"live <= {FLOOR_TARGET}x floor",
                        "ratio": r["live_over_floor"], "met": r["live_over_floor"] <= FLOOR_TARGET})
            out.append({"method": m.value, "target": "faster than the IPC-handle baseline",
                        "ratio": r["handles_over_live"], "met": r["handles_over_live"] > 1.0})
        return out


def _versions(messages: list[dict[str, Any]], method: str, gens: list[str],
              problems: list[str]) -> list[dict[str, Any]]:
    """Each version of ``method``: the trainer's record with each generator's live time added."""
    arrivals = {(m["version"], m["generator"]): m for m in messages
                if m["kind"] == "arrival" and m["method"] == method}
    out = []
    for v in sorted((m for m in messages if m["kind"] == "version" and m["method"] == method),
                    key=lambda m: m["version"]):
        row = {k: v[k] for k in v if k not in ("kind", "who", "method")}
        live: dict[str, float] = {}
        for g in gens:
            a = arrivals.get((v["version"], g))
            if a is None:
                problems.append(f"{method} version {v['version']}: no arrival from {g}")
                continue
            live[g] = a["t_live"] - v["t_start"]
            if a["mismatches"] or a["applied"] != v["version"]:
                problems.append(f"{method} version {v['version']}: {g} has version {a['applied']} live with "
                                f"{a['mismatches']} tensor(s) not stamped with {v['version']}")
            if a["stopped"]:
                row["stopped_via"] = a["via"]
                if "t_cont" in v:
                    row["stopped_live_after_cont_s"] = a["t_live"] - v["t_cont"]
        row["live_s"] = live
        out.append(row)
    return out


def _verify(messages: list[dict[str, Any]], method: str, names: list[str], gens: list[str],
            problems: list[str]) -> bool:
    """Whether every generator's per-tensor checksums after ``method`` equal the trainer's."""
    sums = {m["who"]: m["sums"] for m in messages if m["kind"] == "sums" and m["method"] == method}
    want = sums.get("trainer")
    if want is None:
        problems.append(f"{method}: the trainer reported no checksums")
        return False
    ok = True
    for g in gens:
        got = sums.get(g)
        if got is None:
            problems.append(f"{method}: {g} reported no checksums")
            ok = False
            continue
        wrong = [n for n, a, b in zip(names, want, got, strict=True) if a != b]
        if wrong:
            more = f" and {len(wrong) - SHOWN} more" if len(wrong) > SHOWN else ""
            problems.append(f"{method}: {g}'s weights differ from the trainer's in {', '.join(wrong[:SHOWN])}{more}")
            ok = False
    return ok


def assemble(messages: list[dict[str, Any]], spec: Spec) -> Results:
    """Puts the processes' messages together (a failed run: whatever they reported)."""
    gens = spec.generators
    names = [n for n, _ in shapes(spec.model)]
    floor = next((m for m in messages if m["kind"] == "floor"), None)
    if floor is not None:
        floor = {k: v for k, v in floor.items() if k not in ("kind", "who")}
    problems: list[str] = []
    methods: dict[str, MethodResult] = {}
    straggler = None
    for method in spec.methods:
        own: list[str] = []
        rows = _versions(messages, method.value, gens, own)
        if not rows:
            continue
        timed = [r for r in rows if r["step"] == Kind.TIMED.value and len(r["live_s"]) == len(gens)]
        if not timed:
            own.append(f"{method.value}: no timed version completed")
        live_all = [max(r["live_s"].values()) for r in timed]
        blocked_all = [r["blocked_s"] for r in timed]
        per_gen = {g: median([r["live_s"][g] for r in timed]) for g in gens} if timed else {}
        verified = _verify(messages, method.value, names, gens, own) and not own
        methods[method.value] = MethodResult(
            method.value, median(live_all) if live_all else math.nan, median(blocked_all) if blocked_all else math.nan,
            live_all, blocked_all, per_gen, rows, verified, own)
        problems += own
        if method is Method.COPY and spec.stopped is not None:
            straggler = _straggler(rows, spec, methods[method.value])
    return Results(spec, floor, methods, straggler, problems)


def _straggler(rows: list[dict[str, Any]], spec: Spec, normal: MethodResult) -> dict[str, Any] | None:
    """The straggler version and the one after it (copy apply)."""
    stop = next((r for r in rows if r["step"] == Kind.STRAGGLER.value), None)
    after = next((r for r in rows if r["step"] == Kind.RECOVER.value), None)
    if stop is None:
        return None
    stopped = spec.stopped
    others = {g: s for g, s in stop["live_s"].items() if g != stopped}
    others_s = max(others.values()) if others else math.nan
    held_s = stop["t_cont"] - stop["t_start"] if "t_cont" in stop else math.nan
    return {
        "method": Method.COPY.value, "version": stop["version"], "stopped": stopped, "stop_s": spec.stop_s,
        "held_s": held_s,
        "others_live_s": others_s, "others_normal_s": normal.live_s,
        "others_over_normal": others_s / normal.live_s if normal.live_s > 0 else math.nan,
        "stalled": not others_s < held_s,  # the others would have waited for it
        "blocked_s": stop["blocked_s"], "stopped_status": stop["status"].get(stopped or "", "not served"),
        "stopped_live_after_cont_s": stop.get("stopped_live_after_cont_s", math.nan),
        "stopped_via": stop.get("stopped_via"),
        "next_version_live_s": max(after["live_s"].values()) if after and after["live_s"] else math.nan,
        "next_version_status": after["status"] if after else None,
    }


# -- output ----------------------------------------------------------------------------------------


def fmt_s(seconds: float) -> str:
    """Seconds as ms below one second (3 significant digits), else seconds."""
    if not math.isfinite(seconds):
        return "—"
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _x(ratio: float) -> str:
    return f"{ratio:.2f}x" if math.isfinite(ratio) else "—"


def to_json(res: Results, info: dict[str, Any]) -> dict[str, Any]:
    floor = res.floor
    return {  # the machine's fields first, at the top, as the GPU benchmark writes them
        "schema": 1, "benchmark": "colocated", **info["machine"], **{k: v for k, v in info.items() if k != "machine"},
        "methods": {m: r.to_json() for m, r in res.methods.items() if m != Method.IPC_HANDLES.value},
        "baselines": {
            "ipc_handles": (res.methods[Method.IPC_HANDLES.value].to_json()
                            if Method.IPC_HANDLES.value in res.methods else None),
            "floor": floor,
        },
        "ratios": res.ratios(), "targets": res.targets(), "straggler": res.straggler,
        "verified": res.verified, "problems": res.problems,
    }


def format_markdown(res: Results, info: dict[str, Any]) -> str:
    m, c, spec = info["machine"], info["config"], res.spec
    names = labels(spec.device)
    model = c["model"]
    where = (f"{m['gpu']} ({m.get('gpu_memory_gib', '?')} GiB), driver {m.get('driver', '?')}" if spec.device == "cuda"
             else f"the CPU ({m.get('cpu', '?')}, {m.get('cpu_count', '?')} cores), no GPU")
    lines = [
        "# Colocated weight sync: a trainer and K generators sharing one " + ("GPU" if spec.device == "cuda" else
                                                                              "host (CPU run)"),
        "",
        f"- date: {m['date']} on {m['hostname']}; {where}",
        f"- torch {m['torch']} (CUDA {m.get('cuda_torch')}), Python {m['python']}, transport {m['transport']}; "
        + library_line(info["library"]),
        f"- command: `{info['command']}`",
        (f"- model: {model['name']} ({model['params'] / 1e9:.2f} B parameters, {model['tensors']} bf16 tensors, "
         f"{model['nbytes'] / GiB:.2f} GiB); {c['model_choice']}"),
        (f"- K = {spec.k} generator processes and 1 trainer process on {c['device_name']}; transport over `ipc` "
         f"into slots on {c['device_name']}; medians of {spec.versions} timed versions after {spec.warmup} warm-up"),
        ("- live = from the trainer's `publish()` (the baseline: the trainer's \"version ready\") until every "
         "generator has the version live (applied; device work synchronized); blocked = how long that call blocks "
         "the trainer; ÷ floor = live ÷ the floor; handles ÷ this = the IPC-handle baseline's live ÷ this one's "
         "(above 1: faster than it)"),
        "",
        "| method | live | ÷ floor | handles ÷ this | trainer blocked | per generator | data verified |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    ratios = res.ratios()
    for name, r in res.methods.items():
        per = ", ".join(f"{g} {fmt_s(s)}" for g, s in r.per_generator_s.items())
        lines.append(f"| {names[name]} | {fmt_s(r.live_s)} | {_x(ratios[name]['live_over_floor'])} | "
                     f"{_x(ratios[name]['handles_over_live'])} | {fmt_s(r.blocked_s)} | {per} | "
                     f"{'yes' if r.verified else 'NO'} |")
    if res.floor:
        f = res.floor
        lines.append(f"| {names['floor']} | {fmt_s(f['seconds'])} | 1.00x | | | {f['gbps']:.1f} GB/s | — |")
    lines += ["", "Targets (printed, not asserted):", ""]
    for t in res.targets():
        lines.append(f"- {names[t['method']]}: {t['target']}: {'YES' if t['met'] else 'NO'} ({_x(t['ratio'])})")
    s = res.straggler
    if s is not None:
        lines += [
            "",
            (f"Straggler ({names[Method.COPY.value]}): {s['stopped']} SIGSTOPped during version {s['version']} "
             f"and held for {fmt_s(s['held_s'])}:"),
            "",
            (f"- the others were live in {fmt_s(s['others_live_s'])} (timed versions: {fmt_s(s['others_normal_s'])}, "
             f"{_x(s['others_over_normal'])}): {'STALLED by it' if s['stalled'] else 'not stalled by it'}"),
            (f"- the trainer was blocked {fmt_s(s['blocked_s'])}; its push to {s['stopped']}: {s['stopped_status']}"
             + (" (landed in its slot one-sidedly while it was stopped)" if s["stopped_status"] == "done" else "")),
            (f"- after SIGCONT {s['stopped']} had the version live in {fmt_s(s['stopped_live_after_cont_s'])} "
             f"(from its {'slot' if s['stopped_via'] == 'slot' else 'publisher snapshot, pulled'})"),
            f"- the next version: every generator live in {fmt_s(s['next_version_live_s'])}",
        ]
    lines.append("")
    lines.append("Data: " + ("every generator's weights equal the trainer's after every method (a checksum per tensor) "
                             "and every version was live whole (a stamp per tensor)" if res.verified
                             else "NOT VERIFIED: " + "; ".join(res.problems or ["see the methods above"])))
    if info.get("error"):
        lines += ["", f"**the run failed**: {info['error']}"]
    lines += ["", f"total {info['elapsed_s']:.1f} s"]
    return "\n".join(lines)
