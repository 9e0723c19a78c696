"""Mesh sync between real processes: two trainer ranks (sharded and replicated tensors) and
generator replicas of different TP degrees (tests/peers/mesh_peer.py), driven round by round."""

from __future__ import annotations

import signal

import anyio
import pytest

import transport
from tests._support import Target


@pytest.fixture
def procs(tmp_path):
    """Starts tests/peers/mesh_peer.py processes (tests._support.Target), each reaped at the end."""
    made: list[Target] = []

    def make(spec: dict) -> Target:
        made.append(Target(tmp_path, spec, module="tests.peers.mesh_peer", out=f"{spec['name']}-{len(made)}.json"))
        return made[-1]

    yield make
    for p in made:
        p.close()


async def _round(ctl: transport.Transport, names: list[str], version: int, timeout: float = 90) -> None:
    """Rings ``go`` = version + 1 at ``names`` and waits until each answered ``done``."""
    for n in names:
        await ctl.signal(n, "go", version + 1)
    for n in names:
        await ctl.wait_signal(f"{n}.done", at_least=version + 1, timeout=timeout)


async def _start(ctl: transport.Transport, names: list[str]) -> None:
    for n in names:
        await ctl.wait_signal(f"{n}.ready", timeout=90)


async def _lockstep(procs, store: str, n: int, only: dict[str, dict] | None = None, **kw) -> dict[str, dict]:
    """Two trainer ranks and the GENERATORS, ``n`` versions round by round (``kw`` goes to
    every process's spec, ``only[name]`` to that generator's too); returns every process's
    results."""
    async with transport.Transport("ctl", store=store, backends=tuple(kw.get("backends", ("ipc",)))) as ctl:
        trainers = [procs(_spec(store, f"t{r}", "trainer", n, rank=r, **kw)) for r in range(2)]
        gens = [procs(_spec(store, g, "gen", n, replica=rep, rank=k, size=size, **kw, **(only or {}).get(g, {})))
                for g, rep, k, size in GENERATORS]
        await _start(ctl, [p.name for p in trainers + gens])
        for v in range(n):
            await _round(ctl, ["t0", "t1"], v)
            await _round(ctl, [g[0] for g in GENERATORS], v)
        for p in trainers + gens:
            await ctl.signal(p.name, "exit", 1)
        return {p.name: await p.result() for p in trainers + gens}


def _spec(store: str, name: str, role: str, versions: int, **kw) -> dict:
    return {"name": name, "role": role, "store": store, "backends": ["ipc"], "versions": versions, **kw}


def _have(backend: str) -> None:
    if why := transport.backends.REGISTRY[backend].unavailable_reason():
        pytest.skip(f"{backend} unavailable: {why}")


GENERATORS = [("A0", "A", 0, 2), ("A1", "A", 1, 2), ("B0", "B", 0, 1)]


@pytest.mark.parametrize("backend", ["ipc", "tcp", "ucx"])
async def test_every_rank_of_every_replica_gets_its_exact_slices_each_version(procs, file_store, backend):
    _have(backend)
    results = await _lockstep(procs, file_store, 3, backends=[backend])
    for r in ("t0", "t1"):
        for v, rep in enumerate(results[r]["reports"]):
            assert {k: x[0] for k, x in rep.items()} == {"A/0": "DONE", "A/1": "DONE", "B/0": "DONE"}, (r, v, rep)
    for g, *_ in GENERATORS:
        for v, rnd in enumerate(results[g]["rounds"]):
            assert rnd["applied"] == v and rnd["ok"] is True, (g, rnd)


async def test_a_slow_rank_holds_back_only_its_replica_and_its_ranks_agree(procs, file_store):
    # A1 applies each version 1.5 s after it was committed. Versions 1 and 2 are published
    # meanwhile: version 2 goes to slot 0, which at A1 still holds the committed, unapplied
    # version 0, so A1 is skipped (a straggler) and replica A cannot commit version 2 later.
    # Replica B gets every version.
    n = 4
    gen_names = [g[0] for g in GENERATORS]
    async with transport.Transport("ctl", store=file_store, backends=("ipc",)) as ctl:
        trainers = [procs(_spec(file_store, f"t{r}", "trainer", n, rank=r)) for r in range(2)]
        gens = [procs(_spec(file_store, g, "gen", n, replica=rep, rank=k, size=size, commit_wait=1.0,
                            slow_s=1.5 if g == "A1" else 0))
                for g, rep, k, size in GENERATORS]
        await _start(ctl, [p.name for p in trainers + gens])
        await _round(ctl, ["t0", "t1"], 0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_round, ctl, gen_names, 0)
            await anyio.sleep(0.5)  # A0 committed and applied 0; A1 is still sleeping before its apply
            await _round(ctl, ["t0", "t1"], 1)
            await _round(ctl, ["t0", "t1"], 2)
        await _round(ctl, gen_names, 1)
        await _round(ctl, gen_names, 2)
        await _round(ctl, ["t0", "t1"], 3)
        await _round(ctl, gen_names, 3)
        for p in trainers + gens:
            await ctl.signal(p.name, "exit", 1)
        results = {p.name: await p.result(timeout=120) for p in trainers + gens}
    a0, a1, b0 = ([r["applied"] for r in results[g]["rounds"]] for g in ("A0", "A1", "B0"))
    for g in ("A0", "A1", "B0"):
        assert all(r["ok"] is True for r in results[g]["rounds"]), results[g]  # exactly that version's slices
    assert a0 == a1 == [0, 1, 1, 3]  # the ranks of A always agree; version 2 never reached all of A
    assert b0 == [0, 2, 2, 3]  # B commits the newest complete version: 2 was out by its round 1
    for t in ("t0", "t1"):
        reports = results[t]["reports"]
        assert reports[2]["A/1"][0] == "STRAGGLER" and "committed" in reports[2]["A/1"][1], reports[2]
        assert reports[2]["A/0"][0] == "DONE" and reports[2]["B/0"][0] == "DONE"


