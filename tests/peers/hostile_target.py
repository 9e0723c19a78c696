"""A target process for tests/faults/test_hostile_agent.py: ``python -m tests.peers.hostile_target '<json spec>'``.

It opens a Transport (``env`` is applied first: the agent reads its caps and handshake deadline
from there; ``sock_buf``, if given, is the size its agent asks for its sockets' buffers, as on a
host whose ``net.core.wmem_max`` / ``rmem_max`` are the Linux defaults), optionally lowers its
own RLIMIT_NOFILE to the highest open descriptor plus ``nofile_headroom``, registers the uint8
region ``w``, and writes ``<out>.ready``. While it serves it keeps looking up the peers named in
``watch`` (as a directory polling a poisoned store would), recording each round in
``<out>.watch``; any error that is not a TransportError escapes and kills the process, which the
test notices. On signal ``done`` it writes the sha256 of ``w`` to ``out``. Logs go to stderr (the
test sends them to a file it reads).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import sys

import torch
import trio

import transport
from transport import _sockets


def _write(path: str, doc: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)


async def _watch(t: transport.Transport, names: list[str], out: str) -> None:
    rounds, outcomes = 0, {}
    while True:
        for name in names:
            try:
                outcomes[name] = repr(await t.lookup(name))
                await t.peer(name, timeout=0.05)
            except transport.TransportError as exc:  # anything else escapes: the test sees a dead target
                outcomes[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rounds += 1
        try:
            _write(out + ".watch", {"rounds": rounds, "outcomes": outcomes})
        except OSError:
            pass  # out of descriptors while the test floods the agent: next round
        await trio.sleep(0.1)


async def main(spec: dict) -> None:
    os.environ.update(spec.get("env", {}))
    if "sock_buf" in spec:
        _sockets._SOCK_BUF = spec["sock_buf"]
    async with transport.Transport(spec["name"], store=spec["store"], backends=spec.get("backends"),
                                   token=spec.get("token"), timeout=30) as t:
        region = torch.zeros(spec["numel"], dtype=torch.uint8)
        nofile = None
        if "nofile_headroom" in spec:
            nofile = max(int(fd) for fd in os.listdir("/proc/self/fd")) + 1 + spec["nofile_headroom"]
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        t.register("w", region)
        _write(spec["out"] + ".ready", {"pid": os.getpid(), "nofile": nofile})
        async with trio.open_nursery() as nursery:
            if spec.get("watch"):
                nursery.start_soon(_watch, t, spec["watch"], spec["out"])
            await t.wait_signal("done", timeout=600)
            nursery.cancel_scope.cancel()
        _write(spec["out"], {"sha256": hashlib.sha256(region.numpy().tobytes()).hexdigest()})


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    trio.run(main, json.loads(sys.argv[1]))
