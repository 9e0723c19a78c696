"""A publisher pushes each part of a delta version by starting, with the part's runs, one prepared
put per subscriber, slot and source (the encodings' staging buffer, the new snapshot), made once:
no new transfer is built for a part, over versions and parts, and the subscribers hold every
version bit for bit."""

from __future__ import annotations

import uuid

import pytest
import torch

import transport
from tests._support.delta_model import same_bits
from transport.weights import Publisher, Subscriber
from transport.weights import _pipeline as pipeline_module
from transport.weights._codec.policy import CROSSOVER


def model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    m = {f"layer.{i}": torch.randn(32, 1024, generator=g).to(torch.bfloat16) for i in range(10)}
    m["norm"] = torch.randn(2048, generator=g)
    m["step"] = torch.zeros((), dtype=torch.int64)  # not deltable: travels dense from the snapshot
    return m


def step(m: dict[str, torch.Tensor], v: int) -> None:
    """1% of each float tensor's elements changed; ``norm`` rewritten whole at version 4."""
    g = torch.Generator().manual_seed(100 + v)
    for k, x in m.items():
        if not x.is_floating_point():
            x.fill_(v)
            continue
        flat = x.view(-1)
        n = flat.numel() if (k == "norm" and v == 4) else flat.numel() // 100
        flat[torch.randperm(flat.numel(), generator=g)[:n]] += 1


@pytest.mark.parametrize("backend", ["tcp", "ipc"])
async def test_delta_parts_start_prepared_puts_made_once(monkeypatch, backend):
    monkeypatch.setattr(pipeline_module, "cores", lambda: 64)  # the diff hands out several parts
    store = f"memory://{uuid.uuid4().hex}"
    live = model()
    state = {k: torch.zeros_like(v) for k, v in live.items()}
    async with transport.Transport("trainer", store=store, backends=(backend,)) as tt, \
            transport.Transport("gen-0", store=store, backends=(backend,)) as t0:
        made: list[str] = []  # each prepared put of runs the publisher makes
        per_part: list[str] = []  # each transfer built for one put_many
        prepare_put_runs, put_many = tt.prepare_put_runs, tt.put_many

        def counting_prepare(peer, src, key, runs):
            made.append(key)
            return prepare_put_runs(peer, src, key, runs)

        def counting_put_many(peer, items, **kw):
            per_part.extend(key for _, key, _ in items)
            return put_many(peer, items, **kw)

        monkeypatch.setattr(tt, "prepare_put_runs", counting_prepare)
        monkeypatch.setattr(tt, "put_many", counting_put_many)
        async with Publisher(tt, live, delta=True, delta_crossover=CROSSOVER) as pub, \
                Subscriber(t0, state, publisher="trainer") as sub:
            for v in range(1, 8):
                if v > 1:
                    step(live, v)
                r = await pub.publish(v)
                assert r.results["gen-0"].delta == (v > 1), (v, r.results)
                assert await sub.wait_version(v, timeout=30) == v
                assert same_bits(state, live), v
            # Two slots, two sources (staging, snapshot): at most four prepared puts, whatever
            # the number of versions and parts; no part went as a new transfer.
            assert 2 <= len(made) <= 4 and all(".slot" in key for key in made), made
            assert not [key for key in per_part if ".slot" in key], per_part
            puts = [rec for rec in tt.flight_record()["records"] if rec["op"] == "put" and ".slot" in rec["key"]]
            assert len(puts) >= 1 + 6 * 2, len(puts)  # several parts a version, each its own start
