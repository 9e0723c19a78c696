"""A target for tests/faults/test_readonly.py: ``python -m tests.peers.readonly_target '<json spec>'``.

It registers, each filled with :func:`pattern` by this process *after* registration (the owner
keeps writing its read-only regions through its own mapping):

* ``ro_shm``: ``Transport.empty(..., writable=False)`` (a sealed memfd);
* ``ro_plain``: an ordinary tensor registered ``writable=False``;
* ``rw_shm``: ``Transport.empty(...)``, writable;
* ``ro2`` and ``rw_view``: a second read-only buffer, and a writable region over its first
  ``VIEW`` bytes (registered afterwards: peers then write it by cross-memory attach only).

Then it signals "ready" to the initiator, serves until it gets "done", and writes the sha256 of
every region to ``out``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
import trio

import transport

N = 1 << 16
VIEW = 4096


def pattern(n: int, salt: int = 0) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64) * 7 + salt) % 251).to(torch.uint8)


async def main(spec: dict) -> None:
    async with transport.Transport(spec["name"], store=spec["store"], backends=spec["backends"],
                                   timeout=spec.get("timeout", 30)) as t:
        regions = {
            "ro_shm": t.empty("ro_shm", N, torch.uint8, writable=False),
            "ro_plain": torch.zeros(N, dtype=torch.uint8),
            "rw_shm": t.empty("rw_shm", N, torch.uint8),
            "ro2": t.empty("ro2", N, torch.uint8, writable=False),
        }
        t.register("ro_plain", regions["ro_plain"], writable=False)
        t.register("rw_view", regions["ro2"][:VIEW], writable=True)
        for salt, tensor in enumerate(regions.values()):
            tensor.copy_(pattern(N, salt))  # after registration: the sealed memfds stay writable here
        await t.peer(spec["initiator"])
        await t.signal(spec["initiator"], "ready", os.getpid())
        await t.wait_signal("done", timeout=spec.get("timeout", 30))
        info = {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in regions.items()}
        with open(spec["out"] + ".tmp", "w") as f:
            json.dump(info, f)
        os.replace(spec["out"] + ".tmp", spec["out"])


if __name__ == "__main__":
    trio.run(main, json.loads(sys.argv[1]))
