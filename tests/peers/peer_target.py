"""A target process for multi-process tests: ``python -m tests.peers.peer_target '<json spec>'``.

It registers the regions of the spec, tells the initiator it is ready (signal "ready"), then
either blocks its whole Python thread in ``time.sleep`` (mode "sleep": its event loop does not
run until the initiator creates the file ``go``; with ``sleep_on_signal`` only once signalled
"sleep", answering "sleeping") or serves until signalled ("serve"), and
finally writes the sha256 of every region to ``out``.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
import time

import torch
import trio

import transport


async def main(spec: dict) -> None:
    if spec.get("undumpable"):
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE=0: refuse ptrace/CMA
    async with transport.Transport(spec["name"], store=spec["store"], backends=spec.get("backends"),
                                   timeout=spec.get("timeout", 30)) as t:
        regions = {}
        for r in spec["regions"]:
            dtype = getattr(torch, r["dtype"])
            if r.get("shared"):
                regions[r["key"]] = t.empty(r["key"], r["numel"], dtype)
            else:
                regions[r["key"]] = torch.zeros(r["numel"], dtype=dtype)
                t.register(r["key"], regions[r["key"]])
        await t.peer(spec["initiator"])
        await t.signal(spec["initiator"], "ready", os.getpid())
        info: dict = {}
        if spec["mode"] == "sleep":
            if spec.get("sleep_on_signal"):  # first serve until told to sleep, and say so
                await t.wait_signal("sleep", timeout=spec.get("timeout", 30))
                await t.signal(spec["initiator"], "sleeping", 1)
            go = spec["out"] + ".go"
            deadline = time.monotonic() + spec.get("timeout", 30)
            while not os.path.exists(go) and time.monotonic() < deadline:
                time.sleep(0.02)  # blocks this thread: the event loop and agent cannot run
            info["woke_by_go"] = os.path.exists(go)
        else:
            await t.wait_signal("done", timeout=spec.get("timeout", 30))
        info["sha256"] = {
            k: hashlib.sha256(v.view(torch.uint8).numpy().tobytes()).hexdigest() for k, v in regions.items()
        }
        with open(spec["out"] + ".tmp", "w") as f:
            json.dump(info, f)
        os.replace(spec["out"] + ".tmp", spec["out"])


if __name__ == "__main__":
    trio.run(main, json.loads(sys.argv[1]))
