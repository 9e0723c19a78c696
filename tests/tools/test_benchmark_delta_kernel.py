"""Smoke test of the diff-kernel benchmark (``python -m benchmarks.delta_kernel``).

A tiny real run (4 MB, one density, the scalar path and the best this CPU has) checks that the
entry point works end to end and that its JSON holds, for each path, the kernel's time on one
thread and on all, and the same run's memcpy and read of both versions, with the ratio the
delta_sync benchmark's diff target is stated in. No timing is asserted.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

from tests._support import PYTHON, ROOT, python_env
from transport.weights import delta_isa


def test_smoke_run_writes_every_path_against_the_same_run_baselines(tmp_path: Path) -> None:
    out = tmp_path / "kernel.json"
    isas = ["scalar", delta_isa()] if delta_isa() != "scalar" else ["scalar"]
    cmd = [PYTHON, "-m", "benchmarks.delta_kernel", "--mb", "4", "--densities", "0.02", "--repeats", "2",
           "--isas", *isas, "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=python_env(), capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "delta_kernel" and doc["mb"] == 4 and doc["machine"]["diff_isa"] == delta_isa()
    assert [(r["density"], r["isa"]) for r in doc["rows"]] == [(0.02, isa) for isa in isas]
    for row in doc["rows"]:
        assert "error" not in row, row
        for key in ("one_thread_s", "threads_s", "memcpy_s", "read_both_s"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert math.isclose(row["diff_over_memcpy"], row["memcpy_s"] / row["threads_s"])
        assert math.isclose(row["scaling"], row["one_thread_s"] / row["threads_s"])
        assert f"{row['isa']}: diff" in proc.stdout
