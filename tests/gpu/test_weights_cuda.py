"""transport.weights with GPU models (skipped without a CUDA GPU; run by scripts/gpu_check.sh).

The trainer's live CUDA tensors are pushed straight into the generators' host slots (ipc:
device -> the slot's shared mapping, page-locked) and applied into CUDA tensors; the pushes see
the optimizer's work queued on the trainer's stream before ``publish``.
"""

from __future__ import annotations

import uuid

import pytest
import torch

import transport
from transport._tensor_kernels import as_bytes
from transport.weights import Publisher, Subscriber

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)"),
    pytest.mark.timeout(120),
]


def gpu_model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "embed": torch.randn(4096, 512, device="cuda", generator=g).to(torch.bfloat16),  # 4 MiB: sent directly
        "w": torch.randn(257, 129, device="cuda", generator=g),
        "b": torch.randn(7, device="cuda", generator=g).to(torch.bfloat16),
        "step": torch.tensor(3, device="cuda"),
    }


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit for bit (NaN-safe)."""
    return a.keys() == b.keys() and all(torch.equal(as_bytes(a[k]).cpu(), as_bytes(b[k]).cpu()) for k in a)


@pytest.mark.parametrize("backend", ["ipc", "tcp"])
async def test_gpu_model_to_gpu_model(backend):
    store = f"memory://{uuid.uuid4().hex}"
    src, dst = gpu_model(1), {k: torch.zeros_like(v) for k, v in gpu_model(2).items()}
    async with transport.Transport("trainer", store=store, backends=(backend,)) as tt, \
            transport.Transport("gen", store=store, backends=(backend,)) as tg:
        async with Publisher(tt, src, bucket_bytes=1 << 20) as pub, Subscriber(tg, dst, publisher="trainer") as sub:
            for v in (1, 2):
                # Queued on the current stream right before publish: the pushes must see it.
                torch.cuda._sleep(50_000_000)
                for x in src.values():
                    x.add_(1)
                report = await pub.publish(v)
                assert report.done == ["gen"], report
                assert await sub.wait_version(v, timeout=30) == v
                torch.cuda.synchronize()
                assert same(src, dst)
            assert all(t.is_cuda for t in dst.values())


async def test_zero_copy_needs_the_slots_where_the_tensors_are():
    async with transport.Transport("gen", store=f"memory://{uuid.uuid4().hex}") as tg:
        with pytest.raises(ValueError, match=r"zero_copy=True re-points tensors at the slots on cpu.*cuda:0"):
            Subscriber(tg, gpu_model(0), publisher="trainer", zero_copy=True)
        Subscriber(tg, gpu_model(0), publisher="trainer", zero_copy=True, device="cuda:0")


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero-copy"])
async def test_slots_in_gpu_memory(zero_copy):
    """device="cuda": the publisher writes into the generator's GPU slots (CUDA IPC), apply() is
    a device copy or a re-point."""
    store = f"memory://{uuid.uuid4().hex}"
    src, dst = gpu_model(1), {k: torch.zeros_like(v) for k, v in gpu_model(2).items()}
    async with transport.Transport("trainer", store=store, backends=("ipc",)) as tt, \
            transport.Transport("gen", store=store, backends=("ipc",)) as tg:
        async with Publisher(tt, src, bucket_bytes=1 << 20) as pub, \
                Subscriber(tg, dst, publisher="trainer", device="cuda", zero_copy=zero_copy) as sub:
            assert all(s.is_cuda for s in sub._slots)
            for v in (1, 2, 3):
                for x in src.values():
                    x.add_(1)
                report = await pub.publish(v)
                assert report.done == ["gen"], report
                assert await sub.wait_version(v, timeout=30) == v
                assert same(src, dst)
                assert all(t.is_cuda for t in dst.values())
