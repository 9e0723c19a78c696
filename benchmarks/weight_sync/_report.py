"""Turns the processes' messages into per-version records, medians, tables, JSON and a plot."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._roles import is_transport, is_zero_copy

NORMAL, STRAGGLER = "normal", "straggler"
TARGET_SPEEDUP = 3.0  # best transport backend vs the faster broadcast, 1 GiB, K = 2
TARGET_OTHERS_RATIO = 1.2  # others' completion with / without a straggler (transport)
# Per apply mode, on the same (1 GiB, K = 2) point:
TARGET_COPY_SPEEDUP = 2.0  # the best copy-mode backend vs the faster broadcast
TARGET_ZERO_COPY_SPEEDUP = 3.5  # the best zero-copy backend vs the faster broadcast
TARGET_BLOCKED_RATIO = 1.1  # trainer blocked / all generators have the version live (each mode's best backend)
TARGET_FLOOR_RATIO = 1.3  # the best zero-copy backend / the memory-bandwidth floor
GiB = 1 << 30

Records = dict[str, dict[str, list[dict[str, Any]]]]  # method -> phase -> one dict per version


def size_label(n: int) -> str:
    """``268435456`` -> ``"0.25 GiB"``, ``67108864`` -> ``"64 MiB"``."""
    if n >= GiB // 4:
        return f"{n / GiB:g} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):g} MiB"
    return f"{n / 1024:g} KiB"


def _median(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return statistics.median(xs) if xs else None


@dataclass(frozen=True)
class MemcpyRates:
    """The same-run memory-bandwidth baseline: a native ``memcpy`` between two pre-faulted buffers
    of the benchmark's parent process, by one thread and by two threads (each copies one half).

    The floor of a weight sync is ``K × model bytes ÷ the 2-thread rate``: every byte of the model
    written once into each of K generators' memory, at the rate two copying threads reach here.
    """

    buffer_bytes: int
    repetitions: int  # timed copies per thread count (after one untimed copy each)
    copier: str  # which memcpy was timed
    one_thread_s: float  # median seconds to copy the buffer with one thread
    two_thread_s: float  # median seconds with two threads, each copying half

    @property
    def one_thread_gbps(self) -> float:
        return self.buffer_bytes / self.one_thread_s / 1e9

    @property
    def two_thread_gbps(self) -> float:
        return self.buffer_bytes / self.two_thread_s / 1e9

    def floor_s(self, nbytes: int) -> float:
        """Seconds to write ``nbytes`` at the 2-thread memcpy rate."""
        return nbytes / (self.two_thread_gbps * 1e9)

    def to_json(self) -> dict[str, Any]:
        return {
            "buffer_bytes": self.buffer_bytes, "repetitions": self.repetitions, "copier": self.copier,
            "one_thread_s": self.one_thread_s, "two_thread_s": self.two_thread_s,
            "one_thread_gbps": self.one_thread_gbps, "two_thread_gbps": self.two_thread_gbps,
        }

    def describe(self) -> str:
        return (f"memcpy ({self.copier}, a pre-faulted {size_label(self.buffer_bytes)} buffer into another, "
                f"median of {self.repetitions}): 1 thread {self.one_thread_gbps:.2f} GB/s, "
                f"2 threads (each copies half) {self.two_thread_gbps:.2f} GB/s")


@dataclass
class GroupResult:
    """Everything measured for one (size, K) point."""

    size: int  # the requested size
    k: int
    model: dict[str, Any]
    methods: tuple[str, ...]
    straggler: str | None
    straggler_delay: float
    records: Records = field(default_factory=dict)
    verified: dict[str, bool] = field(default_factory=dict)  # method -> every generator bit-for-bit equal
    skipped: str | None = None
    wall_s: float = 0.0
    peak_rss: dict[str, int] = field(default_factory=dict)  # process -> peak resident bytes (incl. shared slots)

    def to_json(self) -> dict[str, Any]:
        return {
            "size": self.size, "size_label": size_label(self.size), "k": self.k, "model": self.model,
            "methods": list(self.methods), "straggler": self.straggler, "straggler_delay_s": self.straggler_delay,
            "skipped": self.skipped, "wall_s": round(self.wall_s, 2), "verified": self.verified,
            "peak_rss_gib": {k: round(v / GiB, 3) for k, v in self.peak_rss.items()},
            "versions": self.records,
            "medians": {
                m: {ph: phase_stats(recs, self.straggler) for ph, recs in by.items()} for m, by in self.records.items()
            },
        }


def assemble(
    messages: Sequence[dict[str, Any]], generators: Sequence[str]
) -> tuple[Records, dict[str, bool], list[str]]:
    """Joins the trainer's ``version`` messages with the generators' ``arrival`` messages.

    Returns:
        (records by method and phase, bit-for-bit verification by method, problems found).
    """
    arrivals: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    checksums: dict[str, dict[str, int]] = {}
    problems: list[str] = []
    for m in messages:
        if m["kind"] == "arrival":
            arrivals.setdefault((m["method"], m["version"]), {})[m["generator"]] = m
        elif m["kind"] == "phase":
            checksums.setdefault(m["method"], {})[m["who"]] = m["checksum"]
    records: Records = {}
    for m in messages:
        if m["kind"] != "version":
            continue
        got = arrivals.get((m["method"], m["version"]), {})
        missing = [g for g in generators if g not in got]
        if missing:
            problems.append(f"{m['method']} version {m['version']}: no arrival from {missing}")
            continue
        rec = {k: v for k, v in m.items() if k not in ("kind", "who", "method", "straggle")}
        rec["completion_s"] = {g: got[g]["arrival"] - m["t_start"] for g in generators}
        rec["mismatched_tensors"] = sum(got[g]["mismatches"] for g in generators)
        if rec["mismatched_tensors"]:
            problems.append(
                f"{m['method']} version {m['version']}: {rec['mismatched_tensors']} tensors without the version's stamp"
            )
        bad = {g: s for g, s in m.get("status", {}).items() if s != "done"}
        if bad:
            problems.append(f"{m['method']} version {m['version']}: publish statuses {bad}")
        records.setdefault(m["method"], {}).setdefault(STRAGGLER if m["straggle"] else NORMAL, []).append(rec)
    verified = {}
    for method, by_who in checksums.items():
        ref = by_who.get("trainer")
        verified[method] = ref is not None and all(by_who.get(g) == ref for g in generators)
        if not verified[method]:
            problems.append(f"{method}: final weights differ between trainer and generators")
    return records, verified, problems


def phase_stats(records: Sequence[dict[str, Any]], straggler: str | None) -> dict[str, Any]:
    """Medians over the timed (non-warm-up) versions of one phase."""
    timed = [r for r in records if not r.get("warmup")]
    if not timed:
        return {}
    gens = sorted(timed[0]["completion_s"])
    others = [g for g in gens if g != straggler]
    out: dict[str, Any] = {
        "versions": len(timed),
        "complete_s": _median(max(r["completion_s"].values()) for r in timed),
        "blocked_s": _median(r["blocked_s"] for r in timed),
        "per_generator_s": {g: _median(r["completion_s"][g] for r in timed) for g in gens},
    }
    if straggler is not None and others:
        out["others_s"] = _median(max(r["completion_s"][g] for g in others) for r in timed)
        out["straggler_s"] = _median(r["completion_s"][straggler] for r in timed)
    if "snapshot_s" in timed[0]:
        out["snapshot_s"] = _median(r["snapshot_s"] for r in timed)
        out["data_complete_s"] = _median(max(r["data_complete_s"].values()) for r in timed)
    return out


def summary_rows(groups: Sequence[GroupResult], memcpy: MemcpyRates | None = None) -> list[dict[str, Any]]:
    """One row per (size, K, method) with the medians and the ratios the issues ask for; with
    ``memcpy``, also the memory-bandwidth floor (``floor_s`` = K × model bytes ÷ the 2-thread
    memcpy rate) and ``vs_floor`` = ``complete_s`` ÷ ``floor_s``."""
    rows = []
    for g in groups:
        if g.skipped:
            continue
        stats = {m: {ph: phase_stats(recs, g.straggler) for ph, recs in by.items()} for m, by in g.records.items()}
        bcast = [
            stats[m][NORMAL]["complete_s"]
            for m in g.methods
            if not is_transport(m) and m in stats and stats[m].get(NORMAL)
        ]
        best_bcast = min(bcast) if bcast else None
        for m in g.methods:
            normal, strag = stats.get(m, {}).get(NORMAL, {}), stats.get(m, {}).get(STRAGGLER, {})
            if not normal:
                continue
            row: dict[str, Any] = {
                "size": g.size, "size_label": size_label(g.size), "k": g.k, "method": m,
                "complete_s": normal["complete_s"], "blocked_s": normal["blocked_s"],
                "vs_best_broadcast": normal["complete_s"] / best_bcast if best_bcast else None,
                "others_s": normal.get("others_s"), "others_straggler_s": strag.get("others_s"),
                "straggler_s": strag.get("straggler_s"), "blocked_straggler_s": strag.get("blocked_s"),
                "snapshot_s": normal.get("snapshot_s"), "data_complete_s": normal.get("data_complete_s"),
                "verified": g.verified.get(m),
                "model_bytes": g.model.get("nbytes", g.size),
                "blocked_ratio": normal["blocked_s"] / normal["complete_s"] if normal["complete_s"] else None,
                "floor_s": None, "vs_floor": None,
            }
            if memcpy is not None:
                row["floor_s"] = memcpy.floor_s(g.k * row["model_bytes"])
                row["vs_floor"] = normal["complete_s"] / row["floor_s"]
            if row["others_s"] and row["others_straggler_s"] is not None:
                row["others_ratio"] = row["others_straggler_s"] / row["others_s"]
                row["others_delay_s"] = row["others_straggler_s"] - row["others_s"]
            rows.append(row)
    return rows


def speedups(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (size, K): the best transport backend vs the faster broadcast baseline."""
    out = []
    for key in sorted({(r["size"], r["k"]) for r in rows}):
        here = [r for r in rows if (r["size"], r["k"]) == key]
        tr = [r for r in here if is_transport(r["method"])]
        bc = [r for r in here if not is_transport(r["method"])]
        if not tr or not bc:
            continue
        t = min(tr, key=lambda r: r["complete_s"])
        b = min(bc, key=lambda r: r["complete_s"])
        out.append({"size": key[0], "size_label": size_label(key[0]), "k": key[1], "transport": t["method"],
                    "transport_s": t["complete_s"], "broadcast": b["method"], "broadcast_s": b["complete_s"],
                    "speedup": b["complete_s"] / t["complete_s"]})
    return out


