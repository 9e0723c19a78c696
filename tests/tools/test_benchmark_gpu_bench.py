"""The GPU micro-benchmark (benchmarks/gpu_bench) on a machine without a GPU: it refuses with
exit status 2 and the reason, and its report holds every target of the GPU data path with the
verdict the figures give (the report runs at the end of the GPU check, where a crash would lose
the run's figures)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from benchmarks.gpu_bench._report import BATCH_TARGET_PER_S, RATIO_TARGETS, Report, Row, format_markdown
from tests._support import PYTHON, ROOT, python_env

MiB, GiB = 1 << 20, 1 << 30


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal; this machine has a GPU")
def test_without_a_gpu_it_exits_2_with_the_reason():
    r = subprocess.run([PYTHON, "-m", "benchmarks.gpu_bench", "--sizes", "1MiB"], cwd=ROOT, env=python_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "needs a CUDA GPU" in r.stderr and "CPU-only build" in r.stderr


def _report(ratio: float, batch_per_s: float | None, close_s: float | None) -> Report:
    rows = [Row(op, n, 10, 100.0 * ratio, "d2d" if op.startswith("d2d ") else "h2d", 100.0, 110.0)
            for op, n in RATIO_TARGETS]
    machine = {"date": "2026-12-04", "hostname": "h", "gpu": "NVIDIA H200", "gpu_count": 1, "gpu_memory_gib": 139.8,
               "gpu_sms": 132, "driver": "580", "cuda_torch": "13.0", "torch": "2.11", "python": "3.12",
               "transport": "0.1.0", "cpu_count": 16}
    batch = {} if batch_per_s is None else {"segments": 10_000, "segment_bytes": 4096, "stride": 8192,
                                            "prepared_per_s": batch_per_s, "single_per_s": batch_per_s / 100}
    return Report(machine, {"warmup": 3}, rows, {}, {"skipped": "one GPU"}, batch=batch, close_s=close_s)


def test_every_target_is_judged_by_the_figures():
    good = _report(0.97, 2 * BATCH_TARGET_PER_S, 0.01)
    assert len(good.targets()) == len(RATIO_TARGETS) + 2
    assert all(t["met"] for t in good.targets())
    bad = _report(0.85, BATCH_TARGET_PER_S / 2, 0.5)
    verdicts = {t["what"]: t["met"] for t in bad.targets()}
    assert verdicts["d2d put 1 MiB / device copy_"]  # 0.85 >= 0.5
    assert not verdicts["d2d put 64 MiB / device copy_"] and not verdicts["h2d put 1 GiB / pinned->device copy_"]
    assert not verdicts["prepared d2d batch, segments/s"] and not verdicts["Transport.aclose, nothing in flight (s)"]
    unmeasured = _report(1.0, None, None)
    assert [t["met"] for t in unmeasured.targets()][-2:] == [None, None]


def test_the_report_prints_the_targets_and_round_trips_as_json():
    rep = _report(0.85, BATCH_TARGET_PER_S / 2, 0.5)
    text = format_markdown(rep)
    assert "| d2d put 64 MiB / device copy_ | 0.85 | >= 0.9x | **NO** |" in text
    assert "| d2d put 1 MiB / device copy_ | 0.85 | >= 0.5x | yes |" in text
    assert "Transport.aclose of the initiator, nothing in flight: 500.0 ms" in text
    again = json.loads(json.dumps(rep.to_json()))
    assert again["close_s"] == 0.5 and len(again["targets"]) == len(rep.targets())
