"""Helpers shared by tests of every area (fixtures stay in ``tests/conftest.py``).

* :data:`ROOT`, :data:`PYTHON`, :func:`python_env`: run ``python -m tests.peers.<name>`` from the
  repository root, with the checkout first on ``sys.path``;
* :class:`Target`, :func:`serving_target`: a peer process (``tests/peers/peer_target.py`` by
  default) given a JSON spec, always reaped;
* :func:`backend_params`: every backend that moves host memory, as pytest params;
* :func:`sha`, :class:`LoopTicks`, :func:`put_to_fake_agent`: small checks.

Also here: :mod:`tests._support.scenarios` (backend-agnostic scenarios, trio and asyncio) and
:mod:`tests._support.delta_model` (the delta-sync tests' model, shared with their peers).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import pytest
import torch

import transport
from transport._tensors import MemoryKind
from transport.backends import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def backend_params() -> list:
    """Every implemented backend that moves host memory (the conformance suite's tensors); one
    that cannot run on this machine skips with its reason."""
    out = []
    for name, cls in REGISTRY.items():
        if MemoryKind.CPU not in cls.memory_kinds:
            continue  # device-memory only (nccl): tested in its own file
        why = cls.unavailable_reason()
        marks = [pytest.mark.skip(reason=f"{name} unavailable: {why}")] if why else []
        out.append(pytest.param(name, id=name, marks=marks))
    return out


def python_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class LoopTicks:
    """Counts passes of the event loop: start :meth:`run` in a task group; ``n`` grows each
    time the loop lets that task run."""

    def __init__(self) -> None:
        self.n = 0

    async def run(self) -> None:
        while True:
            self.n += 1
            await anyio.sleep(0)


async def put_to_fake_agent(a: transport.Transport, b: transport.Transport, port: int, serve: Callable[[], None],
                            timeout: float) -> None:
    """Makes ``b`` publish ``port`` as its agent's address (a fake agent, which the blocking
    ``serve`` runs in a thread meanwhile) and checks that a put from ``a`` into ``b``'s region
    "w" fails with PeerLostError within ``timeout`` s."""
    b._agent.port = port  # publish the fake agent's address instead of b's
    b._publish()
    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, serve)
        with anyio.fail_after(timeout):
            with pytest.raises(transport.PeerLostError):
                await a.put(torch.ones(4), "b", key="w")


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()


class Target:
    """A running test peer process (tests/peers/peer_target.py, or ``module``) given ``spec`` as
    JSON, always reaped (killed if still alive); it writes its results to ``spec["out"]``."""

    def __init__(self, tmp: Path, spec: dict, prefix: list[str] | None = None, *,
                 module: str = "tests.peers.peer_target", out: str | None = None) -> None:
        self.name: str = spec["name"]
        self.out = str(tmp / (out or f"{spec['name']}.json"))
        spec = {**spec, "out": self.out}
        self.proc = subprocess.Popen(
            [*(prefix or []), PYTHON, "-m", module, json.dumps(spec)],
            env=python_env(),
            cwd=ROOT,
            stderr=subprocess.PIPE,
        )

    def go(self) -> None:
        Path(self.out + ".go").touch()

    async def result(self, timeout: float = 60) -> dict:
        with anyio.fail_after(timeout):
            while self.proc.poll() is None:
                await anyio.sleep(0.02)
        assert self.proc.returncode == 0, self.proc.stderr.read().decode()[-3000:]
        return json.loads(Path(self.out).read_text())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.proc.stderr.close()


async def serving_target(t: transport.Transport, targets: Callable[[dict], Target], store: str, backend: str,
                         regions: list[dict], name: str = "server", **spec: object) -> Target:
    """A tests/peers/peer_target.py process ``name`` in mode "serve" with ``regions`` (its spec's
    list), once it said "ready" to ``t`` and ``t`` has its record with those regions."""
    target = targets({"name": name, "store": store, "backends": [backend], "initiator": t.name, "mode": "serve",
                      "regions": regions, **spec})
    await t.wait_signal("ready", timeout=60)
    await t.peer(name, regions=[r["key"] for r in regions])
    return target


async def put_each_dtype(t: transport.Transport, peer: str, sizes: dict[str, int], backend: str) -> dict[str, str]:
    """Puts a random tensor of each dtype of ``tests._support.scenarios.DTYPES`` into ``peer``'s
    region named after it (``sizes[name]`` elements) and reads it back (:func:`put_and_read_back`);
    returns the sha256 of each, by name: what the target must report holding."""
    from tests._support.scenarios import DTYPES, random_tensor

    await t.peer(peer, regions=list(sizes))
    expected = {}
    for i, dtype in enumerate(DTYPES):
        name = str(dtype).removeprefix("torch.")
        src = random_tensor(sizes[name], dtype, seed=i)
        await put_and_read_back(t, peer, [name], src, backend)
        expected[name] = sha(src)
    return expected


async def put_and_read_back(t: transport.Transport, peer: str, keys: Sequence[str], src: torch.Tensor,
                            backend: str) -> None:
    """Puts ``src`` into each of ``peer``'s regions ``keys`` and reads it back one-sidedly,
    asserting the backend that carried it and that the bytes came back unchanged (bit for bit:
    a NaN is compared as its bits)."""
    for key in keys:
        h = t.put(src, peer, key=key)
        await h
        assert h.backend == backend
        back = torch.zeros_like(src)
        await t.get(back, peer, key=key)  # one-sided read of the target
        assert torch.equal(back.view(torch.uint8), src.view(torch.uint8)) if src.numel() else back.numel() == 0
