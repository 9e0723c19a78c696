"""Smoke test of the weight-sync benchmark (``python -m benchmarks.weight_sync``).

A tiny real run (a 2 MiB Llama-shaped state dict, K = 1 and 2, every method: transport over ipc
and tcp with copying and zero-copy apply, per-parameter and bucketed broadcast) checks that the
entry point works end to end and that its JSON has the documented structure with positive
numbers and bit-for-bit verified weights, and that the derived numbers agree with the measured
ones: the memory-bandwidth floor (K × model bytes ÷ the same run's 2-thread memcpy rate), each
method's time over it, the trainer's blocked share, and the apply-mode targets computed from them.
No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from benchmarks.common.capabilities import available_backends
from benchmarks.common.sizes import parse_size
from benchmarks.weight_sync import _report
from benchmarks.weight_sync._broadcast import plan_buckets
from benchmarks.weight_sync._models import checksum, llama_like, make_state, stamp, stamp_mismatches
from benchmarks.weight_sync._roles import schedule
from tests._support import PYTHON, ROOT, python_env

_AVAILABILITY = available_backends()
BACKENDS = [b for b in ("ipc", "tcp") if _AVAILABILITY.get(b, "unknown backend") is None]
BASELINES = ["broadcast/param", "broadcast/bucketed"]


def test_llama_like_hits_the_size_with_llama_names() -> None:
    for target in (16 << 20, 256 << 20, 1 << 30):
        c = llama_like(target)
        assert abs(c.nbytes - target) / target < 0.02
        shapes = c.shapes()
        assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                "model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight"} <= set(shapes)
        assert len(shapes) == 9 * c.layers + 3
        assert shapes["model.layers.0.self_attn.k_proj.weight"][0] < shapes["model.layers.0.self_attn.q_proj.weight"][0]


def test_state_stamps_and_checksum() -> None:
    state = make_state(llama_like(2 << 20), seed=0)
    stamp(state, 7)
    assert stamp_mismatches(state, 7) == 0 and stamp_mismatches(state, 8) == len(state)
    copy = {k: v.clone() for k, v in state.items()}
    assert checksum(copy) == checksum(state)
    next(iter(copy.values())).view(-1)[-1] += 1
    assert checksum(copy) != checksum(state)


def test_buckets_schedule_and_sizes() -> None:
    state = make_state(llama_like(2 << 20), seed=None)
    tensors = list(state.values())
    buckets = plan_buckets(tensors, 64 << 10)
    assert sorted(s.index for b in buckets for s in b.slices) == list(range(len(tensors)))
    assert all(b.nbytes <= 64 << 10 or len(b.slices) == 1 for b in buckets)
    steps = schedule(2, 3, 1)
    assert [s.version for s in steps] == [1, 2, 3, 4, 5, 6]
    assert [s.warmup for s in steps] == [True, True, False, False, False, False]
    assert [s.straggle for s in steps] == [False] * 5 + [True]
    assert parse_size("256MiB") == 256 << 20 and parse_size("0.25G") == 1 << 28 and parse_size("1GB") == 1 << 30


@pytest.mark.skipif(not BACKENDS, reason="neither ipc nor tcp can run here")
def test_smoke_run_writes_the_documented_json(tmp_path: Path) -> None:
    out = tmp_path / "ws.json"
    md = tmp_path / "ws.md"
    cmd = [PYTHON, "-m", "benchmarks.weight_sync", "--sizes", "2MiB", "--ks", "1,2", "--backends", ",".join(BACKENDS),
           "--versions", "2", "--warmup", "1", "--straggler-versions", "1", "--straggler-delay", "0.2",
           "--memcpy-mib", "16", "--memcpy-repetitions", "3",
           "--timeout", "60", "--group-timeout", "200", "--json", str(out), "--markdown", str(md), "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, env=python_env(), capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| size | K | method |" in proc.stdout
    assert "| blocked ÷ applied | floor (s) | ÷ floor |" in proc.stdout
    assert "1 thread" in proc.stdout and "2 threads (each copies half)" in proc.stdout
    assert "Apply-mode targets: not checked" in proc.stdout and "Sync targets: not checked" in proc.stdout

    doc = json.loads(out.read_text())
    assert {"benchmark", "date", "command", "machine", "config", "summary", "groups"} <= set(doc)
    assert doc["machine"]["nproc"] >= 1
    methods = [f"transport/{b}" for b in BACKENDS] + [f"transport/{b}/zero-copy" for b in BACKENDS] + BASELINES
    assert doc["config"]["methods"] == methods
    assert doc["config"]["memcpy_bytes"] == 16 << 20 and doc["config"]["memcpy_repetitions"] == 3
    mc = doc["summary"]["memcpy"]
    assert mc["buffer_bytes"] == 16 << 20 and mc["repetitions"] == 3 and mc["copier"]
    for threads in ("one", "two"):
        assert mc[f"{threads}_thread_s"] > 0
        assert mc[f"{threads}_thread_gbps"] == pytest.approx(mc["buffer_bytes"] / mc[f"{threads}_thread_s"] / 1e9)
    rate = mc["two_thread_gbps"] * 1e9  # bytes/s
    model_bytes = {g["k"]: g["model"]["nbytes"] for g in doc["groups"]}
    assert [(g["k"], g["skipped"]) for g in doc["groups"]] == [(1, None), (2, None)]
    for g in doc["groups"]:
        gens = [f"gen-{i}" for i in range(g["k"])]
        assert g["verified"] == dict.fromkeys(methods, True)
        assert set(g["peak_rss_gib"]) == {"trainer", *gens}
        for m in methods:
            phases = g["versions"][m]
            assert len(phases["normal"]) == 3  # 1 warm-up + 2 timed
            assert ("straggler" in phases) == (g["k"] == 2)
            for recs in phases.values():
                for r in recs:
                    assert r["blocked_s"] > 0 and r["mismatched_tensors"] == 0
                    assert set(r["completion_s"]) == set(gens) and all(v > 0 for v in r["completion_s"].values())
                    if m.startswith("transport/"):
                        assert set(r["status"].values()) == {"done"} and r["snapshot_s"] > 0
                        assert all(v > 0 for v in r["data_complete_s"].values())
            med = g["medians"][m]["normal"]
            assert med["versions"] == 2 and med["complete_s"] > 0 and med["blocked_s"] > 0

    rows = doc["summary"]["rows"]
    assert {(r["k"], r["method"]) for r in rows} == {(k, m) for k in (1, 2) for m in methods}
    for r in rows:
        assert r["complete_s"] > 0 and r["blocked_s"] > 0 and r["vs_best_broadcast"] > 0 and r["verified"]
        assert r["model_bytes"] == model_bytes[r["k"]]
        assert r["floor_s"] == pytest.approx(r["k"] * r["model_bytes"] / rate, rel=1e-9)
        assert r["vs_floor"] == pytest.approx(r["complete_s"] / r["floor_s"], rel=1e-9)
        assert r["blocked_ratio"] == pytest.approx(r["blocked_s"] / r["complete_s"], rel=1e-9)
        if r["k"] == 2:
            assert r["others_s"] > 0 and r["others_straggler_s"] > 0 and r["others_ratio"] > 0
            assert r["straggler_s"] > 0  # the straggler itself got every version
    assert {(s["k"], s["size"]) for s in doc["summary"]["speedups"]} == {(1, 2 << 20), (2, 2 << 20)}
    assert all(s["speedup"] > 0 for s in doc["summary"]["speedups"])
    assert doc["summary"]["targets"]["measured"] is False  # no 1 GiB point in a smoke run
    assert doc["summary"]["mode_targets"]["measured"] is False
    text = md.read_text()
    assert "Machine:" in text and "Command:" in text and "| size | K | method |" in text
    assert "÷ floor" in text and f"{mc['two_thread_gbps']:.2f} GB/s" in text and "Apply-mode targets" in text
    _check_mode_targets(rows, mc["two_thread_gbps"])


def _check_mode_targets(rows: list[dict[str, Any]], gbps: float) -> None:
    """The apply-mode targets computed on the smoke run's (2 MiB, K = 2) point: each mode's best backend,
    its ratios taken from the rows, each verdict consistent with its value and target."""
    t = _report.mode_targets(rows, gbps, size=2 << 20, k=2)
    assert t["measured"] is True
    here = [r for r in rows if r["k"] == 2]
    bcast = min((r for r in here if not r["method"].startswith("transport/")), key=lambda r: r["complete_s"])
    best = {mode: min((r for r in here if r["method"].startswith("transport/")
                       and r["method"].endswith("/zero-copy") == (mode == "zero-copy")), key=lambda r: r["complete_s"])
            for mode in ("copy", "zero-copy")}
    for key, mode, target in (("copy_speedup", "copy", 2.0), ("zero_copy_speedup", "zero-copy", 3.5)):
        s = t[key]
        assert (s["method"], s["broadcast"], s["target"]) == (best[mode]["method"], bcast["method"], target)
        assert s["value"] == pytest.approx(bcast["complete_s"] / best[mode]["complete_s"])
        assert s["holds"] == (s["value"] >= target)
    for mode in ("copy", "zero-copy"):
        b = t["blocked"][mode]
        assert b["method"] == best[mode]["method"] and b["value"] == best[mode]["blocked_ratio"]
        assert b["holds"] == (b["value"] <= 1.1)
    assert t["blocked_ratio_by_method"] == {r["method"]: r["blocked_ratio"] for r in here
                                            if r["method"].startswith("transport/")}
    f = t["zero_copy_floor"]
    assert f["method"] == best["zero-copy"]["method"] and f["memcpy_two_thread_gbps"] == gbps
    assert f["value"] == pytest.approx(f["complete_s"] / f["floor_s"]) and f["holds"] == (f["value"] <= 1.3)
    lines = _report.mode_targets_text(t).splitlines()
    assert lines[0] == "Apply-mode targets (2 MiB, K=2):" and len(lines) == 6
    assert all(line.endswith((": HOLDS", ": MISSED")) for line in lines[1:])
