"""Fixtures of the GPU tests."""

from __future__ import annotations

import pytest

from tests.gpu._support import CudaPeer


@pytest.fixture
def peers(tmp_path, file_store):
    """Starts target processes on the test's file store: ``peers(spec, env=None)``."""
    made: list[CudaPeer] = []

    def make(spec: dict, env: dict[str, str] | None = None) -> CudaPeer:
        made.append(CudaPeer(tmp_path, file_store, spec, env))
        return made[-1]

    yield make
    for p in made:
        p.close()
