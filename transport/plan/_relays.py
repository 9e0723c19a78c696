"""How a plan's bytes reach the generator GPUs: straight from the trainer ranks, through relay
GPUs inside each generator host, or along a chain of hosts. The routes are trees of hops that
:func:`._netsim.simulate_hops` times; nothing here moves bytes.

What a GPU needs. A generator GPU needs, for each *piece key* of its layout (global tensor,
global box, dtype), the bytes its plan's moves bring into the pieces of that key, from each
trainer rank. GPUs need a key *identically* when they have the key and the same byte total for
it: TP rank ``k`` of replicas with one layout, every GPU of a TP=1 engine, a tensor every TP rank
holds whole (norms). Which trainer ranks send it may differ between them (a shared part is cut
per replica), so a relayed key comes as the plan of its group's lowest GPU sends it.

The three fan-outs (:class:`Fanout`), all deterministic:

* ``direct``: every GPU receives its own plan from the trainer ranks (one hop per trainer rank
  and GPU). What mesh sync does without relays.
* ``host``: on each generator host, a key that several of its GPUs need identically (a *group*)
  crosses the host's NICs once. Each part of it (the bytes one trainer rank sends toward that
  key) goes to one *relay* of the group, which forwards it over NVLink to the group's other GPUs.
  The relay of a part is the group's GPU with the fewest bytes arriving over its NIC so far, the
  lowest GPU on a tie; parts are placed largest first, after every GPU's unshared bytes. So the
  relaying spreads over the host's GPUs and its NICs carry the host's distinct bytes once, in
  about equal shares.
* ``chain``: a key needed identically on several hosts leaves the trainer ranks once; the hosts,
  in ascending order, pass each part on from the relay of one host to the relay of the next
  (each relay chosen as for ``host``, each forwarding over NVLink inside its host too), so every
  host's egress carries it once more, except the last one's.

A key that only one GPU needs (one of its host for ``host``, one of the job for ``chain``) goes
direct.

Forwarding is cut-through: a relay passes each byte on as it arrives, so a relayed part is one
flow over all of its hops at one rate (see :mod:`._netsim`).
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from ._boxes import Box, contains
from ._layouts import Piece, Replica
from ._planner import Plan

#: A piece key: (global tensor name, global box, dtype).
Key = tuple[str, Box, str]
#: What each generator GPU needs: ``needs[gpu][key][trainer rank] = bytes``.
Needs = Mapping[int, Mapping[Key, Mapping[int, int]]]
IntArray = npt.NDArray[np.int64]
#: A route: its hops ``(from GPU, to GPU)``, sorted; every hop carries all of the route's bytes.
Route = tuple[tuple[int, int], ...]


class Fanout(enum.Enum):
    """How a version's bytes reach the generator GPUs (see the module docstring)."""

    DIRECT = "direct"
    HOST = "host"
    CHAIN = "chain"


class Relays(enum.Enum):
    """Which fan-outs ``python -m transport.plan simulate`` times beside the direct plan
    (``off``: none; ``auto``: host and chain, the fastest chosen)."""

    OFF = "off"
    HOST = "host"
    CHAIN = "chain"
    AUTO = "auto"

    @property
    def fanouts(self) -> tuple[Fanout, ...]:
        """The fan-outs simulated, direct first."""
        more = {Relays.OFF: (), Relays.HOST: (Fanout.HOST,), Relays.CHAIN: (Fanout.CHAIN,),
                Relays.AUTO: (Fanout.HOST, Fanout.CHAIN)}[self]
        return (Fanout.DIRECT, *more)


