"""Helpers of the GPU tests (tests/gpu/test_cuda.py, tests/gpu/test_cuda_batch.py): target
processes (tests/peers/cuda_peer.py), the checksums they report, and byte-exact comparisons."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import transport
from tests._support import PYTHON, ROOT, python_env

CUDA_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)"),
    pytest.mark.timeout(180),
]
"""The ``pytestmark`` of every file that runs tests/peers/cuda_peer.py targets."""

MiB = 1 << 20
START_S = 90  # a target imports torch and initialises CUDA before it is ready
INIT = "init"


def random_bytes(numel: int, dtype: torch.dtype, seed: int, device: str = "cuda") -> torch.Tensor:
    """``numel`` elements of ``dtype`` with random bytes (NaNs included: compare bytes, not values)."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, device=device, generator=g).view(dtype)


def same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.numel() != y.numel() or x.dtype != y.dtype:
        return False
    if x.numel() == 0:
        return True
    if x.device != y.device:
        x, y = x.cpu(), y.cpu()
    return torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


def pattern(nbytes: int, byte: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((nbytes,), byte, dtype=torch.uint8).view(dtype)


def cuda_region(key: str, dtype: str, numel: int, **kw: Any) -> dict:
    return {"key": key, "dtype": dtype, "numel": numel, "where": "cuda", **kw}


class CudaPeer:
    """A running tests/peers/cuda_peer.py process; always reaped (killed if still alive)."""

    def __init__(self, tmp: Path, store: str, spec: dict, env: dict[str, str] | None = None) -> None:
        self.name = spec["name"]
        serial = spec.setdefault("serial", 1)
        self.out = tmp / f"{self.name}-{serial}.json"
        self.log_path = tmp / f"{self.name}-{serial}.log"
        spec = {"store": store, "initiator": INIT, "backends": ["ipc"], **spec, "out": str(self.out)}
        self._log = open(self.log_path, "wb")  # closed in close()
        self.proc = subprocess.Popen(
            [PYTHON, "-m", "tests.peers.cuda_peer", json.dumps(spec)],
            env={**python_env(), **(env or {})},
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        return self.log_path.read_bytes()[-4000:].decode(errors="replace")

    async def ready(self, t: transport.Transport, regions: list[str], serial: int = 1) -> transport.Peer:
        with anyio.fail_after(START_S):
            while t.signal_value(f"ready.{self.name}") is None or t.signal_value(f"ready.{self.name}") < serial:
                if self.proc.poll() is not None:
                    raise AssertionError(
                        f"{self.name} exited with {self.proc.returncode} before it was ready:\n{self.output()}"
                    )
                await anyio.sleep(0.02)
        if t.signal_value(f"regerr.{self.name}"):
            return None  # type: ignore[return-value]  # registration failed, by request
        return await t.peer(self.name, regions=regions, timeout=30)

    async def result(self, t: transport.Transport) -> dict:
        await t.signal(self.name, "exit", 1)
        with anyio.fail_after(60):
            while self.proc.poll() is None:
                await anyio.sleep(0.02)
        assert self.proc.returncode == 0, self.output()
        return json.loads(self.out.read_text())

    async def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        # Reaped at once: an unreaped (zombie) child still looks alive to a pid check.
        await anyio.to_thread.run_sync(functools.partial(self.proc.wait, timeout=30))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._log.close()


class Checker:
    """Asks targets for checksums of their own memory (see tests/peers/cuda_peer.py)."""

    def __init__(self, t: transport.Transport) -> None:
        self.t = t
        self.round = 0

    async def _round(self, peer: str) -> None:
        self.round += 1
        await self.t.signal(peer, "check", self.round)
        await self.t.wait_signal(f"checked.{peer}", at_least=self.round, timeout=60)

    async def digests(self, peer: str, keys: list[str]) -> dict[str, int]:
        await self._round(peer)
        return {k: self.t.signal_value(f"digest.{peer}.{k}") for k in keys}

    async def guards(self, peer: str, keys: list[str]) -> dict[str, int]:
        await self._round(peer)
        return {k: self.t.signal_value(f"guard.{peer}.{k}") for k in keys}


def opened(file_store: str, **kw: Any) -> transport.Transport:
    return transport.Transport(INIT, store=file_store, backends=("ipc",), timeout=kw.pop("timeout", 30), **kw)
