"""Tied weights (two names over one memory, as an LM's embedding and output head) with delta
sync on: the subscriber whose tied tensors share memory takes every version dense (a delta of
each name would be checked against the other's stores and refused every version), and holds
each version bit for bit; an untied subscriber of the same publisher still takes deltas."""

from __future__ import annotations

import uuid

import torch

import transport
from transport.weights import Publisher, Subscriber
from transport.weights._codec.policy import CROSSOVER


def _tied(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(512, 256, generator=g).to(torch.bfloat16)
    return {"embed": emb, "head": emb, "mid": torch.randn(256, 256, generator=g).to(torch.bfloat16)}


async def test_tied_tensors_go_dense_and_land_exactly():
    store = f"memory://{uuid.uuid4().hex}"
    live = _tied(1)
    tied = _tied(2)  # the subscriber's own tied model (other values: they are overwritten)
    untied = {k: v.clone() for k, v in _tied(3).items()}
    async with transport.Transport("trainer", store=store, backends=("tcp",)) as tt, \
            transport.Transport("tied", store=store, backends=("tcp",)) as t0, \
            transport.Transport("untied", store=store, backends=("tcp",)) as t1:
        async with Publisher(tt, live, delta=True, delta_crossover=CROSSOVER) as pub, \
                Subscriber(t0, tied, publisher="trainer") as s0, \
                Subscriber(t1, untied, publisher="trainer") as s1:
            g = torch.Generator().manual_seed(9)
            for v in range(1, 5):
                if v > 1:  # 1% of the elements, through the one tied memory
                    for x in (live["embed"], live["mid"]):
                        flat = x.view(-1)
                        flat[torch.randperm(flat.numel(), generator=g)[: flat.numel() // 100]] += 1
                r = await pub.publish(v)
                for s in (s0, s1):
                    assert await s.wait_version(v, timeout=30) == v
                assert not r.results["tied"].delta, v  # dense: it does not take deltas
                assert r.results["untied"].delta == (v > 1), v
                for k in live:
                    assert torch.equal(tied[k].view(torch.int16), live[k].view(torch.int16)), (v, k)
                    assert torch.equal(untied[k].view(torch.int16), live[k].view(torch.int16)), (v, k)
            assert tied["embed"].data_ptr() == tied["head"].data_ptr()  # still tied
            assert s0.refused_deltas == 0 and s1.refused_deltas == 0
