"""Smoke test of the fan-out benchmark (``python -m benchmarks.fanout``).

A short real run in network namespaces (an 8 MB state, one version, two generators per host, every link shaped)
of the methods this library has: direct pushes, gloo broadcast and the floor. It checks that the
entry point works end to end, that every generator of both hosts had each timed version live
and whole (no torn tensor), that the generators ran on two distinct hosts, and that the printed
table and the JSON are well formed. No timing is asserted. Needs root (ip netns).

The mesh methods start eight processes each (some 15 s at this size on two cores), so they are
not in the run; their layouts and their figures are checked without processes.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests._support import PYTHON, ROOT, python_env
from tests._support.netns import unavailable_reason

needs_netns = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

METHODS = ("direct", "gloo", "floor")
GENERATORS = [f"gen-{h}{i}" for h in "ab" for i in range(2)]  # --per-host 2: fewer processes, a shorter test


@needs_netns
def test_short_run_every_subscriber_live(tmp_path: Path) -> None:
    out = tmp_path / "fanout.json"
    md = tmp_path / "fanout.md"
    cmd = [PYTHON, "-m", "benchmarks.fanout", "--size", "8MB", "--reps", "1", "--warmup", "0", "--per-host", "2",
           "--methods", ",".join(METHODS), "--timeout", "40", "--run-timeout", "50", "--json", str(out),
           "--markdown", str(md), "--tmp", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=python_env(), capture_output=True, text=True, timeout=150, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "fanout" and doc["args"]["methods"] == list(METHODS)
    assert doc["refs"]["one_link"]["median_bytes_per_s"] > 0
    assert 0 < doc["floor"]["rate_s"] and 0 < doc["floor"]["stream_s"]
    assert set(doc["methods"]) == {"direct", "gloo"}  # floor is computed, not run
    for name, r in doc["methods"].items():
        assert "error" not in r, (name, r.get("error"))
        assert r["missing"] == [] and r["torn_tensors"] == 0, name
        assert set(r["per_sub"]) == set(GENERATORS), name
        assert all(len(v) == 1 and v[0] > 0 for v in r["per_sub"].values()), (name, r["per_sub"])
        assert len(r["times_s"]) == 1 and r["median_s"] == max(v[0] for v in r["per_sub"].values())
    direct = doc["methods"]["direct"]
    assert len(direct["hostnames"]) == 2  # host A's and host B's generators: two hosts
    assert all(res["status"] == "done" for res in direct["results"][0].values()), direct["results"]
    assert set(direct["results"][0]) == set(GENERATORS)
    # The printed table: one row per method, then the targets.
    rows = [line.split("|")[1].strip() for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["floor", "direct", "gloo"], proc.stdout
    assert "Targets (issue):" in proc.stdout and md.read_text().startswith("# Fan-out")


def test_mesh_layouts_give_every_replica_half_the_state_from_each_trainer_rank() -> None:
    import torch

    from benchmarks.fanout._mesh_roles import (
        box_starts,
        generator_layout,
        stamp_boxes,
        stamp_mismatches,
        trainer_layout,
    )
    from benchmarks.weight_sync._models import llama_like, make_state
    from transport.plan import Planner, Replica

    config = llama_like(2 << 20)
    shapes = config.shapes()
    layout = trainer_layout(shapes, 2)
    rank = Planner(layout).plan_replica(Replica("r", (generator_layout(shapes),)), None).ranks[0]
    by_source = {src: sum(m.nbytes for m in rank.moves if m.src == src) for src in (0, 1)}
    assert by_source == {0: config.nbytes // 2, 1: config.nbytes // 2}
    # Each trainer rank's part of every tensor carries the stamp: a version missing one rank's bytes shows.
    starts = box_starts(layout)
    assert all(len(points) == 2 for points in starts.values())
    state = make_state(config, seed=0)
    stamp_boxes(state, starts, 7)
    assert stamp_mismatches(state, starts, 7) == 0
    name = next(iter(shapes))
    state[name][starts[name][1]] = torch.tensor(6.0, dtype=state[name].dtype)
    assert stamp_mismatches(state, starts, 7) == 1


def test_mesh_figures_time_the_last_replica_and_flag_a_wrong_digest() -> None:
    from benchmarks.fanout import _report

    names = {"A": ["gen-a0", "gen-a1"], "B": ["gen-b0"]}
    done = {"status": "done", "seconds": 1.0, "nbytes": 1, "error": None}

    def trainer(rank: int) -> dict:
        rows = [{"version": v, "t0": 10.0 * v + rank * 0.01, "publish_end": 10.0 * v + 2.0, "digest": f"d{v}",
                 "results": {"gen-a0/0": {**done, "relayed_by": None},
                             "gen-a1/0": {**done, "relayed_by": "gen-a0"},
                             "gen-b0/0": {**done, "relayed_by": None}}} for v in (1, 2, 3)]
        return {"rank": rank, "versions": rows, "publisher_kwargs": {"delta": False, "relays": True},
                "relay_events": [{"event": "relay"}]}

    def gen(late: float, digest: str = "") -> dict:
        return {"lives": [{"version": v, "at": 10.0 * v + 2.5 + late, "torn_tensors": 0,
                           "digest": digest if v == 3 and digest else f"d{v}"} for v in (1, 2, 3)],
                "commit": {"calls": 3, "seconds": 0.1}, "poll_s": 0.1}

    gens = {"gen-a0": gen(0.0), "gen-a1": gen(0.5), "gen-b0": gen(0.1, digest="other")}
    r = _report.mesh_rows([trainer(0), trainer(1)], gens, names, warmup=1)
    assert r["times_s"] == pytest.approx([3.0, 3.0]) and r["median_s"] == pytest.approx(3.0)
    assert r["published"]["median_s"] == pytest.approx(2.0) and r["after_publish"]["median_s"] == pytest.approx(1.0)
    assert r["wrong"] == ["gen-b0@v3"] and r["digests_checked"] == 9 and r["not_done"] == [] and r["missing"] == []
    assert r["relayed_by"][0] == {"gen-a0": None, "gen-a1": "gen-a0", "gen-b0": None}
    direct = {**r, "median_s": 6.0, "wrong": []}
    result = {"methods": {"mesh-direct": {**direct, "nic_bytes": {}}, "mesh-relays": {**r, "nic_bytes": {}}},
              "floor": {"rate_s": 1.5, "stream_s": 1.6},
              "args": {"state_bytes": 10**8, "rate_mbit": 1000.0, "methods": ["floor", "mesh-direct", "mesh-relays"]},
              "summary": {"targets": []}}
    text = _report.table(result)
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| mesh")}
    assert " 2.00 |" in rows["mesh-relays"] and "WRONG gen-b0@v3" in rows["mesh-relays"]  # x floor, the digest
    assert "mesh-direct / mesh-relays: 2.00" in text
