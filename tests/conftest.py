"""Shared fixtures (helpers live in tests/_support). Async tests run under trio (pytest-trio,
trio_mode); the asyncio subset runs the same scenarios through asyncio.run
(tests/api/test_asyncio.py)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

import transport
from tests._support import Target, backend_params


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


@pytest.fixture
def targets(tmp_path):
    """``targets(spec, prefix=None)`` starts a tests/peers/peer_target.py process (a Target); all
    are reaped at the end."""
    made: list[Target] = []

    def make(spec: dict, prefix: list[str] | None = None) -> Target:
        made.append(Target(tmp_path, spec, prefix))
        return made[-1]

    yield make
    for t in made:
        t.close()
