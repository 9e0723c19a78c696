"""Random trainer and generator layouts for the planner tests, and a numpy executor of plans.

Also a script: ``python -m tests.plan._cases SEED ORDER`` prints the sha256 of the plan of case
SEED, built with its tensors and pieces listed in shuffled order ORDER (another "rank").
"""

from __future__ import annotations

import hashlib
import itertools
import random
import sys

import numpy as np

from transport.plan import (
    ExplicitSharding,
    GeneratorRank,
    LocalTensor,
    MeshSharding,
    Piece,
    Plan,
    Planner,
    Replica,
    Replicate,
    Shard,
    TensorSpec,
    TrainerLayout,
    full_box,
)

MESHES = [(4,), (2, 2), (3, 2), (2, 3), (5,), (2, 2, 2)]


def _random_box(rng: random.Random, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    out = []
    for n in shape:
        lo = rng.randrange(n)
        out.append((lo, rng.randrange(lo + 1, n + 1)))
    return tuple(out)


def random_trainer(rng: random.Random, n_tensors: int = 6) -> TrainerLayout:
    """Tensors of 1-3 dims (uneven sizes) on random meshes of Shard/Replicate placements, and
    some listed explicitly with duplicate holders."""
    mesh = rng.choice(MESHES)
    nranks = int(np.prod(mesh))
    ranks = list(range(nranks))
    rng.shuffle(ranks)
    specs = []
    for i in range(n_tensors):
        ndim = rng.choice([1, 2, 2, 3])
        shape = tuple(rng.randint(1, 13) for _ in range(ndim))
        if rng.random() < 0.25:  # explicit: cut dim 0, every part held by one or two ranks
            cuts = sorted(rng.sample(range(1, shape[0]), min(shape[0] - 1, rng.randint(0, 3)))) if shape[0] > 1 else []
            bounds = [0, *cuts, shape[0]]
            pairs: list[tuple[int, tuple[tuple[int, int], ...]]] = []
            free = list(range(nranks))
            rng.shuffle(free)
            for lo, hi in itertools.pairwise(bounds):
                box = ((lo, hi), *full_box(shape[1:]))
                held = [free.pop() for _ in range(min(len(free), rng.choice([1, 1, 2])))]
                if not held:  # more parts than ranks: the whole tensor on rank 0 instead
                    pairs = [(0, full_box(shape))]
                    break
                pairs += [(r, box) for r in held]
            sharding: ExplicitSharding | MeshSharding = ExplicitSharding(tuple(sorted(pairs)))
        else:
            placements = tuple(Shard(rng.randrange(ndim)) if rng.random() < 0.7 else Replicate() for _ in mesh)
            sharding = MeshSharding(mesh, placements, tuple(ranks))
        specs.append(TensorSpec(f"t{i}", shape, rng.choice(["float32", "bfloat16"]), sharding))
    return TrainerLayout.of(specs)


def random_rank(rng: random.Random, trainer: TrainerLayout) -> GeneratorRank:
    """Local tensors made of fused row blocks, EP-like stacks of 2-D boxes, and whole copies."""
    specs = list(trainer.tensors)
    twod = [t for t in specs if len(t.shape) == 2]
    out = []
    for j in range(rng.randint(1, 4)):
        kind = rng.choice(["fused", "stacked", "whole"]) if twod else "whole"
        dtype = rng.choice(["float32", "bfloat16"])
        pieces = []
        if kind == "fused":  # rows of several tensors, one column window, then padding rows
            width = rng.randint(1, min(t.shape[1] for t in twod))
            row = 0
            for _ in range(rng.randint(1, 3)):
                t = rng.choice(twod)
                r0 = rng.randrange(t.shape[0])
                r1 = rng.randint(r0 + 1, t.shape[0])
                c0 = rng.randint(0, t.shape[1] - width)
                pieces.append(Piece(t.name, ((r0, r1), (c0, c0 + width)), ((row, row + r1 - r0), (0, width))))
                row += r1 - r0
            shape: tuple[int, ...] = (row + rng.randint(0, 2), width)
        elif kind == "stacked":  # like experts: k boxes of one shape, each in a slot [e, :, :]
            t = rng.choice(twod)
            a, b = rng.randint(1, t.shape[0]), rng.randint(1, t.shape[1])
            k = rng.randint(1, 3)
            for e in range(k):
                src = rng.choice([u for u in twod if u.shape[0] >= a and u.shape[1] >= b])
                r0, c0 = rng.randint(0, src.shape[0] - a), rng.randint(0, src.shape[1] - b)
                pieces.append(Piece(src.name, ((r0, r0 + a), (c0, c0 + b)), ((e, e + 1), (0, a), (0, b))))
            shape = (k, a, b)
        else:
            t = rng.choice(specs)
            pieces.append(Piece(t.name, full_box(t.shape), full_box(t.shape)))
            shape = t.shape
        out.append(LocalTensor(f"local{j}", shape, dtype, tuple(pieces)))
    return GeneratorRank.of(out)


def random_case(seed: int) -> tuple[TrainerLayout, list[Replica]]:
    rng = random.Random(seed)
    trainer = random_trainer(rng)
    replicas = [Replica(f"rep{i}", tuple(random_rank(rng, trainer) for _ in range(rng.randint(1, 3))))
                for i in range(rng.randint(1, 3))]
    return trainer, replicas


def globals_for(trainer: TrainerLayout, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in trainer.tensors}


def execute(planner: Planner, plan: Plan, replicas: list[Replica], full: dict[str, np.ndarray]
            ) -> dict[tuple[str, int, str], tuple[np.ndarray, np.ndarray]]:
    """Runs ``plan`` with numpy: every trainer rank's shard is cut from ``full`` by its box and
    every move copied run by run. Returns (replica, rank, local tensor) -> (values, writes)."""
    shards: dict[tuple[str, int], np.ndarray] = {}
    for t in planner.trainer.tensors:
        for rank, box in t.sharding.boxes(t.shape).items():
            cut = full[t.name][tuple(slice(lo, hi) for lo, hi in box)]
            shards[(t.name, rank)] = np.ascontiguousarray(cut).reshape(-1)
    out = {}
    for rep in replicas:
        for g, (rank, rp) in enumerate(zip(rep.ranks, plan.replicas[rep.id].ranks, strict=True)):
            locals_ = {lt.name: lt for lt in rank.tensors}
            vals = {n: np.zeros(int(np.prod(lt.shape)), np.float32) for n, lt in locals_.items()}
            writes = {n: np.zeros(int(np.prod(lt.shape)), np.int64) for n, lt in locals_.items()}
            for m in rp.moves:
                src = shards[(m.name, m.src)]
                s, d, n = planner.segments(m, locals_[m.dst_tensor])
                for a, b, c in zip(s.tolist(), d.tolist(), n.tolist(), strict=True):
                    vals[m.dst_tensor][b : b + c] = src[a : a + c]
                    writes[m.dst_tensor][b : b + c] += 1
            for n, lt in locals_.items():
                out[(rep.id, g, n)] = (vals[n].reshape(lt.shape), writes[n].reshape(lt.shape))
    return out


def reference(lt: LocalTensor, full: dict[str, np.ndarray], dtype: type = np.float32
              ) -> tuple[np.ndarray, np.ndarray]:
    """The local tensor built directly from its pieces (values of ``dtype``, and how many pieces
    land on each element)."""
    vals = np.zeros(lt.shape, dtype)
    mask = np.zeros(lt.shape, np.int64)
    for p in lt.pieces:
        dst = tuple(slice(lo, hi) for lo, hi in p.local)
        vals[dst] = full[p.name][tuple(slice(lo, hi) for lo, hi in p.box)].reshape(vals[dst].shape)
        mask[dst] += 1
    return vals, mask


def plan_digest(seed: int, order: int) -> str:
    trainer, replicas = random_case(seed)
    rng = random.Random(order)
    tensors = list(trainer.tensors)
    rng.shuffle(tensors)
    shuffled = [Replica(r.id, tuple(GeneratorRank.of(rng.sample(g.tensors, len(g.tensors))) for g in r.ranks))
                for r in rng.sample(replicas, len(replicas))]
    plan = Planner(TrainerLayout.of(tensors)).plan(shuffled)
    return hashlib.sha256(repr(plan).encode()).hexdigest()


if __name__ == "__main__":
    print(plan_digest(int(sys.argv[1]), int(sys.argv[2])))
