"""Smoke test of the colocated weight-sync benchmark (``python -m benchmarks.colocated``).

A real run on the CPU (``--device cpu``: a trainer and two generator processes, the small model,
slots in host memory, two timed versions after one) checks that the entry point works end to
end and that its JSON holds every method and baseline with positive, finite figures, weights
verified after every method, and a straggler that was stopped and caught up; the model shapes
and the automatic choice of model are checked against known figures. Without a GPU the default
device exits with status 2. No timing is asserted.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.colocated import _models
from benchmarks.common.sizes import GiB
from tests._support import PYTHON, ROOT, python_env

METHODS = ("transport/copy", "transport/zero-copy")


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_real_model_shapes() -> None:
    eight = _models.describe("llama3-8b")
    assert eight["params"] == 8_030_261_248 and eight["tensors"] == 291  # Meta-Llama-3-8B
    three = _models.describe("llama3.2-3b")
    assert three["params"] == 3_212_749_824 and three["tied_embeddings"]  # Llama-3.2-3B, no lm_head
    names = dict(_models.shapes("llama3.2-3b"))
    assert "lm_head.weight" not in names and names["model.layers.0.self_attn.k_proj.weight"] == (1024, 3072)
    state = _models.build_state(_models.SMALL, torch.device("cpu"), seed=0)
    assert [(n, tuple(t.shape)) for n, t in state.items()] == _models.shapes(_models.SMALL)
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    sums = _models.tensor_sums(state)
    _models.advance(state, 3)
    assert all(a != b for a, b in zip(sums, _models.tensor_sums(state), strict=True))  # every tensor changed


def test_auto_takes_the_largest_model_that_fits() -> None:
    host = 1 << 40

    def auto(free_gpu: int, **kw: Any) -> str:
        return _models.choose("auto", 2, "cuda", free_gpu, host, **kw)[0]

    need8 = _models.need("llama3-8b", 2, "cuda").gpu
    need3 = _models.need("llama3.2-3b", 2, "cuda").gpu
    assert need3 < need8 < 139 * GiB  # an H200 takes the 8B model with K = 2
    assert auto(need8) == "llama3-8b"
    assert auto(need8 - 1) == "llama3.2-3b" == auto(need8, largest="llama3.2-3b")
    assert auto(need3 - 1) == _models.SMALL
    assert _models.choose("auto", 2, "cpu", 0, host)[0] == _models.SMALL
    assert _models.choose("llama3-8b", 2, "cuda", 0, 0)[0] == "llama3-8b"  # as asked


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without a GPU")
def test_without_a_gpu_the_default_device_exits_2() -> None:
    proc = subprocess.run([PYTHON, "-m", "benchmarks.colocated"], cwd=ROOT, env=python_env(), capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "needs a CUDA GPU" in proc.stderr and "--device cpu" in proc.stderr


def test_smoke_run_on_the_cpu_writes_the_documented_json(tmp_path: Path) -> None:
    out, md = tmp_path / "colocated.json", tmp_path / "colocated.md"
    cmd = [PYTHON, "-m", "benchmarks.colocated", "--device", "cpu", "--versions", "2", "--warmup", "1",
           "--stop-s", "0.2", "--floor-iters", "3", "--timeout", "60", "--run-timeout", "150",
           "--json", str(out), "--markdown", str(md), "--tmp", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=ROOT, env=python_env(), capture_output=True, text=True, timeout=200, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "colocated" and doc["error"] is None
    assert doc["date"] and doc["torch"] == torch.__version__ and doc["config"]["model"]["name"] == _models.SMALL
    assert doc["verified"] is True and doc["problems"] == []

    for name in METHODS:
        m = doc["methods"][name]
        assert m["verified"] is True and m["problems"] == []
        assert _positive(m["live_s"]) and _positive(m["blocked_s"]) and len(m["live_s_all"]) == 2
        assert set(m["per_generator_live_s"]) == {"gen-0", "gen-1"}
        for v in m["versions"]:
            assert set(v["status"].values()) == {"done"} and all(_positive(s) for s in v["live_s"].values())
        r = doc["ratios"][name]
        assert _positive(r["live_over_floor"]) and _positive(r["handles_over_live"])
    handles = doc["baselines"]["ipc_handles"]
    assert handles["verified"] is True and _positive(handles["live_s"]) and _positive(handles["blocked_s"])
    floor = doc["baselines"]["floor"]
    assert _positive(floor["seconds"]) and _positive(floor["gbps"]) and floor["copies"] == 2
    targets = {(t["method"], t["target"]) for t in doc["targets"]}
    assert {m for m, _ in targets} == set(METHODS) and len(targets) == 4
    assert all(isinstance(t["met"], bool) and _positive(t["ratio"]) for t in doc["targets"])

    s = doc["straggler"]  # stopped during a version, continued, caught up; the others were served
    assert s["stopped"] == "gen-1" and s["stopped_via"] in ("slot", "pull") and isinstance(s["stalled"], bool)
    assert _positive(s["others_live_s"]) and _positive(s["stopped_live_after_cont_s"])
    assert _positive(s["next_version_live_s"]) and set(s["next_version_status"].values()) == {"done"}

    text = md.read_text()
    assert "| method | live | ÷ floor |" in text and "Straggler" in text and "Targets" in text
    assert text.strip() in proc.stdout