@pytest.mark.parametrize("delta", [False, True], ids=["dense", "delta"])
async def test_a_killed_generator_rank_fails_only_its_replica_then_pulls_and_rejoins(procs, file_store, delta):
    # With deltas: the restarted A1 holds what it pulled (version 1) and what came dense, and
    # takes deltas on them like any rank (versions 4 and 5). The trainer ranks warm() before
    # every publish: the pushes into ranks (re)joining since, two slots each.
    n = 6 if delta else 4
    kw = {"delta": True, "sparse": 0.02, "warm": True} if delta else {"warm": True}
    async with transport.Transport("ctl", store=file_store, backends=("ipc",)) as ctl:
        trainers = [procs(_spec(file_store, f"t{r}", "trainer", n, rank=r, deadline=5.0, **kw)) for r in range(2)]
        gens = {g: procs(_spec(file_store, g, "gen", n, replica=rep, rank=k, size=size, commit_wait=2.0, **kw))
                for g, rep, k, size in GENERATORS}
        await _start(ctl, [p.name for p in [*trainers, *gens.values()]])
        await _round(ctl, ["t0", "t1"], 0)
        await _round(ctl, list(gens), 0)
        gens["A1"].proc.send_signal(signal.SIGKILL)
        gens["A1"].proc.wait(timeout=30)
        await _round(ctl, ["t0", "t1"], 1)  # replica A now fails at A/1; B goes on
        await _round(ctl, ["A0", "B0"], 1)
        # A1 restarts under its name, pulls version 1 from the trainer ranks' snapshots and rejoins.
        gens["A1"] = procs(_spec(file_store, "A1", "gen", n, replica="A", rank=1, size=2, first=2, pull=True,
                                 ready_value=2, **kw))
        await ctl.wait_signal("A1.ready", at_least=2, timeout=90)
        for v in range(2, n):
            await _round(ctl, ["t0", "t1"], v)
            await _round(ctl, list(gens), v)
        for p in [*trainers, *gens.values()]:
            await ctl.signal(p.name, "exit", 1)
        results = {p.name: await p.result(timeout=120) for p in [*trainers, *gens.values()]}
    # While A1 is dead, replica A is incomplete and not served; B is.
    assert results["t0"]["incomplete"][1] == ["A"] and set(results["t0"]["reports"][1]) == {"B/0"}
    # Every trainer rank reports A1's death once, at the first publish after it (A0, alive in
    # the incomplete replica, has not left); its restart under the name is served as new.
    for r in ("t0", "t1"):
        assert results[r]["departed"] == [{"left": [], "dead": []}, {"left": [], "dead": ["A1"]}] + \
            [{"left": [], "dead": []}] * (n - 2), (r, results[r]["departed"])
    # Warmed: every rank's two slots; nothing new; A0 and the restarted A1 again (replica A
    # was not served while A1 was dead); then nothing new.
    for r in ("t0", "t1"):
        assert results[r]["warmed"] == [6, 0, 4] + [0] * (n - 3), (r, results[r]["warmed"])
    assert results["t0"]["reports"][1]["B/0"][0] == "DONE"
    a0 = results["A0"]["rounds"]
    assert a0[1]["applied"] == 0  # version 1 never complete at A1: A stays on 0
    assert results["A1"]["rounds"][0] == {"pulled": 1}
    assert [r["applied"] for r in results["B0"]["rounds"]] == list(range(n))
    for g in gens:
        rounds = [r for r in results[g]["rounds"] if "version" in r]
        assert rounds[-1]["applied"] == n - 1 and all(r["ok"] is True for r in rounds if r["applied"] is not None), \
            (g, rounds)
    if delta:
        a1 = [r for r in results["A1"]["rounds"] if "version" in r]
        assert [r["delta"][0] for r in a1 if r["version"] >= 4] == [2, 2], a1


