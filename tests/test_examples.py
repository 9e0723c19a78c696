"""The RLHF weight-sync example, end to end, as real processes (and Ray actors)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .conftest import PYTHON, ROOT, python_env


def run_example(tmp_path: Path, *args: str, timeout: float = 400) -> tuple[str, list[dict], dict]:
    out = tmp_path / "run"
    proc = subprocess.run(
        [PYTHON, "-m", "examples.rlhf_sync", "--out", str(out), "--backends", "ipc,tcp", *args],
        cwd=ROOT, env=python_env(), capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    history = json.loads((out / "trainer.json").read_text())["history"]
    summary = json.loads((out / "summary.json").read_text())
    assert (out / "sync.png").stat().st_size > 10_000
    return proc.stdout, history, summary


def test_trains_and_syncs_every_step(tmp_path):
    stdout, history, summary = run_example(tmp_path, "--steps", "100")
    assert [r["step"] for r in history] == list(range(1, 101))
    for r in history:
        assert set(r["sync_status"]) == {"gen-0", "gen-1"} and set(r["sync_status"].values()) == {"done"}, r
        assert r["staleness_max"] >= 0 and all(0 <= v < r["step"] for v in r["batches"].values())
    # The policy learns: sorting reward rises well above chance (0.1) as weights flow.
    assert summary["reward_gain"] > 0.05, summary
    assert "reward" in stdout and "sync:" in stdout


def test_slow_generator_does_not_slow_the_others(tmp_path):
    _, history, summary = run_example(tmp_path, "--steps", "40", "--slow-generator", "gen-1", "--slow-seconds", "0.3")
    assert all(r["sync_status"]["gen-0"] == "done" for r in history)
    # The slow one still receives every version (one-sided ipc puts need nothing from it) ...
    assert summary["sync"]["gen-1"]["done"] == 40
    # ... but contributes fewer rollouts: the trainer never waits for it.
    used = [g for r in history for g in r["batches"]]
    assert used.count("gen-0") > used.count("gen-1")


def test_kill_and_replace_a_generator(tmp_path):
    stdout, history, _ = run_example(tmp_path, "--steps", "250", "--generators", "3", "--kill-at", "15")
    assert "killed gen-2" in stdout
    assert len(history) == 250
    after = [r for r in history if r["step"] > 16]
    assert any("gen-2" not in r["sync_status"] or r["sync_status"]["gen-2"] != "done" for r in after), "the kill was not seen"
    assert any(r["sync_status"].get("gen-2") == "done" and "gen-2" in r["batches"] for r in after[-50:]), "the replacement never rejoined"
    assert all(r["sync_status"]["gen-0"] == "done" and r["sync_status"]["gen-1"] == "done" for r in history)


def test_ray_launcher(tmp_path):
    pytest.importorskip("ray", reason="Ray is installed by scripts/test.sh (extra 'ray')")
    stdout, history, _ = run_example(tmp_path, "--steps", "30", "--launcher", "ray")
    assert len(history) == 30 and all(set(r["sync_status"].values()) == {"done"} for r in history)
    assert "(ray)" in stdout
