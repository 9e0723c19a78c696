"""Per-host relays of device slots (``Subscriber(device="cuda:0", relay=True)``), with real
processes on "hosts" that are network namespaces (tests/_support/netns.py): the trainer's CUDA
state on host T, three generators with GPU slots on host A (one relay, two members), one on
host B.

The trainer's pieces reach the relay's GPU memory over ``nccl`` (host -> host across the
namespaces), and the members copy them GPU to GPU over CUDA IPC as they are logged. Every
version a generator made live is checked against the trainer's digest (a member that copied a
piece before it landed, or skipped one, fails it), and the relay killed mid-version costs its
host one more push, never a torn version.

Needs a CUDA GPU, root (ip netns) and NCCL between two processes: two GPUs, or NCCL >= 2.30
with ``NCCL_MULTI_RANK_GPU_ENABLE=1`` on one (``scripts/gpu_check.sh`` runs it so). Not run on
a GPU yet (no lent machine had that NCCL in the session that wrote it).
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch

from tests._support.fabric_run import FabricRun
from tests._support.netns import Fabric, unavailable_reason
from tests.weights.test_relays import check_whole, kill_relay_in_version_3
from transport._native import nccl as _nccl
from transport.backends.nccl import NcclBackend


def _reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (none here)"
    if (why := NcclBackend.unavailable_reason()) is not None:
        return f"needs NCCL: {why}"
    lib, why = _nccl.library()
    if torch.cuda.device_count() < 2 and (lib is None or not _nccl.multi_rank_gpu(lib)):
        return "needs two GPUs, or NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1 (two ranks on one GPU)"
    return unavailable_reason()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_reason() is not None, reason=_reason() or ""),
              pytest.mark.timeout(180)]

SHAPES = {f"layers.{i}.w": [[1024, 1024], "bfloat16"] for i in range(4)} | {"norm": [[1024], "float32"]}
GENS = {"gen-a0": "A", "gen-a1": "A", "gen-a2": "A", "gen-b0": "B"}
RATE_MBIT = 200
WAIT_S = 150


def run(fab: Fabric, trainer: dict, fault=None) -> tuple[list[dict], dict, list[dict]]:
    trainer_gpu = 1 if torch.cuda.device_count() > 1 else 0  # (the generators' slots are on GPU 0)
    with tempfile.TemporaryDirectory() as d:
        flight = os.path.join(d, "flight")
        os.makedirs(flight)
        r = FabricRun(fab, flight)
        store = f"file://{d}/store"
        for name, host in GENS.items():
            r.start(name, host, "tests.peers.relay_peer",
                    {"name": name, "store": store, "publisher": "trainer", "shapes": SHAPES, "device": "cuda:0",
                     "relay": True, "backends": ["ipc", "nccl", "tcp"], "listen": fab.addr(host), "flight": flight})
        r.start("trainer", "T", "tests.peers.relay_trainer",
                {"store": store, "generators": list(GENS), "shapes": SHAPES, "deadline": 20.0,
                 "device": f"cuda:{trainer_gpu}", "listen": fab.addr("T"), "flight": flight, "bucket": 1 << 20}
                | trainer)
        reports = r.reports("trainer", (lambda doc: fault(r, doc)) if fault else (lambda doc: None),
                            time.monotonic() + WAIT_S)
        return reports, {name: r.generator(name) for name in GENS}, r.events("trainer")


@pytest.fixture
def fabric():
    with Fabric({"T": 1, "A": 1, "B": 1}, rate_mbit=RATE_MBIT) as fab:
        yield fab


def test_device_slots_are_relayed_whole(fabric):
    reports, gens, events = run(fabric, {"versions": 4, "change": 0.01, "pause": 0.3})
    check_whole(reports, gens)
    for rep in reports:
        res = rep["results"]
        assert {n: s[0] for n, s in res.items()} == dict.fromkeys(GENS, "done"), rep
        assert res["gen-a0"][1] is None and res["gen-b0"][1] is None, rep
        # Device slots take no deltas: every version goes dense, through host A's relay.
        assert res["gen-a1"][1] == "gen-a0" and res["gen-a2"][1] == "gen-a0", rep
    for name in ("gen-a1", "gen-a2"):
        _, summary = gens[name]
        assert summary is not None and summary["followed"] == len(reports), summary
    assert any(e["event"] == "relay" and e["peer"] == "gen-a0" for e in events), events


def test_a_killed_device_slot_relay_costs_its_host_one_more_push(fabric):
    reports, gens, events = run(fabric, {"versions": 4, "change": 1.0, "pause": 0.3}, kill_relay_in_version_3)
    check_whole(reports, gens)
    v3 = reports[2]["results"]
    assert v3["gen-a0"][0] != "done", v3
    assert v3["gen-a1"][0] == "done" and v3["gen-a2"][0] == "done" and v3["gen-b0"][0] == "done", v3
    assert any(e["event"] == "relay-failed" and e["peer"] == "gen-a0" for e in events), events