def targets(rows: Sequence[dict[str, Any]], delay: float, size: int = GiB, k: int = 2) -> dict[str, Any]:
    """The issue's acceptance numbers, checked on the (1 GiB, K = 2) point."""
    here = [r for r in rows if r["size"] == size and r["k"] == k]
    sp = list(speedups(here))
    if not sp:
        return {"measured": False, "note": f"the run has no {size_label(size)}, K={k} point with both kinds of method"}
    s = sp[0]
    best = next(r for r in here if r["method"] == s["transport"])
    bc = [r for r in here if not is_transport(r["method"])]
    out: dict[str, Any] = {
        "measured": True, "size_label": size_label(size), "k": k,
        "speedup": {"value": s["speedup"], "target": TARGET_SPEEDUP, "holds": s["speedup"] >= TARGET_SPEEDUP,
                    "transport": s["transport"], "transport_s": s["transport_s"],
                    "broadcast": s["broadcast"], "broadcast_s": s["broadcast_s"]},
    }
    if best.get("others_ratio") is not None:
        tr = {r["method"]: {"others_ratio": r["others_ratio"], "holds": r["others_ratio"] <= TARGET_OTHERS_RATIO}
              for r in here if is_transport(r["method"]) and r.get("others_ratio") is not None}
        bd = {r["method"]: {"others_delay_s": r["others_delay_s"], "holds": r["others_delay_s"] >= delay,
                            "others_straggler_s": r["others_straggler_s"],
                            # the others cannot finish before the straggler wakes up and joins
                            "others_wait_for_straggler": r["others_straggler_s"] >= delay}
              for r in bc if r.get("others_delay_s") is not None}
        out["straggler"] = {
            "delay_s": delay, "best_transport": s["transport"], "transport": tr, "broadcast": bd,
            "transport_holds": tr[s["transport"]]["holds"],  # 2a: the best backend's others stay within 1.2x
            # 2b: every baseline's others grow >= delay
            "broadcast_holds": bool(bd) and all(v["holds"] for v in bd.values()),
        }
    return out


