"""Shared fixtures. Async tests run under trio (pytest-trio, trio_mode); the asyncio subset
runs the same scenarios through asyncio.run (tests/test_asyncio.py)."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

import transport
from transport.backends import REGISTRY

ROOT = Path(__file__).resolve().parent.parent


def backend_params() -> list:
    """Every implemented backend; one that cannot run on this machine skips with its reason."""
    out = []
    for name, cls in REGISTRY.items():
        why = cls.unavailable_reason()
        marks = [pytest.mark.skip(reason=f"{name} unavailable: {why}")] if why else []
        out.append(pytest.param(name, id=name, marks=marks))
    return out


@pytest.fixture(params=backend_params())
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def file_store(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"


@pytest.fixture
def memory_store() -> str:
    return f"memory://{uuid.uuid4().hex}"


@pytest.fixture
async def pair(backend: str, memory_store: str):
    """Two Transports in this process that speak only ``backend``: a initiates, b is the target."""
    async with transport.Transport("a", store=memory_store, backends=(backend,), timeout=20) as a:
        async with transport.Transport("b", store=memory_store, backends=(backend,), timeout=20) as b:
            yield a, b


def python_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


PYTHON = sys.executable
