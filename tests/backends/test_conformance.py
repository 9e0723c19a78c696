"""The conformance suite, run against every built-in backend through the public kit
(``transport.testing.check_backend``; the checks themselves live in ``transport._conformance``).

Both endpoints live in this process so the target's memory is inspected directly; the
multi-process file runs the one-sided and fault cases with real separate processes. nccl moves
GPU memory only and runs its checks on a loopback pair (one Transport putting to itself: two
ranks on one GPU need NCCL's multi-rank mode), where a GPU exists.
"""

from __future__ import annotations

import pytest
import torch

from transport.backends import REGISTRY
from transport.testing import check_backend, pair_factory


def _params() -> list:
    out = []
    for name, cls in REGISTRY.items():
        why = cls.unavailable_reason()
        marks = [pytest.mark.skip(reason=f"{name} unavailable: {why}")] if why else []
        if name == "nccl":
            marks.append(pytest.mark.gpu)
        out.append(pytest.param(name, id=name, marks=marks))
    return out


@pytest.mark.parametrize("name", _params())
async def test_check_backend(name: str) -> None:
    if name == "nccl":  # a communicator's first open is slow: NCCL's own bootstrap
        await check_backend(pair_factory(name, loopback=True, timeout=60.0))
    else:
        await check_backend(pair_factory(name))


@pytest.mark.slow
async def test_one_gib(pair, backend):
    a, b = pair
    n = 1 << 30
    dst = b.empty("big", n, torch.uint8) if backend == "ipc" else torch.zeros(n, dtype=torch.uint8)
    if backend != "ipc":
        b.register("big", dst)
    await a.peer("b", regions=["big"])
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    await a.put(src, "b", key="big")
    assert torch.equal(dst, src)
    del src
    back = torch.empty(n, dtype=torch.uint8)
    await a.get(back, "b", key="big")
    assert torch.equal(back, dst)
