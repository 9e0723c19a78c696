"""A flow-level network simulator: how long a set of point-to-point transfers takes on a GPU cluster.

``python -m transport.plan simulate`` feeds it the bytes every trainer GPU sends to every generator
GPU under a plan and reports the makespan beside the floor no schedule can beat.

The model, and what it leaves out:

* GPUs are numbered ``0 .. N-1``; GPU ``g`` lives on node ``g // gpus_per_node``.
* Every GPU has a NIC of its own, full duplex: an egress and an ingress resource, each of
  ``nic_gbps`` (Gbit/s; ``gbps * 1e9 / 8`` bytes/s). There is no switch fabric: the network core
  is assumed non-blocking (full bisection), so only the NICs at the two ends limit a flow.
* A flow between two GPUs of one node takes NVLink instead and no NIC: the source GPU's NVLink
  egress and the destination GPU's NVLink ingress, each of ``nvlink_gbps`` per GPU and direction.
* A flow from a GPU to itself is a local copy: it takes no time and no resource; its bytes are
  reported as ``bytes_local`` (and counted in ``bytes_total``).
* Flows with the same ``(src, dst)`` are one connection: they are merged (bytes summed) first.
* A flow may also be a path or a tree of *hops* (:func:`simulate_hops`): a relay GPU forwards
  what it receives to further GPUs. Every hop of a flow carries all of its bytes at the flow's
  one rate, and each hop loads its own two ends (so a GPU that forwards to ``m`` GPUs puts ``m``
  times the rate on its egress). That is cut-through forwarding in a fluid model: a relay sends a
  byte on as it arrives, adds no store-and-forward delay, and no hop runs ahead of or behind the
  others (no buffering lets a fast leg finish early or a slow one lag). Pipeline fill, one chunk
  per hop, is left out with the other latencies.
* All flows start at ``t = 0`` and share every resource max-min fairly (progressive filling, or
  water-filling); whenever flows finish, the rates of the others are recomputed (event-driven).
* Rates are fluid: no packets, no latency, no per-message overhead, no congestion control, no
  incast losses, and every flow instantly takes its fair share. The makespan is therefore an
  idealised, close to lower-bound, estimate of what a well-behaved fabric achieves; real runs are
  slower by their per-transfer latencies and protocol overheads.

``floor_s``, the bound no schedule of these flows can beat, is the largest ``bytes through a
resource / its capacity`` over all resources (NVLink hops counted against NVLink capacity).
Max-min sharing reaches it exactly when the busiest resource is busy all the time (a balanced
all-to-all); the gap ``makespan_s - floor_s`` is what fair sharing of an unbalanced plan loses
to an ideal schedule.

Cost: one max-min computation per event (the flows that finish together, within ``rtol`` of the
event time), vectorised over the (flow, resource) pairs still running; a relayed flow costs one
pair per resource it crosses. A planner's plan has few distinct sizes and takes few events:
256 x 128 = 32,768 flows of real plans take 2 to ~750 events and under a second. Flows of
all-different sizes are the worst case: one event each, so time grows with the square of the
flows (random sizes, on a busy 2-core machine: 256 x 128 in about a minute); ``rtol=1e-3`` cuts
that to ~10 s and moves the makespan by ~0.15%.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["GpuBytes", "Network", "SimResult", "simulate", "simulate_hops"]

#: The four resources of a GPU, in the order of their blocks of resource ids (``kind * N + gpu``).
_KINDS = ("NIC egress", "NIC ingress", "NVLink egress", "NVLink ingress")

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Network:
    """The cluster: GPUs per node, one NIC per GPU, NVLink inside a node.

    Args:
        gpus_per_node: GPUs per node; GPU ``g`` is on node ``g // gpus_per_node``.
        nic_gbps: each GPU's NIC, per direction (Gbit/s).
        nvlink_gbps: each GPU's NVLink, per direction (Gbit/s; H100/H200 NVLink is about
            450 GB/s = 3600 Gbit/s).

    Raises:
        ValueError: ``gpus_per_node`` is not a positive integer, or a rate is not a positive,
            finite number.
    """

    gpus_per_node: int = 8
    nic_gbps: float = 400.0
    nvlink_gbps: float = 3600.0

    def __post_init__(self) -> None:
        if not (_is_number(self.gpus_per_node, integral=True) and self.gpus_per_node >= 1):
            raise ValueError(f"gpus_per_node must be a positive integer, got {self.gpus_per_node!r}")
        for name in ("nic_gbps", "nvlink_gbps"):
            value = getattr(self, name)
            if not (_is_number(value) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive, finite number of Gbit/s, got {value!r}")

    @property
    def nic_bytes_per_s(self) -> float:
        """A NIC's rate per direction in bytes/s."""
        return float(self.nic_gbps) * 1e9 / 8

    @property
    def nvlink_bytes_per_s(self) -> float:
        """A GPU's NVLink rate per direction in bytes/s."""
        return float(self.nvlink_gbps) * 1e9 / 8


