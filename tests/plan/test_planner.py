"""The mesh planner on random layouts: exact coverage, reconstruction, determinism across
processes, balance over duplicate holders, and re-planning one replica only."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.plan._cases import execute, globals_for, plan_digest, random_case, reference
from transport.plan import (
    ITEMSIZE,
    ExplicitSharding,
    GeneratorRank,
    LocalTensor,
    MeshLayoutError,
    MeshSharding,
    Piece,
    Planner,
    Replica,
    Replicate,
    Shard,
    TensorSpec,
    Topology,
    TrainerLayout,
    full_box,
    volume,
)


@pytest.mark.parametrize("seed", range(40))
def test_every_generator_byte_comes_once_and_matches_the_reference_slice(seed):
    trainer, replicas = random_case(seed)
    planner = Planner(trainer)
    plan = planner.plan(replicas)
    full = globals_for(trainer, seed)
    got = execute(planner, plan, replicas, full)
    for rep in replicas:
        for g, rank in enumerate(rep.ranks):
            for lt in rank.tensors:
                values, writes = got[(rep.id, g, lt.name)]
                want, mask = reference(lt, full)
                assert np.array_equal(writes, mask), f"{rep.id}/{g}/{lt.name}: a byte written {writes.max()}x or never"
                assert np.array_equal(values, want)
    # Bytes planned are the bytes the pieces cover, at the destination's dtype.
    for rep in replicas:
        for rank, rp in zip(rep.ranks, plan.replicas[rep.id].ranks, strict=True):
            assert rp.nbytes == sum(volume(p.box) * ITEMSIZE[lt.dtype] for lt in rank.tensors for p in lt.pieces)


@pytest.mark.parametrize("seed", [3, 11])
def test_plans_are_identical_when_computed_by_different_processes_from_shuffled_inputs(seed):
    here = plan_digest(seed, 0)
    others = {subprocess.run([sys.executable, "-m", "tests.plan._cases", str(seed), str(order)], check=True,
                             capture_output=True, text=True, timeout=120).stdout.strip() for order in (1, 2)}
    assert others == {here}


def _hsdp_trainer(dp: int, fsdp: int, nbytes_each: int = 4 << 20) -> TrainerLayout:
    """dp replicas of an fsdp-sharded model (ranks dp-major), a few uneven 2-D tensors."""
    mesh = MeshSharding((dp, fsdp), (Replicate(), Shard(0)), tuple(range(dp * fsdp)))
    rows = [nbytes_each // 4096, nbytes_each // 4096 + 37, 3 * nbytes_each // 4096 // 2]
    return TrainerLayout.of(TensorSpec(f"w{i}", (r, 1024), "float32", mesh) for i, r in enumerate(rows))


def _whole_replica(trainer: TrainerLayout, rid: str, tp: int = 1) -> Replica:
    """tp ranks, each needing a column block of every tensor."""
    ranks = []
    for r in range(tp):
        tensors = []
        for t in trainer.tensors:
            cols = t.shape[1] // tp
            box = ((0, t.shape[0]), (r * cols, (r + 1) * cols))
            piece = Piece(t.name, box, full_box((t.shape[0], cols)))
            tensors.append(LocalTensor(t.name, (t.shape[0], cols), "float32", (piece,)))
        ranks.append(GeneratorRank.of(tensors))
    return Replica(rid, tuple(ranks))


@pytest.mark.parametrize(("dp", "fsdp", "tp"), [(4, 2, 1), (2, 4, 2), (3, 2, 1), (8, 1, 4)])
def test_duplicate_holders_share_the_load_within_five_percent(dp, fsdp, tp):
    trainer = _hsdp_trainer(dp, fsdp)
    planner = Planner(trainer)
    replica = _whole_replica(trainer, "only", tp)
    plan = planner.plan([replica])
    full = globals_for(trainer)
    got = execute(planner, plan, [replica], full)  # parts cut over holders still cover every byte once
    for g, rank in enumerate(replica.ranks):
        for lt in rank.tensors:
            values, writes = got[("only", g, lt.name)]
            want, mask = reference(lt, full)
            assert np.array_equal(writes, mask) and np.array_equal(values, want)
    assert len({m.src for rp in plan.replicas["only"].ranks for m in rp.moves}) == dp * fsdp  # all holders send
    load = plan.load()
    ranks = trainer.ranks()
    # Perfect: every shard group's bytes spread evenly over its dp holders.
    per_rank = [load.get(r, 0) for r in ranks]
    perfect = plan.nbytes / len(ranks)
    assert max(per_rank) <= 1.05 * perfect, (per_rank, perfect)
    # And over several identical replicas together.
    plan3 = planner.plan([_whole_replica(trainer, f"r{i}", tp) for i in range(3)])
    per_rank3 = [plan3.load().get(r, 0) for r in ranks]
    assert max(per_rank3) <= 1.05 * plan3.nbytes / len(ranks)


def test_balancing_counts_a_shared_nic_once():
    # 4 duplicate holders; ranks 0 and 1 share a NIC: together they carry what one NIC should.
    trainer = _hsdp_trainer(4, 1)
    topo = Topology({0: "nicA", 1: "nicA", 2: "nicB", 3: "nicC"})
    plan = Planner(trainer, topo).plan([_whole_replica(trainer, "only")])
    load = plan.load()
    per_nic = {"nicA": load.get(0, 0) + load.get(1, 0), "nicB": load.get(2, 0), "nicC": load.get(3, 0)}
    assert max(per_nic.values()) <= 1.05 * plan.nbytes / 3, per_nic


def test_changing_one_replica_replans_only_that_replica():
    trainer = _hsdp_trainer(2, 2)
    planner = Planner(trainer)
    reps = [_whole_replica(trainer, "a", 1), _whole_replica(trainer, "b", 2), _whole_replica(trainer, "c", 2)]
    first = planner.plan(reps)
    changed = [reps[0], _whole_replica(trainer, "b", 4), reps[2]]  # b restarted with another TP degree
    second = planner.plan(changed, previous=first)
    assert second.replicas["a"] is first.replicas["a"] and second.replicas["c"] is first.replicas["c"]
    assert second.replicas["b"] != first.replicas["b"] and len(second.replicas["b"].ranks) == 4
    # The same as planning from scratch: a replica's plan depends on its own layout only.
    assert Planner(trainer).plan(changed) == second
    # A replica that leaves takes only its own plan with it.
    third = planner.plan(changed[:2], previous=second)
    assert set(third.replicas) == {"a", "b"} and third.replicas["a"] is first.replicas["a"]


def test_bad_layouts_are_refused_before_planning():
    trainer = _hsdp_trainer(1, 2, nbytes_each=1 << 16)
    planner = Planner(trainer)
    w0 = trainer.tensors[0]
    bad = {
        "unknown tensor": Piece("nope", ((0, 1), (0, 1)), ((0, 1), (0, 1))),
        "outside the global tensor": Piece("w0", ((0, w0.shape[0] + 1), (0, 1)), ((0, w0.shape[0] + 1), (0, 1))),
        "shape mismatch": Piece("w0", ((0, 2), (0, 2)), ((0, 4), (0, 1))),
    }
    for why, piece in bad.items():
        rep = Replica("x", (GeneratorRank.of([LocalTensor("l", (w0.shape[0] + 1, 4), "float32", (piece,))]),))
        with pytest.raises(MeshLayoutError):
            planner.plan([rep])
            pytest.fail(f"planned a layout with a piece {why}")
    overlapping = (Piece("w0", ((0, 2), (0, 2)), ((0, 2), (0, 2))), Piece("w1", ((0, 2), (0, 2)), ((1, 3), (0, 2))))
    with pytest.raises(MeshLayoutError, match="overlap"):
        planner.plan([Replica("x", (GeneratorRank.of([LocalTensor("l", (4, 2), "float32", overlapping)]),))])
    with pytest.raises(MeshLayoutError, match="two replicas"):
        planner.plan([_whole_replica(trainer, "same"), _whole_replica(trainer, "same")])
    # A byte no trainer rank holds (an explicit layout with a hole).
    holey = TrainerLayout.of([TensorSpec("h", (4, 2), "float32", ExplicitSharding(((0, ((0, 2), (0, 2))),)))])
    whole = LocalTensor("h", (4, 2), "float32", (Piece("h", full_box((4, 2)), full_box((4, 2))),))
    with pytest.raises(MeshLayoutError, match="held by no trainer rank"):
        Planner(holey).plan([Replica("x", (GeneratorRank.of([whole]),))])
    with pytest.raises(MeshLayoutError):
        MeshSharding((2, 2), (Shard(0),), (0, 1, 2, 3))
    with pytest.raises(MeshLayoutError):
        TrainerLayout.of([TensorSpec("bad", (4,), "complex7", MeshSharding((1,), (Replicate(),), (0,)))])


def test_fp8_block_scales_are_held_by_the_rank_of_each_blocks_first_element():
    from transport.plan import fp8_generator_rank, fp8_trainer_layout

    mesh = MeshSharding((3,), (Shard(0),), (0, 1, 2))
    base = TrainerLayout.of([TensorSpec("w.weight", (300, 260), "bfloat16", mesh),
                             TensorSpec("n.weight", (260,), "bfloat16", mesh)])
    layout = fp8_trainer_layout(base)
    specs = layout.by_name()
    assert specs["w.weight"].dtype == "float8_e4m3fn" and specs["n.weight"].dtype == "bfloat16"
    scale = specs["w.weight_scale_inv"]
    assert scale.shape == (3, 3) and scale.scale_of == "w.weight" and scale.dtype == "float32"
    rows = specs["w.weight"].sharding.boxes((300, 260))  # 100 rows each
    owners = np.zeros((3, 3), np.int64)
    for r, box in scale.sharding.boxes(scale.shape).items():
        owners[tuple(slice(lo, hi) for lo, hi in box)] += 1
        for i in range(*box[0]):
            assert rows[r][0][0] <= 128 * i < rows[r][0][1]  # the rank holding the block's first row
    assert (owners == 1).all()
    # A generator piece must respect the blocks: columns [0, 128) yes, [0, 100) no.
    good = GeneratorRank.of([LocalTensor("w.weight", (300, 128), "float8_e4m3fn",
                                         (Piece("w.weight", ((0, 300), (0, 128)), ((0, 300), (0, 128))),))])
    with_scales = fp8_generator_rank(good, layout)
    assert {t.name: t.shape for t in with_scales.tensors}["w.weight_scale_inv"] == (3, 1)
    Planner(layout).plan([Replica("r", (with_scales,))])
    bad = GeneratorRank.of([LocalTensor("w.weight", (300, 100), "float8_e4m3fn",
                                        (Piece("w.weight", ((0, 300), (0, 100)), ((0, 300), (0, 100))),))])
    with pytest.raises(MeshLayoutError, match="block boundaries"):
        fp8_generator_rank(bad, layout)


def test_plain_tensors_described_by_explicit_boxes_are_merged_across_ranks():
    import torch

    from transport.plan import merge_trainer_layouts, trainer_layout_from_state_dict

    full = torch.arange(40.0).reshape(10, 4)
    # Megatron style: each rank knows only its own box; the layouts are joined.
    per_rank = [
        trainer_layout_from_state_dict({"w": full[:6]}, rank=0, boxes={"w": ((10, 4), ((0, 6), (0, 4)))}),
        trainer_layout_from_state_dict({"w": full[6:]}, rank=1, boxes={"w": ((10, 4), ((6, 10), (0, 4)))}),
    ]
    layout = merge_trainer_layouts(per_rank)
    assert layout.tensors[0].sharding.boxes((10, 4)) == {0: ((0, 6), (0, 4)), 1: ((6, 10), (0, 4))}
    need = LocalTensor("w", (10, 2), "float32", (Piece("w", ((0, 10), (2, 4)), ((0, 10), (0, 2))),))
    replica = Replica("r", (GeneratorRank.of([need]),))
    planner = Planner(layout)
    got = execute(planner, planner.plan([replica]), [replica], {"w": full.numpy()})
    assert np.array_equal(got[("r", 0, "w")][0], full[:, 2:].numpy())
    with pytest.raises(MeshLayoutError):  # a box whose shape is not the tensor's
        trainer_layout_from_state_dict({"w": full[:5]}, rank=0, boxes={"w": ((10, 4), ((0, 6), (0, 4)))})
    with pytest.raises(MeshLayoutError):  # two ranks disagreeing on the global shape
        merge_trainer_layouts([per_rank[0], trainer_layout_from_state_dict(
            {"w": full[6:]}, rank=1, boxes={"w": ((11, 4), ((6, 10), (0, 4)))})])
