"""Smoke test of the fan-out benchmark (``python -m benchmarks.fanout``).

A short real run in network namespaces (an 8 MB state, one version, two generators per host, every link shaped)
of the methods this library has: direct pushes, gloo broadcast and the floor. It checks that the
entry point works end to end, that every generator of both hosts had each timed version live
and whole (no torn tensor), that the generators ran on two distinct hosts, and that the printed
table and the JSON are well formed. No timing is asserted. Needs root (ip netns).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests._support import PYTHON, ROOT, python_env
from tests._support.netns import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

METHODS = ("direct", "gloo", "floor")
GENERATORS = [f"gen-{h}{i}" for h in "ab" for i in range(2)]  # --per-host 2: fewer processes, a shorter test


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