@dataclass(frozen=True)
class GpuBytes:
    """Bytes through each GPU's four resources, as tuples indexed by GPU id (``0 .. N-1``, N one
    more than the highest GPU a hop names; zeros where nothing passes)."""

    nic_out: tuple[int, ...] = ()
    nic_in: tuple[int, ...] = ()
    nvlink_out: tuple[int, ...] = ()
    nvlink_in: tuple[int, ...] = ()


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` found. Byte counts are after merging flows of one ``(src, dst)``;
    for :func:`simulate_hops` they count every hop (a relayed byte counts once per hop).

    Attributes:
        makespan_s: when the last flow finishes under max-min fair sharing (s).
        floor_s: the largest ``bytes through a resource / its capacity`` (s): no schedule is faster.
        bytes_total: all bytes, local copies included.
        bytes_over_nics: bytes between GPUs of different nodes.
        bytes_over_nvlink: bytes between different GPUs of one node.
        bytes_local: bytes a GPU sends to itself (no time, no resource).
        flows: distinct ``(src, dst)`` pairs that carry bytes, local copies included (for
            :func:`simulate_hops`: the flows that carry bytes over at least one hop).
        events: max-min rate computations (one per set of flows finishing together).
        nic_out_bytes_max: the most bytes one GPU sends over its NIC.
        nic_out_bytes_min_nonzero: the fewest, over the GPUs that send over their NIC at all.
        nic_in_bytes_max: the most bytes one GPU receives over its NIC.
        nic_in_bytes_min_nonzero: the fewest, over the GPUs that receive over their NIC at all.
        busiest_resource: the resource that sets ``floor_s``, e.g. ``"gpu 12 NIC egress"``
            (``"none"`` when nothing crosses a NIC or NVLink).
        per_gpu: the bytes through every GPU's NIC and NVLink, each direction (left out of
            :meth:`as_dict`, which stays a fixed set of numbers).
    """

    makespan_s: float
    floor_s: float
    bytes_total: int
    bytes_over_nics: int
    bytes_over_nvlink: int
    bytes_local: int
    flows: int
    events: int
    nic_out_bytes_max: int
    nic_out_bytes_min_nonzero: int
    nic_in_bytes_max: int
    nic_in_bytes_min_nonzero: int
    busiest_resource: str
    per_gpu: GpuBytes = dataclasses.field(default=GpuBytes(), repr=False)

    def as_dict(self) -> dict[str, float | int | str]:
        """The scalar fields as a JSON-ready dict, in declaration order (``per_gpu`` left out).

        Returns:
            ``{field name: value}`` for every field but ``per_gpu``.
        """
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "per_gpu"}


def simulate(src: npt.ArrayLike, dst: npt.ArrayLike, nbytes: npt.ArrayLike, network: Network, *,
             rtol: float = 1e-9) -> SimResult:
    """Times a set of flows that all start at once, sharing the network max-min fairly.

    See the module docstring for the model. Flows with the same ``(src, dst)`` are merged first;
    flows of zero bytes are ignored.

    Args:
        src: source GPU of each flow (1-D integers >= 0).
        dst: destination GPU of each flow (1-D integers >= 0, as long as ``src``).
        nbytes: bytes of each flow (1-D integers >= 0, as long as ``src``).
        network: the cluster.
        rtol: flows due to finish within ``rtol * t`` of the first completion at time ``t`` finish
            together, at the latest of them (a flow is reported at most that much late; no byte
            is dropped, so ``makespan_s >= floor_s`` up to rounding). The default only absorbs
            rounding, so that symmetric flows finish in one event; a larger one (1e-3) merges
            close completions of a plan of all-different sizes into fewer events.

    Returns:
        The makespan, the floor and the byte counts (all zero when there are no flows).

    Raises:
        TypeError: an input does not hold integers, or ``network`` is not a :class:`Network`.
        ValueError: inputs that are not 1-D or not of one length, a negative GPU id or size, or an
            ``rtol`` that is negative or not finite.
    """
    _check(network, rtol)
    s = _integers("src", src)
    d = _integers("dst", dst)
    b = _integers("nbytes", nbytes)
    if not (s.size == d.size == b.size):
        raise ValueError(f"src, dst and nbytes must have one length, got {s.size}, {d.size} and {b.size}")
    s, d, b = _merge(s, d, b)
    return _simulate(np.arange(s.size, dtype=np.int64), s, d, b, network, rtol)


def simulate_hops(flow: npt.ArrayLike, src: npt.ArrayLike, dst: npt.ArrayLike, nbytes: npt.ArrayLike,
                  network: Network, *, rtol: float = 1e-9) -> SimResult:
    """Times flows that each cross one or more hops (a relay's path or tree), all starting at once.

    Hop ``i`` carries flow ``flow[i]`` from GPU ``src[i]`` to GPU ``dst[i]``; every hop of a flow
    carries all of its ``nbytes[flow]`` at the flow's one rate (cut-through, see the module
    docstring), and a hop listed twice carries them twice. Each flow is one connection: unlike
    :func:`simulate`, nothing is merged. A hop from a GPU to itself is a local copy (no time, no
    resource); flows of zero bytes, and hops of such flows, are ignored.

    Args:
        flow: the flow of each hop (1-D integers in ``0 .. len(nbytes) - 1``).
        src: the GPU each hop leaves (1-D integers >= 0, as long as ``flow``).
        dst: the GPU each hop reaches (1-D integers >= 0, as long as ``flow``).
        nbytes: bytes of each flow (1-D integers >= 0).
        network: the cluster.
        rtol: as for :func:`simulate`.

    Returns:
        The makespan, the floor (relay hops counted on every resource they cross, NVLink against
        NVLink capacity) and the byte counts per hop.

    Raises:
        TypeError: an input does not hold integers, or ``network`` is not a :class:`Network`.
        ValueError: inputs that are not 1-D, hop arrays not of one length, a flow id out of range,
            a negative GPU id or size, or a bad ``rtol``.
    """
    _check(network, rtol)
    f = _integers("flow", flow)
    s = _integers("src", src)
    d = _integers("dst", dst)
    b = _integers("nbytes", nbytes)
    if not (f.size == s.size == d.size):
        raise ValueError(f"flow, src and dst must have one length, got {f.size}, {s.size} and {d.size}")
    if f.size and int(f.max()) >= b.size:
        raise ValueError(f"flow ids must be below len(nbytes) = {b.size}, got {int(f.max())}")
    return _simulate(f, s, d, b, network, rtol)


def _check(network: Network, rtol: float) -> None:
    if not isinstance(network, Network):
        raise TypeError(f"network must be a Network, got {type(network).__name__}")
    if not (math.isfinite(rtol) and rtol >= 0):
        raise ValueError(f"rtol must be a finite number >= 0, got {rtol!r}")


def _simulate(f: IntArray, s: IntArray, d: IntArray, b: IntArray, network: Network, rtol: float) -> SimResult:
    """The hops (flow ``f``, ``s`` -> ``d``) of flows of ``b`` bytes, validated."""
    keep = b[f] > 0
    f, s, d = f[keep], s[keep], d[keep]
    n = int(max(s.max(), d.max())) + 1 if s.size else 0
    hop_bytes = b[f]
    local = s == d
    g = network.gpus_per_node
    nvlink = (s // g == d // g) & ~local
    bytes_local = int(hop_bytes[local].sum())
    bytes_over_nvlink = int(hop_bytes[nvlink].sum())
    bytes_over_nics = int(hop_bytes[~local & ~nvlink].sum())
    flows = int(np.unique(f).size)

    f, s, d, nvlink = f[~local], s[~local], d[~local], nvlink[~local]
    if s.size == 0:
        zeros = (0,) * n
        return SimResult(0.0, 0.0, bytes_local, 0, 0, bytes_local, flows, 0, 0, 0, 0, 0, "none",
                         GpuBytes(zeros, zeros, zeros, zeros))

    # Resource ids kind * n + gpu (_KINDS), renumbered densely over the resources in use; one
    # entry per (flow, resource) with the number of its hops through that resource as weight.
    r_out = np.where(nvlink, 2 * n + s, s)
    r_in = np.where(nvlink, 3 * n + d, n + d)
    ids, inverse = np.unique(np.concatenate([r_out, r_in]), return_inverse=True)
    inverse = inverse.reshape(-1).astype(np.int64)
    active, flow_of_hop = np.unique(f, return_inverse=True)  # flows renumbered 0 .. F-1
    flow_of_hop = flow_of_hop.reshape(-1).astype(np.int64)
    pair, weight = np.unique(np.concatenate([flow_of_hop, flow_of_hop]) * ids.size + inverse, return_counts=True)
    ef, er = pair // ids.size, pair % ids.size  # sorted by flow
    rem = b[active]
    cap = np.where(ids < 2 * n, network.nic_bytes_per_s, network.nvlink_bytes_per_s)

    load = np.zeros(ids.size, np.int64)  # exact bytes through each resource
    np.add.at(load, er, weight * rem[ef])
    busy = load / cap
    busiest = int(np.argmax(busy))
    kind, gpu = divmod(int(ids[busiest]), n)
    per_kind = []
    for k in range(len(_KINDS)):
        full = np.zeros(n, np.int64)
        mine = (ids >= k * n) & (ids < (k + 1) * n)
        full[ids[mine] - k * n] = load[mine]
        per_kind.append(full)
    nic_out, nic_in = load[ids < n], load[(ids >= n) & (ids < 2 * n)]

    makespan, events = _run(ef, er, weight.astype(np.float64), cap, rem.astype(np.float64), rtol)
    return SimResult(
        makespan_s=makespan,
        floor_s=float(busy[busiest]),
        bytes_total=bytes_local + bytes_over_nvlink + bytes_over_nics,
        bytes_over_nics=bytes_over_nics,
        bytes_over_nvlink=bytes_over_nvlink,
        bytes_local=bytes_local,
        flows=flows,
        events=events,
        nic_out_bytes_max=int(nic_out.max()) if nic_out.size else 0,
        nic_out_bytes_min_nonzero=int(nic_out.min()) if nic_out.size else 0,
        nic_in_bytes_max=int(nic_in.max()) if nic_in.size else 0,
        nic_in_bytes_min_nonzero=int(nic_in.min()) if nic_in.size else 0,
        busiest_resource=f"gpu {gpu} {_KINDS[kind]}",
        per_gpu=GpuBytes(*(tuple(int(x) for x in a) for a in per_kind)),
    )


def _is_number(value: object, *, integral: bool = False) -> bool:
    """Whether ``value`` is a real number (an integer if ``integral``), bools excluded."""
    kinds = (int, np.integer) if integral else (int, float, np.integer, np.floating)
    return isinstance(value, kinds) and not isinstance(value, bool)


def _integers(name: str, values: npt.ArrayLike) -> IntArray:
    """``values`` as a 1-D int64 array of entries >= 0 (ValueError/TypeError naming ``name``)."""
    a = np.asarray(values)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size == 0:
        return np.zeros(0, np.int64)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    if a.dtype.kind == "u" and int(a.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} has an entry beyond int64: {int(a.max())}")
    a = a.astype(np.int64, copy=False)
    negative = np.flatnonzero(a < 0)
    if negative.size:
        i = int(negative[0])
        raise ValueError(f"{name} must be >= 0: {name}[{i}] is {int(a[i])} ({negative.size} negative in all)")
    return a


def _merge(s: IntArray, d: IntArray, b: IntArray) -> tuple[IntArray, IntArray, IntArray]:
    """One flow per ``(src, dst)`` with the summed bytes, zero-byte flows dropped, sorted by pair."""
    keep = b > 0
    s, d, b = s[keep], d[keep], b[keep]
    if s.size == 0:
        return s, d, b
    order = np.lexsort((d, s))
    s, d, b = s[order], d[order], b[order]
    first = np.ones(s.size, bool)
    first[1:] = (s[1:] != s[:-1]) | (d[1:] != d[:-1])
    starts = np.flatnonzero(first)
    return s[starts], d[starts], np.add.reduceat(b, starts)




def _run(ef: IntArray, er: IntArray, ew: FloatArray, cap: FloatArray, rem: FloatArray,
         rtol: float) -> tuple[float, int]:
    """The event loop: max-min rates, advance to the next completions, drop them, repeat.

    Flow ``f`` (``0 .. F-1``, ``rem[f] > 0`` bytes) puts ``ew[e] * rate`` on resource ``er[e]``
    for each entry ``e`` with ``ef[e] == f`` (entries sorted by flow, every flow has one);
    ``cap`` holds the capacities. Returns ``(makespan, events)``.
    """
    t = 0.0
    events = 0
    rate = np.zeros(rem.size)
    kept: npt.NDArray[np.bool_] | None = None  # flows whose rate the next computation keeps
    while rem.size:
        _max_min_rates(ef, er, ew, cap, rate, kept)
        events += 1
        if not (rate > 0).all() or not np.isfinite(rate).all():  # unreachable with positive capacities
            raise RuntimeError("netsim: a flow got no bandwidth; the model is inconsistent")
        until = rem / rate
        first = float(until.min())
        # Flows finishing within rtol of the event time finish together, at the latest of them:
        # none is cut short, so every byte is carried and the makespan never beats the floor.
        done = until <= first + rtol * (t + first)  # at least the first: each event ends >= 1 flow
        dt = max(float(until[done].max()), 0.0)
        t += dt
        # Progressive filling without the finished flows runs as before up to the smallest rate
        # among them: the rates below it stay, and the next computation keeps them.
        level = float(rate[done].min())
        going = ~done
        rem = rem[going] - rate[going] * dt  # > 0: these were due after dt
        rate = rate[going]
        stays = going[ef]
        ef, er, ew = (np.cumsum(going) - 1)[ef[stays]], er[stays], ew[stays]
        kept = rate < level
    return t, events


def _max_min_rates(ef: IntArray, er: IntArray, ew: FloatArray, cap: FloatArray, rate: FloatArray,
                   kept: npt.NDArray[np.bool_] | None) -> None:
    """Max-min fair rates of the flows (entries ``ef``, ``er``, ``ew`` as in :func:`_run`),
    written into ``rate``.

    Flows where ``kept`` is true keep the rate they have (the caller guarantees that they keep
    it in the max-min allocation); the others are filled in.

    Progressive filling, in parallel rounds: a resource's fair share is its capacity left over
    the weights of the flows through it that are not yet fixed. A resource whose share is no
    larger than that of every resource it shares a flow with saturates at that share before any
    of its flows is fixed elsewhere (shares only grow as flows are fixed below them), so all such
    resources fix their flows in one round. The resource of the smallest share always qualifies,
    so every round fixes at least one flow.
    """
    n_res = cap.size
    left = cap.copy()
    if kept is not None and kept.any():
        ke = kept[ef]
        left -= np.bincount(er[ke], ew[ke] * rate[ef[ke]], minlength=n_res)
        ke = ~ke
        uf, ur, uw = ef[ke], er[ke], ew[ke]
    else:
        uf, ur, uw = ef, er, ew
    wsum = np.bincount(ur, uw, minlength=n_res)
    first = np.flatnonzero(np.concatenate(([True], uf[1:] != uf[:-1])))  # each flow's first entry
    runs = np.diff(np.append(first, uf.size))  # and its number of entries
    with np.errstate(divide="ignore", invalid="ignore"):  # resources with no flow left: unused
        while uf.size:
            share = left / wsum
            es = share[ur]
            lowest = np.minimum.reduceat(es, first)  # each flow's smallest share
            at_lowest = np.repeat(lowest, runs)
            # A flow blocks every resource of a larger share than its smallest: those cannot
            # saturate first.
            blocked = np.bincount(ur[es > at_lowest], minlength=n_res)
            fix = np.logical_or.reduceat(blocked[ur] == 0, first)
            if not fix.any():  # unreachable: the smallest share is always ready
                raise RuntimeError("netsim: progressive filling made no progress")
            rate[uf[first[fix]]] = lowest[fix]
            fixed = np.repeat(fix, runs)
            fr, fw = ur[fixed], uw[fixed]
            left -= np.bincount(fr, fw * at_lowest[fixed], minlength=n_res)
            wsum -= np.bincount(fr, fw, minlength=n_res)
            rest = ~fixed
            uf, ur, uw = uf[rest], ur[rest], uw[rest]
            runs = runs[~fix]
            first = np.cumsum(runs) - runs