def _best(rows: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    return min(rows, key=lambda r: r["complete_s"], default=None)


def mode_targets(rows: Sequence[dict[str, Any]], memcpy_gbps: float | None, size: int = GiB,
                    k: int = 2) -> dict[str, Any]:
    """The apply modes' acceptance numbers on the (``size``, ``k``) point, for each apply mode's best
    backend (the least ``complete_s``): copy mode ≥ 2× and zero-copy ≥ 3.5× the faster broadcast,
    the trainer blocked ≤ 1.1× the time until every generator has the version live, zero-copy
    within 1.3× of the memory-bandwidth floor.

    Args:
        rows: :func:`summary_rows` (with the floor, for the floor target).
        memcpy_gbps: the 2-thread memcpy rate the floor was computed from (for the record).
        size: the requested state-dict size of the point.
        k: the number of generators of the point.

    Returns:
        ``{"measured": False, "note": ...}`` without transport rows at the point; else one entry per
        target (None where the run lacks what it needs, e.g. no broadcast baseline or no zero-copy).
    """
    here = [r for r in rows if r["size"] == size and r["k"] == k]
    tr = [r for r in here if is_transport(r["method"])]
    if not tr:
        return {"measured": False, "note": f"the run has no {size_label(size)}, K={k} point with transport"}
    bcast = _best(r for r in here if not is_transport(r["method"]))
    best = {"copy": _best(r for r in tr if not is_zero_copy(r["method"])),
            "zero-copy": _best(r for r in tr if is_zero_copy(r["method"]))}

    def speedup(mode: str, target: float) -> dict[str, Any] | None:
        r = best[mode]
        if r is None or bcast is None:
            return None
        value = bcast["complete_s"] / r["complete_s"]
        return {"method": r["method"], "complete_s": r["complete_s"], "broadcast": bcast["method"],
                "broadcast_s": bcast["complete_s"], "value": value, "target": target, "holds": value >= target}

    blocked = {mode: {"method": r["method"], "blocked_s": r["blocked_s"], "complete_s": r["complete_s"],
                      "value": r["blocked_ratio"], "target": TARGET_BLOCKED_RATIO,
                      "holds": r["blocked_ratio"] <= TARGET_BLOCKED_RATIO}
               for mode, r in best.items() if r is not None and r.get("blocked_ratio") is not None}
    zc = best["zero-copy"]
    floor = None
    if zc is not None and zc.get("vs_floor") is not None and memcpy_gbps is not None:
        floor = {"method": zc["method"], "complete_s": zc["complete_s"], "floor_s": zc["floor_s"],
                 "model_bytes": zc["model_bytes"], "memcpy_two_thread_gbps": memcpy_gbps,
                 "value": zc["vs_floor"], "target": TARGET_FLOOR_RATIO, "holds": zc["vs_floor"] <= TARGET_FLOOR_RATIO}
    return {
        "measured": True, "size_label": size_label(size), "k": k,
        "copy_speedup": speedup("copy", TARGET_COPY_SPEEDUP),
        "zero_copy_speedup": speedup("zero-copy", TARGET_ZERO_COPY_SPEEDUP),
        "blocked": blocked,
        "blocked_ratio_by_method": {r["method"]: r["blocked_ratio"] for r in tr},
        "zero_copy_floor": floor,
    }


# -- text -------------------------------------------------------------------------------------------


def _f(x: float | None, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _x(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The summary table (Markdown): medians in seconds, ratios."""
    head = ("| size | K | method | all have it (s) | trainer blocked (s) | ÷ faster broadcast "
            "| others, no straggler (s) | others, straggler (s) | others × | trainer blocked, straggler (s) |")
    lines = [head, "|" + " --- |" * 10]
    for r in rows:
        lines.append(
            f"| {r['size_label']} | {r['k']} | {r['method']} | {_f(r['complete_s'])} | {_f(r['blocked_s'])} "
            f"| {_x(r['vs_best_broadcast'])} | {_f(r['others_s'])} | {_f(r['others_straggler_s'])} "
            f"| {_x(r.get('others_ratio'))} | {_f(r['blocked_straggler_s'])} |"
        )
    return "\n".join(lines)


def speedup_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| size | K | best transport | s | faster broadcast | s | speedup |", "|" + " --- |" * 7]
    for s in speedups(rows):
        lines.append(f"| {s['size_label']} | {s['k']} | {s['transport']} | {_f(s['transport_s'])} | {s['broadcast']} "
                     f"| {_f(s['broadcast_s'])} | {s['speedup']:.2f}× |")
    return "\n".join(lines)


def breakdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """Where transport's time goes: snapshot packing, data in the generators' slots, applied; the
    trainer's blocked time and its ratio to all applied; the memory-bandwidth floor and the ratio."""
    lines = [
        "| size | K | method | snapshot (s) | data in all slots (s) | all applied (s) | trainer blocked (s) "
        "| blocked ÷ applied | floor (s) | ÷ floor |",
        "|" + " --- |" * 10,
    ]
    for r in rows:
        if r.get("snapshot_s") is None:
            continue
        lines.append(
            f"| {r['size_label']} | {r['k']} | {r['method']} | {_f(r['snapshot_s'])} | {_f(r['data_complete_s'])} "
            f"| {_f(r['complete_s'])} | {_f(r['blocked_s'])} | {_x(r.get('blocked_ratio'))} "
            f"| {_f(r.get('floor_s'))} | {_x(r.get('vs_floor'))} |"
        )
    return "\n".join(lines)


def targets_text(t: dict[str, Any]) -> str:
    """The sync targets' lines (Target 1, 2a, 2b: speed-up, and a straggler's cost to the others)."""
    if not t.get("measured"):
        return f"Sync targets: not checked ({t.get('note')})."
    s = t["speedup"]
    lines = [
        "Sync targets:",
        (
            f"Target 1 ({t['size_label']}, K={t['k']}): {s['transport']} {s['transport_s']:.3f} s vs {s['broadcast']} "
            f"{s['broadcast_s']:.3f} s = {s['value']:.2f}× faster (target ≥ {s['target']:g}×): "
            f"{'HOLDS' if s['holds'] else 'MISSED'}"
        ),
    ]
    st = t.get("straggler")
    if st:
        ok = {True: "HOLDS", False: "MISSED"}
        tr = ", ".join(f"{m} {v['others_ratio']:.2f}×" for m, v in st["transport"].items())
        lines.append(
            f"Target 2a (one generator busy {st['delay_s']:g} s): the others' completion under transport, with / "
            f"without the straggler: {tr} (target ≤ {TARGET_OTHERS_RATIO:g}× for {st['best_transport']}): "
            f"{ok[st['transport_holds']]}"
        )
        bc = "; ".join(
            f"{m} +{v['others_delay_s']:.3f} s ({100 * v['others_delay_s'] / st['delay_s']:.0f}% of the delay; "
            f"they finish {v['others_straggler_s']:.3f} s after the start, "
            f"{'after' if v['others_wait_for_straggler'] else 'before'} the straggler wakes): {ok[v['holds']]}"
            for m, v in st["broadcast"].items()
        )
        lines.append(f"Target 2b: the others' completion under broadcast grows by at least the delay: {bc}")
    return "\n".join(lines)


def _verdict(holds: bool) -> str:
    return "HOLDS" if holds else "MISSED"


def mode_targets_text(t: dict[str, Any]) -> str:
    """The apply modes' target lines, from :func:`mode_targets`."""
    if not t.get("measured"):
        return f"Apply-mode targets: not checked ({t.get('note')})."
    lines = [f"Apply-mode targets ({t['size_label']}, K={t['k']}):"]
    for key, mode in (("copy_speedup", "copy mode"), ("zero_copy_speedup", "zero-copy")):
        s = t[key]
        if s is None:
            lines.append(f"- {mode} vs faster broadcast: not measured (the point lacks {mode} or a broadcast)")
            continue
        lines.append(f"- {mode} ({s['method']}) vs faster broadcast ({s['broadcast']}): {s['complete_s']:.3f} s vs "
                     f"{s['broadcast_s']:.3f} s = {s['value']:.2f}× (target ≥ {s['target']:g}×): "
                     f"{_verdict(s['holds'])}")
    for mode in ("copy", "zero-copy"):
        b = t["blocked"].get(mode)
        if b is None:
            lines.append(f"- trainer blocked ÷ all generators have it live, {mode}: not measured")
            continue
        lines.append(f"- trainer blocked ÷ all generators have it live, {mode} ({b['method']}): {b['blocked_s']:.3f} s "
                     f"÷ {b['complete_s']:.3f} s = {b['value']:.2f}× (target ≤ {b['target']:g}×): "
                     f"{_verdict(b['holds'])}")
    f = t["zero_copy_floor"]
    if f is None:
        lines.append(f"- zero-copy within {TARGET_FLOOR_RATIO:g}× of the floor: not measured")
    else:
        lines.append(f"- zero-copy within {f['target']:g}× of the floor ({f['method']}): {f['complete_s']:.3f} s ÷ "
                     f"floor {f['floor_s']:.3f} s (K={t['k']} × {f['model_bytes'] / GiB:.3f} GiB ÷ "
                     f"{f['memcpy_two_thread_gbps']:.2f} GB/s) = {f['value']:.2f}× (target ≤ {f['target']:g}×): "
                     f"{_verdict(f['holds'])}")
    return "\n".join(lines)


# -- plot -------------------------------------------------------------------------------------------


def plot(groups: Sequence[GroupResult], path: Path, title: str) -> Path | None:
    """Time vs size per method: one column per K; rows: no straggler (all generators have the
    version) and with a straggler (the other generators have it). Returns None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError:
        return None
    rows = summary_rows(groups)
    delay = max((g.straggler_delay for g in groups), default=0.0)
    ks = sorted({r["k"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    if not ks:
        return None
    fig, axes = plt.subplots(2, len(ks), figsize=(4.2 * len(ks) + 1.5, 7.5), squeeze=False, sharey=True)
    styles = {m: ("-" if is_transport(m) else "--", "o" if is_transport(m) else "s") for m in methods}
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    for j, k in enumerate(ks):
        panels = (("complete_s", "all generators have it"), ("others_straggler_s", "the others have it, one straggler"))
        for i, (key, what) in enumerate(panels):
            ax = axes[i][j]
            for m in methods:
                pts = sorted(
                    (r["size"] / GiB, r[key])
                    for r in rows
                    if r["k"] == k and r["method"] == m and r.get(key) is not None
                )
                if pts:
                    ls, mk = styles[m]
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle=ls, marker=mk, color=colors[m], label=m)
            ax.set_title(f"K = {k}: {what}", fontsize=10)
            ax.grid(alpha=0.3, which="both")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            sizes = sorted({r["size"] for r in rows})
            ax.set_xlim(sizes[0] / GiB / 1.4, sizes[-1] / GiB * 1.4)
            ax.set_xticks([x / GiB for x in sizes], [size_label(x) for x in sizes])
            ax.xaxis.set_minor_locator(ticker.NullLocator())
            ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _pos: f"{v:g}"))
            ax.yaxis.set_minor_formatter(ticker.NullFormatter())
            if i == 1:
                ax.set_xlabel("state dict size (bf16)")
            if j == 0:
                ax.set_ylabel("seconds (median)")
            if i == 1 and ax.lines and delay > 0:
                ax.axhline(delay, color="gray", linestyle=":", linewidth=1)
                ax.text(sizes[0] / GiB / 1.35, delay * 1.05, f"straggler busy {delay:g} s", color="gray", fontsize=8)
            if not ax.lines:
                ax.text(0.5, 0.5, "n/a (needs K ≥ 2)", ha="center", va="center", transform=ax.transAxes, color="gray")
    handles, labels = [], []
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