def needs_of(plan: Plan, replicas: Sequence[Replica], first_gpu: int) -> dict[int, dict[Key, dict[int, int]]]:
    """What every generator GPU needs and from which trainer rank, by piece key.

    Args:
        plan: the plan of ``replicas``.
        replicas: the replicas, placed on consecutive GPUs from ``first_gpu`` in replica order,
            ranks in TP order.
        first_gpu: the GPU of the first replica's rank 0.

    Returns:
        ``{gpu: {key: {trainer rank: bytes}}}`` (see :data:`Needs`).

    Raises:
        KeyError: ``plan`` holds no plan for one of ``replicas``.
    """
    out: dict[int, dict[Key, dict[int, int]]] = {}
    gpu = first_gpu
    for replica in replicas:
        for layout, rank_plan in zip(replica.ranks, plan.replicas[replica.id].ranks, strict=True):
            places: dict[tuple[str, str], list[tuple[Piece, str]]] = defaultdict(list)
            for lt in layout.tensors:
                for p in lt.pieces:
                    places[(lt.name, p.name)].append((p, lt.dtype))
            mine: dict[Key, dict[int, int]] = {}
            for m in rank_plan.moves:
                candidates = places[(m.dst_tensor, m.name)]
                # Pieces of one local tensor are disjoint: the move lands in exactly one.
                piece, dtype = candidates[0] if len(candidates) == 1 else next(
                    (p, dt) for p, dt in candidates if contains(p.local, m.dst_box) and contains(p.box, m.box))
                by_src = mine.setdefault((piece.name, piece.box, dtype), {})
                by_src[m.src] = by_src.get(m.src, 0) + m.nbytes
            out[gpu] = mine
            gpu += 1
    return out


def routes(needs: Needs, fanout: Fanout, gpus_per_node: int) -> dict[Route, int]:
    """The routes of every byte the generator GPUs need, under ``fanout``.

    Args:
        needs: what each generator GPU needs (:func:`needs_of`); trainer rank ``s`` is GPU ``s``.
        fanout: the fan-out (see the module docstring).
        gpus_per_node: GPU ``g`` is on host ``g // gpus_per_node``.

    Returns:
        ``{route: bytes}``; routes with the same hops are one (their bytes summed).
    """
    out: dict[Route, int] = defaultdict(int)
    if fanout is Fanout.DIRECT:
        for gpu, keys in needs.items():
            for by_src in keys.values():
                for src, n in by_src.items():
                    out[((src, gpu),)] += n
        return dict(out)

    # Groups of GPUs that need a key identically: per host, or across hosts for a chain.
    groups: dict[tuple[int, Key, int], list[int]] = defaultdict(list)
    for gpu in sorted(needs):
        for key, by_src in needs[gpu].items():
            where = gpu // gpus_per_node if fanout is Fanout.HOST else -1
            groups[(where, key, sum(by_src.values()))].append(gpu)
    arriving: dict[int, int] = defaultdict(int)  # bytes each GPU receives over its NIC so far
    parts: list[tuple[int, Key, int, int, list[int]]] = []
    for (_, key, _), members in groups.items():
        by_src = needs[members[0]][key]
        if len(members) == 1:
            for src, n in by_src.items():
                out[((src, members[0]),)] += n
                arriving[members[0]] += n
        else:
            parts.extend((n, key, src, members[0], members) for src, n in by_src.items())
    parts.sort(key=lambda p: (-p[0], p[1], p[2], p[3]))
    for n, _, src, _, members in parts:
        hops: list[tuple[int, int]] = []
        previous = src
        for host_members in _by_host(members, gpus_per_node):
            relay = min(host_members, key=lambda g: (arriving[g], g))
            arriving[relay] += n
            hops.append((previous, relay))
            hops.extend((relay, g) for g in host_members if g != relay)
            previous = relay
        out[tuple(sorted(hops))] += n
    return dict(out)


def hop_arrays(routed: Mapping[Route, int]) -> tuple[IntArray, IntArray, IntArray, IntArray]:
    """``routed`` as the ``(flow, src, dst, nbytes)`` arrays of :func:`._netsim.simulate_hops`,
    routes in sorted order."""
    flow, src, dst, nbytes = [], [], [], []
    for i, route in enumerate(sorted(routed)):
        nbytes.append(routed[route])
        for a, b in route:
            flow.append(i)
            src.append(a)
            dst.append(b)
    return (np.array(flow, dtype=np.int64), np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64),
            np.array(nbytes, dtype=np.int64))


def _by_host(gpus: list[int], gpus_per_node: int) -> list[list[int]]:
    """Sorted ``gpus`` cut into runs of one host each, hosts in ascending order."""
    out: list[list[int]] = []
    for g in gpus:
        if out and out[-1][0] // gpus_per_node == g // gpus_per_node:
            out[-1].append(g)
        else:
            out.append([g])
    return out
