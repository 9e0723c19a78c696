"""Peers that come and go while their process lives on: ``python -m tests.peers.churn_peer '<json>'``.

Two roles, run as two processes on one store (tests/peers/resource_probe.py starts both):

* ``churner``: for ``i`` in ``0..n-1`` opens Transport ``churn-i`` (ipc) with a library-allocated
  region ``w`` of ``region_bytes`` (a memfd the initiator maps), waits for signal ``hit``, and
  closes it cleanly, all in this one process; then writes ``out`` and stays alive until the
  initiator has reported (a departed peer whose process lives on is the case under test).
* ``initiator``: one Transport (ipc) that waits for each ``churn-i``, puts ``region_bytes``
  into its ``w`` (mapping it) and signals ``hit``. After the last one it waits until it no
  longer knows any of them (or 30 s), then writes ``out``: its own memory before and after
  (``VmRSS``/``RssShmem`` in MiB), the memfd mappings of peers' regions still in its address
  space, the peers its directory still holds, and how long forgetting took.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import trio

import transport
from tests.peers.resource_probe import memory_of


def _write(path: str, doc: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)


def peer_mappings() -> int:
    """Mappings of other processes' region memfds in this process."""
    return sum(1 for line in Path("/proc/self/maps").read_text().splitlines() if "transport:churn-" in line)


async def churner(spec: dict) -> None:
    for i in range(spec["n"]):
        async with transport.Transport(f"churn-{i}", store=spec["store"], backends=("ipc",), timeout=30,
                                       heartbeat=0.2, lease=5) as p:
            p.empty("w", spec["region_bytes"], torch.uint8)
            await p.wait_signal("hit", timeout=60)
    _write(spec["out"], {"closed": spec["n"]})
    await trio.sleep(120)  # alive while the initiator notices; the probe kills us


async def initiator(spec: dict) -> None:
    src = torch.full((spec["region_bytes"],), 7, dtype=torch.uint8)
    async with transport.Transport("initiator", store=spec["store"], backends=("ipc",), timeout=30,
                                   heartbeat=0.2, lease=5) as t:
        before = memory_of(os.getpid())
        for i in range(spec["n"]):
            name = f"churn-{i}"
            await t.peer(name, regions=["w"], timeout=60)
            await t.put(src, name, key="w")
            await t.signal(name, "hit", 1)
        peak = memory_of(os.getpid())
        done = time.monotonic()
        while time.monotonic() - done < 30:
            held = [n for n in t._directory._peers if n.startswith("churn-")]  # the directory's own table
            if not held and peer_mappings() == 0:
                break
            await trio.sleep(0.2)
        report = {"before": before, "peak": peak, "after": memory_of(os.getpid()), "mappings": peer_mappings(),
                  "records": len([n for n in t._directory._peers if n.startswith("churn-")]),
                  "forgot_in_s": round(time.monotonic() - done, 2)}
    _write(spec["out"], report)


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    trio.run({"churner": churner, "initiator": initiator}[spec["role"]], spec)
