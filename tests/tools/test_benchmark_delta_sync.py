"""Smoke test of the delta-sync benchmark (``python -m benchmarks.delta_sync``).

A tiny real run (the mesh example's Llama model shrunk to 2 layers of width 64, one AdamW step per
learning rate, two subscriber processes, over ipc and tcp, a 1% and a 90% forced density) checks
that the entry point works end to end, that every version reached both subscribers on every stream
(three of each kind: a row gives each kind's median publish; before them, the version's first
publish, forced dense, which no row compares), and the byte accounting the README
quotes: the dense stream always moves the whole version, a delta moves at most 2·f of it plus its
header, and a version above the crossover (the 90% one) goes dense on its own; and the physical
references are there for every density, and each reported version carries its own memcpy
baseline and the median of its repeats' diffs. No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests._support import PYTHON, ROOT, python_env
from transport.weights._codec.encode import ALIGN
from transport.weights._codec.format import ENTRY_WORDS, HEADER_WORDS
from transport.weights._codec.policy import CROSSOVER

KINDS = ["delta", "dense", "again"]


def test_smoke_run_writes_the_documented_json(tmp_path: Path) -> None:
    out = tmp_path / "delta.json"
    # The crossover is given: chosen from what it measures, a model this small goes dense (the
    # diff's fixed costs outweigh the bytes a delta saves), and this checks a delta's bytes.
    cmd = [PYTHON, "-m", "benchmarks.delta_sync", "--short", "--steps", "1", "--backends", "ipc", "tcp",
           "--sweep", "0.01", "0.9", "--window", "3", "--crossover", str(CROSSOVER), "--json", str(out),
           "--tmp", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=ROOT, env=python_env(), capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "delta_sync" and set(doc["summary"]) == {"ipc", "tcp"}
    assert all(v > 0 for v in doc["memcpy_gbps"].values())
    # The physical references: a read of both versions, a copy, and a bare scatter at every
    # density a version had (the markdown's floor column).
    refs = doc["references"]
    assert refs["read_both_s"] > 0 and refs["copy_s"] > 0
    densities = {f"{row['changed_fraction']:.6f}" for run in doc["runs"] for row in run["steps"][1:] + run["sweep"]}
    assert set(refs["scatter_s"]) == densities and all(t > 0 for t in refs["scatter_s"].values())
    for run in doc["runs"]:
        dense = run["dense_bytes"]
        tensors = sum(run["steps"][1]["kinds"].values())
        header = 8 * (HEADER_WORDS + ENTRY_WORDS * tensors)
        assert [r["lr"] for r in run["steps"]] == [None, 1e-6, 1e-5]
        for row in run["steps"] + run["sweep"]:
            # forced dense, the same publish again (the noise), and the version's first publish
            for stream in ("dense", "again", "first"):
                assert row[stream]["wire_bytes"] == dense and row[stream]["as_delta"] == [False, False]
            assert all(s > 0 for s in row["dense"]["apply_s"] + row["delta"]["apply_s"]  # both applied it
                       + row["first"]["apply_s"])
            for kind in KINDS:  # three streams of each kind: the row is the median's
                assert len(row[kind]["repeats"]) == 3 and row[kind]["live_s"] == sorted(row[kind]["repeats"])[1]
            # Interleaved: each repeat in the version's order, which rotates from one to the next.
            k = KINDS.index(row["order"][0])
            assert row["order"] == [kind + rep for rep in ("", ".1", ".2") for kind in KINDS[k:] + KINDS[:k]], row
        for row in run["steps"][1:] + run["sweep"]:
            f, d = row["changed_fraction"], row["delta"]
            if d["as_delta"] == [True, True]:
                assert 0 < f < 2 * CROSSOVER and d["wire_bytes"] < dense // 4
                if "dense" not in row["kinds"]:  # all sparse: at most 2·f of dense, plus header and padding
                    assert d["wire_bytes"] <= 2 * f * dense + header + ALIGN * tensors
            else:  # above the crossover: the whole version, as on the dense stream
                assert d["as_delta"] == [False, False] and d["wire_bytes"] == dense and f > CROSSOVER / 2
        assert {row["order"][0] for row in run["steps"] + run["sweep"]} == set(KINDS)  # each kind goes first
        # Each reported version's own memcpy baseline, and its diff the median of the delta repeats'.
        ratios, warm = [], []
        for row in run["steps"][1:] + run["sweep"] + run["windows"]:
            assert row["memcpy_gbps"] > 0 and row["memcpy_warm_gbps"] > 0
            if row.get("diff_gbps"):
                diffs = row["diff_repeats_s"]
                assert len(diffs) == 3 and row["diff_encode_s"] == sorted(diffs)[1]
                assert abs(row["diff_gbps"] - row["dense_bytes"] / row["diff_encode_s"] / 1e9) < 1e-9
                if row in run["steps"]:
                    ratios.append(row["diff_gbps"] / row["memcpy_gbps"])
                    warm.append(row["diff_gbps"] / row["memcpy_warm_gbps"])
        every = doc["summary"][run["backend"]]["every step"]
        assert ratios and every["diff_over_memcpy_min"] == min(ratios)
        assert every["diff_over_warm_memcpy_min"] == min(warm)
        assert run["refused"] == every["refused_deltas"] == 0  # every delta sent was applied
        # The smallest learning rate and the 1% sweep go as deltas.
        assert run["steps"][1]["delta"]["as_delta"] == [True, True] == run["sweep"][0]["delta"]["as_delta"]
        # The skipped-versions case: three steps as one version, against the base both hold.
        (window,) = run["windows"]
        assert window["steps"] == 3 and 0 < window["changed_fraction"] <= 1
        assert window["dense"]["wire_bytes"] == dense and all(s > 0 for s in window["delta"]["apply_s"])
        hot = run["sweep"][1]  # 90%: dense without a full diff
        assert hot["changed_fraction"] > 0.8 and hot["delta"]["as_delta"] == [False, False]
        assert hot["delta"]["wire_bytes"] == dense
        # The targets' verdict, from this run's rows (no figure is asserted: only that it is judged
        # from them), and printed for each backend.
        t = doc["summary"][run["backend"]]["targets"]
        ratios = {r["version"]: r["delta"]["live_s"] / r["dense"]["live_s"] for r in run["steps"][1:]}
        assert t["every_step_max"] == max(ratios.values()) and t["every_step_met"] == (max(ratios.values()) <= 1.05)
        if run["backend"] == "ipc":
            assert not any(k.startswith(("network", "diff")) for k in t)
        else:
            assert t["network_lr"] == 1e-6 and t["diff_min"] == every["diff_over_memcpy_min"]
            assert t["network_max"] == max(ratios[r["version"]] for r in run["steps"][1:] if r["lr"] == 1e-6)
        assert t["met"] == all(v for k, v in t.items() if k.endswith("_met"))
        assert f"[{run['backend']}] targets {'met' if t['met'] else 'not met'}: every step <= 1.05x" in proc.stdout


def test_targets_judge_every_line_from_the_rows() -> None:
    """``targets`` on rows made up for it: one line missed is enough, over a network all three
    lines count, over ipc only the first, and a line without a figure (no diff ran) is missed."""
    from benchmarks.delta_sync._run import summarize, targets_line

    def row(lr: float | None, ratio: float, diff_over_memcpy: float | None) -> dict[str, object]:
        side = {"live_s": 1.0, "wire_bytes": 100, "as_delta": [False, False], "apply_s": [0.1, 0.1]}
        return {"lr": lr, "version": 0, "changed_fraction": 0.02, "delta": {**side, "live_s": ratio},
                "dense": side, "again": side, "memcpy_gbps": 10.0, "memcpy_warm_gbps": 10.0,
                "diff_gbps": None if diff_over_memcpy is None else 10.0 * diff_over_memcpy}

    def verdict(backend: str, rows: list[dict[str, object]]) -> dict[str, object]:
        run = {"backend": backend, "steps": [row(None, 1.0, None), *rows], "sweep": []}
        t = summarize(run, 10.0)["targets"]
        assert targets_line(t).startswith("met: " if t["met"] else "not met: ")
        return t

    fast = [row(1e-6, 0.15, 0.6), row(1e-6, 0.19, 0.7), row(1e-5, 0.5, 0.55), row(1e-5, 1.0, None)]
    assert verdict("tcp", fast)["met"]
    slow_step = verdict("tcp", [*fast[:-1], row(1e-5, 1.06, None)])
    assert not slow_step["met"] and not slow_step["every_step_met"] and slow_step["network_met"]
    assert not verdict("tcp", [row(1e-6, 0.21, 0.6), *fast[1:]])["network_met"]  # lr 1e-6 above 0.2x
    slow_diff = verdict("tcp", [*fast[:2], row(1e-5, 0.5, 0.45), fast[3]])
    assert not slow_diff["met"] and not slow_diff["diff_met"] and slow_diff["network_met"]
    assert not verdict("tcp", [row(1e-6, 0.15, None)])["diff_met"]  # no diff: no figure, not met
    # Over a same-host link only "never slower than dense" counts (no delta is diffed there).
    ipc = verdict("ipc", [row(1e-6, 1.04, None), row(1e-5, 0.98, None)])
    assert ipc["met"] and set(ipc) == {"every_step_max", "every_step_met", "met"}
    assert not verdict("ipc", [row(1e-6, 1.051, None)])["met"]
