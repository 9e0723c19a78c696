"""The diff of a delta version hands its encodings out in parts while it runs (DeltaEncoder.encode's
``ready``), and a publisher whose diff leaves cores free pushes each part to the subscribers that
hold the base before the rest is diffed: the parts are exactly the version's runs, each final
when handed out, and the subscribers hold every version bit for bit."""

from __future__ import annotations

import uuid

import pytest
import torch

import transport
from tests._support.delta_model import land, same_bits
from transport._native import delta as native
from transport.weights import Publisher, Subscriber
from transport.weights import _pipeline as pipeline_module
from transport.weights._codec.apply import DeltaApplier
from transport.weights._codec.encode import DeltaEncoder, Kind
from transport.weights._codec.policy import CROSSOVER
from transport.weights._layout import build_layout


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    m = {f"layer.{i}": torch.randn(64, 1024, generator=g).to(torch.bfloat16) for i in range(12)}
    m["norm"] = torch.randn(4096, generator=g)
    m["step"] = torch.zeros((), dtype=torch.int64)  # not deltable: always dense
    return m


def changed(m: dict[str, torch.Tensor], seed: int, dense: str | None = None) -> dict[str, torch.Tensor]:
    """1% of each float tensor's elements changed (``dense``: 60% of that one)."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in m.items()}
    for k, v in out.items():
        if not v.is_floating_point():
            v.fill_(seed)
            continue
        flat = v.view(-1)
        n = flat.numel() * (6 if k == dense else 1) // (10 if k == dense else 100)
        flat[torch.randperm(flat.numel(), generator=g)[:n]] += 1
    return out


def encoder_at(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]):
    """An encoder of ``new`` whose snapshot 0 holds ``base`` (version 0, checksums known)."""
    layout = build_layout("m", new, bucket_bytes=1 << 20)
    snaps = [torch.zeros(layout.total, dtype=torch.uint8) for _ in range(2)]
    first = DeltaEncoder(layout, base, 2)
    _, sums = first.encode(snaps[0], 0, None, None, None, 0)
    enc = DeltaEncoder(layout, new, 2)
    enc.commit(0, 0, sums)
    return layout, snaps, enc


def rows_of(runs) -> dict[int, list[tuple[int, int, int]]]:
    """Per source (by its buffer's address), its runs' rows, in order."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    for source, rows in runs:
        out.setdefault(source.buffer.data_ptr(), []).extend(map(tuple, rows.tolist()))
    return out


def test_parts_are_the_runs_each_final_when_handed_out():
    base = model(1)
    new = changed(base, 2, dense="layer.3")
    layout, snaps, enc = encoder_at(base, new)
    parts: list[list] = []

    def ready(part) -> None:
        # What the push would send now, copied as it is now.
        parts.append([(source, rows, [source.buffer[a:a + n].clone() for a, _, n in rows.tolist()])
                      for source, rows in part])

    dv, _ = enc.encode(snaps[1], 1, snaps[0], 0, 0, 1, ready, parts=8)
    assert dv.is_delta and dv.kinds[[e.name for e in layout.entries].index("layer.3")] == Kind.DENSE
    assert 3 <= len(parts) <= 9, len(parts)  # about an eighth of the version each, the rest last
    flat = [(source, rows) for part in parts for source, rows, _ in part]
    assert rows_of(flat) == rows_of(dv.runs)
    assert {s.buffer.data_ptr() for s, _ in flat} == {snaps[1].data_ptr(), enc._staging.data_ptr()}
    for source, rows in flat:  # every run inside its source's window, at the same place in the slot
        w = source.window
        assert all(((w[:, 1] <= b) & (b + n <= w[:, 1] + w[:, 2]) & (w[:, 0] - w[:, 1] == a - b)).any()
                   for a, b, n in rows.tolist())
    for part in parts:  # nothing handed out changed afterwards
        for source, rows, then in part:
            for (a, _, n), was in zip(rows.tolist(), then, strict=True):
                assert torch.equal(source.buffer[a:a + n], was)
    assert dv.wire_bytes == sum(int(r[:, 2].sum()) for _, r in flat) + dv.header.numel() * 8
    # The parts, landed in a slot with the header, apply to the base bit for bit.
    slot = torch.zeros(layout.total, dtype=torch.uint8)
    land(slot, flat)
    live = {k: v.clone() for k, v in base.items()}
    applier = DeltaApplier(layout, [live[e.name] for e in layout.entries], 2)
    applier.apply(slot, dv.header.clone(), 1)
    assert same_bits(live, new)


def test_one_part_comes_once_every_tensor_is_done():
    base = model(3)
    _, snaps, enc = encoder_at(base, changed(base, 4))
    parts: list = []
    dv, _ = enc.encode(snaps[1], 1, snaps[0], 0, 0, 1, parts.append)
    assert len(parts) == 1 and rows_of(parts[0]) == rows_of(dv.runs)
    assert sum(len(r) for _, r in dv.runs) > 10


def test_a_tensor_whose_sample_changed_past_varint_max_is_diffed_as_a_bitmask():
    """11% of one tensor changed (alone its varints are the smaller positions), 1% of the
    others: after the sample the 11% one is a bitmask and the others varints; its payload
    applies bit for bit. The sample is used once: an unsampled diff makes the varints again."""
    base = model(10)
    new = {k: v.clone() for k, v in base.items()}
    g = torch.Generator().manual_seed(11)
    for k, v in new.items():
        if v.is_floating_point():
            flat = v.view(-1)
            n = flat.numel() * (11 if k == "layer.5" else 1) // 100
            flat[torch.randperm(flat.numel(), generator=g)[:n]] += 1
    layout, snaps, enc = encoder_at(base, new)
    enc.crossover = 0.3
    names = [e.name for e in layout.entries]
    at = names.index("layer.5")
    unsampled, _ = enc.encode(snaps[1], 1, snaps[0], 0, 0, 1)
    assert unsampled.kinds[at] == Kind.VARINT
    enc.predicts_dense(snaps[0])
    dv, _ = enc.encode(snaps[1], 1, snaps[0], 0, 0, 1)
    assert dv.kinds[at] == Kind.BITMASK and dv.changed == unsampled.changed
    assert all(k == Kind.VARINT for i, k in enumerate(dv.kinds) if i != at and layout.entries[i].name != "step")
    e = layout.entries[at]
    offset, payload_bytes, count, pos_bytes, kind = dv.sparse[at]
    live = base["layer.5"].clone()
    refusal, _, _ = native.scatter(live.data_ptr(), e.numel, 2, enc._staging.data_ptr() + offset, payload_bytes,
                                   int(kind), count, pos_bytes, True)
    assert refusal == native.Refusal.OK and torch.equal(live.view(torch.int16), new["layer.5"].view(torch.int16))
    again, _ = enc.encode(snaps[1], 1, snaps[0], 0, 0, 1)
    assert again.kinds[at] == Kind.VARINT


def test_a_version_that_went_dense_whole_is_not_handed_out():
    """Every tensor above the crossover: no delta, so the pushes send the version whole, and
    the diff hands out nothing in one part (none of it twice over the wire)."""
    base = model(8)
    new = changed(base, 9)
    _, snaps, enc = encoder_at(base, new)
    enc.crossover = 0.001  # below the 1% every float tensor changed
    parts: list = []
    dv, _ = enc.encode(snaps[1], 1, snaps[0], 0, 0, 1, parts.append)
    assert not dv.is_delta and all(k == Kind.DENSE for k in dv.kinds)
    assert parts == [] and sum(len(r) for _, r in dv.runs) == len(dv.kinds)  # recorded, not handed out


def test_what_ready_raises_ends_the_diff():
    base = model(5)
    _, snaps, enc = encoder_at(base, changed(base, 6))

    def ready(part) -> None:
        raise RuntimeError("the push side is gone")

    with pytest.raises(RuntimeError, match="the push side is gone"):
        enc.encode(snaps[1], 1, snaps[0], 0, 0, 1, ready, parts=8)


@pytest.mark.parametrize("free_cores", [False, True], ids=["one-part", "parts"])
async def test_pushed_in_parts_every_subscriber_holds_every_version(monkeypatch, free_cores):
    """Over tcp, a publisher whose diff leaves cores free (the host's core count seen as above
    the diff's threads) sends each version's encodings in several puts, one that does not in
    one; two subscribers hold every version bit for bit, as deltas from the second on."""
    if free_cores:
        monkeypatch.setattr(pipeline_module, "cores", lambda: 64)
    store = f"memory://{uuid.uuid4().hex}"
    live = model(7)
    subs_state = {n: {k: torch.zeros_like(v) for k, v in live.items()} for n in ("gen-0", "gen-1")}
    async with transport.Transport("trainer", store=store, backends=("tcp",)) as tt, \
            transport.Transport("gen-0", store=store, backends=("tcp",)) as t0, \
            transport.Transport("gen-1", store=store, backends=("tcp",)) as t1:
        async with Publisher(tt, live, delta=True, delta_crossover=CROSSOVER) as pub, \
                Subscriber(t0, subs_state["gen-0"], publisher="trainer") as s0, \
                Subscriber(t1, subs_state["gen-1"], publisher="trainer") as s1:
            assert pub._pipeline.parts == (8 if free_cores else 1)
            for v in range(1, 6):
                if v > 1:
                    for k, x in changed(live, 10 + v, dense="norm" if v == 3 else None).items():
                        live[k].copy_(x)
                r = await pub.publish(v)
                assert all(r.results[n].delta == (v > 1) for n in ("gen-0", "gen-1")), (v, r.results)
                for s in (s0, s1):
                    assert await s.wait_version(v, timeout=30) == v
                assert all(same_bits(st, live) for st in subs_state.values()), v
            slot_puts = [rec for rec in tt.flight_record()["records"]
                         if rec["op"] == "put" and rec["peer"] == "gen-0" and ".slot" in rec["key"]]
            # Version 1 is dense (one prepared put); each delta is one put per part and source:
            # the encodings, and the snapshot for what travels dense ("step", every time). The
            # header goes beside the slot, to its own region.
            if free_cores:
                assert len(slot_puts) >= 1 + 4 * 3, len(slot_puts)
            else:
                assert len(slot_puts) == 1 + 4 * 2, len(slot_puts)
