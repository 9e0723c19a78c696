"""Fixtures of the weight-sync tests."""

from __future__ import annotations

import pytest

from tests.weights._support import Peers


@pytest.fixture
def peers(tmp_path):
    ps = Peers(tmp_path, f"file://{tmp_path / 'store'}")
    yield ps
    ps.close()
