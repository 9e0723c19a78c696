"""Helpers of the weight-sync tests: subscriber processes (tests/peers/weights_peer.py) on a
file store, the versions they check, and a publisher loop."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import anyio
import torch

from tests._support import PYTHON, ROOT, python_env

SHAPES: dict[str, tuple[list[int], str]] = {
    "w0": ([512, 1024], "float32"),
    "w1": ([1024, 512], "float32"),
    "w2": ([256, 256], "bfloat16"),
    "b": ([1024], "float32"),
}


class Peers:
    """Subscriber processes (tests/peers/weights_peer.py) on ``store``, each reaped by :meth:`close`."""

    def __init__(self, tmp: Path, store: str) -> None:
        self.tmp, self.store = tmp, store
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, **extra) -> None:
        spec = {"name": name, "store": self.store, "publisher": "trainer", "shapes": SHAPES,
                "out": str(self.tmp / f"{name}.json"), **extra}
        self.procs[name] = subprocess.Popen([PYTHON, "-m", "tests.peers.weights_peer", json.dumps(spec)],
                                            env=python_env(), cwd=ROOT, stderr=subprocess.PIPE)

    async def result(self, name: str, timeout: float = 60) -> dict:
        proc = self.procs[name]
        with anyio.fail_after(timeout):
            while proc.poll() is None:  # a child process has no event to wait on
                await anyio.sleep(0.02)
        assert proc.returncode == 0, proc.stderr.read().decode()[-3000:] if proc.stderr else proc.returncode
        return json.loads((self.tmp / f"{name}.json").read_text())

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait(timeout=30)
            if p.stderr is not None:
                p.stderr.close()


def versioned(v: int) -> dict[str, torch.Tensor]:
    return {k: torch.full(s, float(v % 128), dtype=getattr(torch, d)) for k, (s, d) in SHAPES.items()}


async def publish_cycles(t, pub, src, first: int, count: int) -> list:
    reports = []
    for v in range(first, first + count):
        for x in src.values():
            x.fill_(float(v % 128))  # exact in bfloat16 too: a torn read cannot hide in rounding
        reports.append(await pub.publish(v))
    return reports