async def test_a_trainer_rank_killed_mid_push_fails_that_version_everywhere(procs, file_store):
    n = 2
    async with transport.Transport("ctl", store=file_store, backends=("ipc",)) as ctl:
        t0 = procs(_spec(file_store, "t0", "trainer", n, rank=0, die_at=1))
        t1 = procs(_spec(file_store, "t1", "trainer", n, rank=1))
        gens = [procs(_spec(file_store, g, "gen", n, replica=rep, rank=k, size=size, commit_wait=2.0))
                for g, rep, k, size in GENERATORS]
        await _start(ctl, ["t0", "t1", *[g[0] for g in GENERATORS]])
        await _round(ctl, ["t0", "t1"], 0)
        await _round(ctl, [g[0] for g in GENERATORS], 0)
        await ctl.signal("t0", "go", 2)
        await ctl.signal("t1", "go", 2)
        await ctl.wait_signal("t1.done", at_least=2, timeout=60)
        with anyio.fail_after(60):
            while t0.proc.poll() is None:
                await anyio.sleep(0.05)
        assert t0.proc.returncode == -signal.SIGKILL
        await _round(ctl, [g[0] for g in GENERATORS], 1)
        for p in [t1, *gens]:
            await ctl.signal(p.name, "exit", 1)
        results = {p.name: await p.result(timeout=120) for p in [t1, *gens]}
    for g, *_ in GENERATORS:
        rounds = results[g]["rounds"]
        assert rounds[1]["applied"] == 0 and rounds[1]["ok"] is True, (g, rounds)  # never a partial version 1


@pytest.mark.parametrize("delta", [False, True], ids=["dense", "delta"])
async def test_fp8_block_scales_made_at_the_source_across_shards_dequantize_within_e4m3_error(procs, file_store,
                                                                                               delta):
    # w8 (300 x 260) is sharded on its rows over the two trainer ranks, which cuts a row of
    # 128x128 blocks in two: each rank's FP8 values must still equal a whole-tensor quantizer's
    # bit for bit (mesh_peer checks), which needs the other rank's part of each block's maximum.
    # With delta sync and small updates: the requantized FP8 bytes travel as deltas where the
    # runs allow, and stay bit for bit either way.
    n = 5 if delta else 2
    kw = {"delta": True, "sparse": 0.02} if delta else {}
    results = await _lockstep(procs, file_store, n, fp8=True, **kw)
    for g, *_ in GENERATORS:
        assert [(r["applied"], r["ok"]) for r in results[g]["rounds"]] == [(v, True) for v in range(n)], results[g]


def _dense_bytes(results: dict, trainer: str, label: str) -> int:
    """Bytes ``trainer`` writes into ``label`` for a dense version (its first)."""
    return results[trainer]["reports"][0][label][3]


@pytest.mark.parametrize(("backend", "delta"), [("ipc", True), ("tcp", "auto"), ("ipc", "auto")])
async def test_small_updates_go_as_deltas_and_every_rank_stays_bit_exact(procs, file_store, backend, delta):
    # Each version sets 2% of every tensor anew. Versions 0-2 go dense (no base in that slot
    # yet, or no delta area at the ranks yet); from version 3 every rank holds the base in the
    # slot, so each trainer rank sends only the changed units of its runs. By default ("auto")
    # only over a network: over ipc every version goes dense.
    _have(backend)
    n = 6
    results = await _lockstep(procs, file_store, n, backends=[backend], delta=delta, sparse=0.02)
    deltas = delta is True or backend != "ipc"
    for g, *_ in GENERATORS:
        rounds = results[g]["rounds"]
        assert [(r["applied"], r["ok"]) for r in rounds] == [(v, True) for v in range(n)], (g, rounds)
        assert all(r["delta"][0] == (2 if deltas else 0) for r in rounds[3:]), (g, rounds)
    if not deltas:
        assert all(not x[2] for t in ("t0", "t1") for rep in results[t]["reports"] for x in rep.values())
        return
    for t in ("t0", "t1"):
        reports, changed = results[t]["reports"], results[t]["changed"]
        for v in range(3, n):
            f = changed[v]
            assert f is not None and 0 < f < 0.1, (t, v, changed)
            for label, (status, _, delta, nbytes) in reports[v].items():
                assert status == "DONE" and delta is True, (t, v, label, reports[v][label])
                # at most 2 f of the dense bytes, plus the 64-byte header and the alignment
                assert nbytes <= 2 * f * _dense_bytes(results, t, label) + 64 + 8, (t, v, label, nbytes, f)


async def test_a_delta_against_a_base_the_slot_does_not_hold_is_refused_whole(procs, file_store):
    # A1 does not read version 3 (a delta it never applies into slot 1), then a scribbled MAT
    # word says it did. Version 5 comes into slot 1 as a delta against 3: the checksum of the
    # slot's bytes is not version 3's, so A1 refuses it and keeps version 4, then pulls 5.
    results = await _lockstep(procs, file_store, 6, only={"A1": {"skip_apply_at": 3}}, delta=True, sparse=0.02)
    a1 = results["A1"]["rounds"]
    assert results["t0"]["reports"][5]["A/1"][2] is True  # sent as a delta (the words said so)
    assert "does not hold version 3" in a1[5]["refused"], a1[5]
    assert a1[5]["kept"] == 4  # refused whole: still on version 4
    assert a1[5]["applied"] == 5 and a1[5]["ok"] is True  # then pulled, bit for bit
    for g in ("A0", "B0"):
        rounds = results[g]["rounds"]
        assert all(r["ok"] is True and "refused" not in r for r in rounds), rounds
