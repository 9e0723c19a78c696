"""The flow-level network simulator (transport.plan._netsim): hand-computed cases, a textbook
reference implementation on random instances (flows of one hop, and relayed flows: paths and
trees of hops at one rate), input validation and a cluster-sized run."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict

import numpy as np
import pytest

from transport.plan._netsim import Network, SimResult, simulate, simulate_hops

NET = Network()  # 8 GPUs per node, 400 Gbit/s NICs, 3600 Gbit/s NVLink
NIC = 400e9 / 8  # bytes/s
NVLINK = 3600e9 / 8
B = 10**9


def test_one_flow_takes_bytes_over_rate() -> None:
    r = simulate([0], [8], [B], NET)
    assert r.makespan_s == pytest.approx(B / NIC, rel=1e-12)
    assert r.floor_s == pytest.approx(B / NIC, rel=1e-12)
    assert r.events == 1
    assert r.flows == 1
    assert (r.bytes_total, r.bytes_over_nics, r.bytes_over_nvlink, r.bytes_local) == (B, B, 0, 0)
    assert r.busiest_resource == "gpu 0 NIC egress"  # egress and ingress tie; the first one is named


def test_two_flows_sharing_an_egress_each_get_half() -> None:
    r = simulate([0, 0], [8, 16], [B, B], NET)
    assert r.makespan_s == pytest.approx(2 * B / NIC, rel=1e-12)
    assert r.events == 1  # they finish together
    assert r.busiest_resource == "gpu 0 NIC egress"
    assert r.nic_out_bytes_max == r.nic_out_bytes_min_nonzero == 2 * B
    assert r.nic_in_bytes_max == r.nic_in_bytes_min_nonzero == B


def test_max_min_gives_the_leftover_to_a_flow_bottlenecked_nowhere_else() -> None:
    # GPU 1's egress carries three flows: C/3 each. GPU 8's ingress carries 1 -> 8 (C/3, fixed
    # at GPU 1) and 0 -> 8, which takes the leftover 2C/3 (not an equal C/2). At t = 3B/C the
    # three finish; 0 -> 8 has sent 2B of its 3B and sends the last B at C: 4B/C in all.
    # With an equal split at GPU 8 it would have been 1.5B + 1.5B/C later: 4.5B/C.
    r = simulate([1, 1, 1, 0], [8, 16, 24, 8], [B, B, B, 3 * B], NET)
    assert r.makespan_s == pytest.approx(4 * B / NIC, rel=1e-12)
    assert r.events == 2
    assert r.floor_s == pytest.approx(4 * B / NIC, rel=1e-12)
    assert r.busiest_resource == "gpu 8 NIC ingress"


def test_flow_inside_a_node_takes_nvlink() -> None:
    r = simulate([0], [5], [B], NET)
    assert r.makespan_s == pytest.approx(B / NVLINK, rel=1e-12)
    assert (r.bytes_over_nics, r.bytes_over_nvlink) == (0, B)
    assert r.busiest_resource == "gpu 0 NVLink egress"
    assert r.nic_out_bytes_max == r.nic_in_bytes_max == 0

    # NVLink and NIC are separate resources: an NVLink flow does not slow a NIC flow down.
    both = simulate([0, 0], [5, 8], [B, B], NET)
    assert both.makespan_s == pytest.approx(B / NIC, rel=1e-12)
    assert (both.bytes_over_nics, both.bytes_over_nvlink) == (B, B)

    # gpus_per_node decides what is a node: with 4, GPU 5 is on another node than GPU 0.
    r4 = simulate([0], [5], [B], Network(gpus_per_node=4))
    assert r4.makespan_s == pytest.approx(B / NIC, rel=1e-12)
    assert r4.busiest_resource == "gpu 0 NIC egress"


def test_local_copy_takes_no_time() -> None:
    r = simulate([3], [3], [B], NET)
    assert (r.makespan_s, r.floor_s, r.events, r.flows) == (0.0, 0.0, 0, 1)
    assert (r.bytes_total, r.bytes_local, r.bytes_over_nics, r.bytes_over_nvlink) == (B, B, 0, 0)
    assert r.busiest_resource == "none"

    mixed = simulate([3, 3], [3, 12], [5 * B, B], NET)
    assert mixed.makespan_s == pytest.approx(B / NIC, rel=1e-12)
    assert (mixed.bytes_total, mixed.bytes_local, mixed.bytes_over_nics, mixed.flows) == (6 * B, 5 * B, B, 2)


def test_balanced_all_to_all_reaches_the_floor() -> None:
    # 16 GPUs (nodes 0, 1) each send the same to each of 8 GPUs (node 2): every ingress carries
    # 16 flows, every egress 8; the ingresses are busy all the time.
    src = np.repeat(np.arange(16), 8)
    dst = np.tile(np.arange(16, 24), 16)
    r = simulate(src, dst, np.full(src.size, 12_345_678), NET)
    assert r.makespan_s == pytest.approx(r.floor_s, rel=1e-9)
    assert r.floor_s == pytest.approx(16 * 12_345_678 / NIC, rel=1e-12)
    assert r.events == 1
    assert r.busiest_resource.endswith("NIC ingress")

    # The other way round the egresses are the bottleneck.
    back = simulate(dst, src, np.full(src.size, 12_345_678), NET)
    assert back.makespan_s == pytest.approx(back.floor_s, rel=1e-9)
    assert back.busiest_resource.endswith("NIC egress")


def test_duplicate_pairs_are_merged_into_one_flow() -> None:
    merged = simulate([0, 0, 1, 0], [8, 8, 8, 8], [B, 2 * B, B, 0], NET)
    single = simulate([0, 1], [8, 8], [3 * B, B], NET)
    assert merged == single
    assert merged.flows == 2
    # Merged, 0 -> 8 and 1 -> 8 share GPU 8 at C/2 until 1 -> 8 ends (2B/C), then 0 -> 8 has 2B
    # left at C: 4B/C. Two separate 0 -> 8 connections would have taken 2/3 of GPU 8 instead.
    assert merged.makespan_s == pytest.approx(4 * B / NIC, rel=1e-12)


def test_per_nic_extremes_and_busiest_resource() -> None:
    r = simulate([0, 1, 0, 2], [8, 8, 16, 3], [100, 300, 50, 1000], NET)
    assert (r.nic_out_bytes_max, r.nic_out_bytes_min_nonzero) == (300, 150)
    assert (r.nic_in_bytes_max, r.nic_in_bytes_min_nonzero) == (400, 50)
    assert r.busiest_resource == "gpu 8 NIC ingress"
    assert r.floor_s == pytest.approx(400 / NIC, rel=1e-12)
    assert (r.bytes_total, r.bytes_over_nics, r.bytes_over_nvlink) == (1450, 450, 1000)


def test_no_flows_gives_zeros() -> None:
    for args in (([], [], []), ([0, 1], [8, 9], [0, 0]), (np.zeros(0, np.int64),) * 3):
        r = simulate(*args, NET)
        assert r.makespan_s == r.floor_s == 0.0
        assert r.bytes_total == r.flows == r.events == r.nic_out_bytes_max == r.nic_in_bytes_min_nonzero == 0
        assert r.busiest_resource == "none"


def test_as_dict_is_json_ready() -> None:
    r = simulate([0, 1], [8, 9], [B, 2 * B], NET)
    d = r.as_dict()
    assert list(d) == [f.name for f in dataclasses.fields(SimResult) if f.name != "per_gpu"]  # per GPU: Python only
    assert d["makespan_s"] == r.makespan_s and d["busiest_resource"] == r.busiest_resource
    assert json.loads(json.dumps(d)) == d


def test_inputs_may_be_lists_or_any_integer_arrays() -> None:
    ref = simulate([0, 1], [8, 9], [B, 2 * B], NET)
    for dtype in (np.int32, np.uint16, np.uint64, np.int64):
        assert simulate(np.array([0, 1], dtype), np.array([8, 9], dtype), np.array([B, 2 * B], np.int64), NET) == ref


@pytest.mark.parametrize(
    ("src", "dst", "nbytes", "match"),
    [
        ([0, 1], [8], [1, 1], "one length"),
        ([0], [8], [-1], r"nbytes must be >= 0: nbytes\[0\] is -1"),
        ([0, -2], [8, 8], [1, 1], r"src must be >= 0: src\[1\] is -2"),
        ([0], [-8], [1], "dst must be >= 0"),
        ([[0]], [[8]], [[1]], "1-D"),
    ],
)
def test_bad_flows_raise_value_error(src: list, dst: list, nbytes: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        simulate(src, dst, nbytes, NET)


def test_bad_types_and_settings_raise() -> None:
    with pytest.raises(TypeError, match="nbytes must hold integers"):
        simulate([0], [8], [1.5], NET)
    with pytest.raises(TypeError, match="network must be a Network"):
        simulate([0], [8], [1], {"nic_gbps": 400})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rtol"):
        simulate([0], [8], [1], NET, rtol=-1e-9)
    with pytest.raises(ValueError, match="nic_gbps"):
        Network(nic_gbps=0)
    with pytest.raises(ValueError, match="nic_gbps"):
        Network(nic_gbps=float("nan"))
    with pytest.raises(ValueError, match="nvlink_gbps"):
        Network(nvlink_gbps=-1.0)
    with pytest.raises(ValueError, match="gpus_per_node"):
        Network(gpus_per_node=0)


# ---- a textbook reference: one resource at a time, pure Python ----------------------------------


def _reference_makespan(src: list[int], dst: list[int], nbytes: list[int], net: Network) -> float:
    """Event-driven max-min sharing written the plain way: merge the pairs, then share as
    :func:`_reference_hops` does (each flow one hop)."""
    merged: dict[tuple[int, int], int] = defaultdict(int)
    for s, d, n in zip(src, dst, nbytes, strict=True):
        if n and s != d:
            merged[(s, d)] += n
    return _reference_hops([[f] for f in merged], list(merged.values()), net)


@pytest.mark.parametrize("seed", range(40))
def test_matches_the_reference_and_never_beats_the_floor(seed: int) -> None:
    rng = np.random.default_rng(seed)
    net = Network(gpus_per_node=int(rng.integers(1, 5)), nic_gbps=float(rng.choice([100, 400])),
                  nvlink_gbps=float(rng.choice([200, 3600])))
    n_flows = int(rng.integers(1, 40))
    n_gpus = int(rng.integers(2, 16))
    src = rng.integers(0, n_gpus, n_flows)
    dst = rng.integers(0, n_gpus, n_flows)
    sizes = rng.integers(0, 1000, n_flows) if seed % 2 else rng.choice([0, 100, 300, 700], n_flows)
    r = simulate(src, dst, sizes, net)
    assert r.makespan_s == pytest.approx(_reference_makespan(src.tolist(), dst.tolist(), sizes.tolist(), net), rel=1e-9)
    assert r.floor_s <= r.makespan_s * (1 + 1e-12)  # the floor is a true bound; the slack is rounding
    assert r.bytes_total == int(sizes.sum()) == r.bytes_local + r.bytes_over_nics + r.bytes_over_nvlink
    assert r.events <= r.flows


def test_a_larger_rtol_takes_fewer_events_and_still_carries_every_byte() -> None:
    rng = np.random.default_rng(7)
    src = np.repeat(np.arange(12), 6)
    dst = np.tile(np.arange(16, 22), 12)
    sizes = rng.integers(1, 10**6, src.size)
    exact = simulate(src, dst, sizes, NET)
    coarse = simulate(src, dst, sizes, NET, rtol=1e-2)
    assert exact.events > exact.flows // 2  # all-different sizes: about one completion per event
    assert coarse.events < exact.events
    assert coarse.floor_s <= coarse.makespan_s * (1 + 1e-12)
    assert coarse.makespan_s == pytest.approx(exact.makespan_s, rel=0.05)


def test_cluster_scale_256_by_128() -> None:
    # Trainer GPUs 0..255 (nodes 0..31) to generator GPUs 256..383 (nodes 32..47); a plan's bytes
    # come in few sizes. This only checks that the vectorised simulation gets through it.
    rng = np.random.default_rng(0)
    src = np.repeat(np.arange(256), 128)
    dst = np.tile(np.arange(256, 384), 256)
    sizes = rng.choice([3 << 20, 7 << 20, 12 << 20, 40 << 20], src.size)
    r = simulate(src, dst, sizes, NET)
    assert r.flows == 256 * 128
    assert r.bytes_total == r.bytes_over_nics == int(sizes.sum())
    assert 0 < r.floor_s <= r.makespan_s * (1 + 1e-12)
    assert 1 <= r.events <= r.flows


# ---- relayed flows: one flow over several hops, at one rate --------------------------------------


def test_a_relay_forwards_at_the_rate_it_receives() -> None:
    # 0 -> 8 over NICs, 8 -> 9 and 8 -> 10 over NVLink: one flow, the NIC sets its rate.
    r = simulate_hops([0, 0, 0], [0, 8, 8], [8, 9, 10], [B], NET)
    assert r.makespan_s == pytest.approx(B / NIC, rel=1e-12)
    assert r.flows == 1
    assert (r.bytes_over_nics, r.bytes_over_nvlink, r.bytes_total) == (B, 2 * B, 3 * B)
    assert r.per_gpu.nic_out[0] == r.per_gpu.nic_in[8] == B
    assert r.per_gpu.nvlink_out[8] == 2 * B  # a relay's egress carries one copy per GPU it feeds
    assert r.per_gpu.nvlink_in[9] == r.per_gpu.nvlink_in[10] == B
    assert sum(r.per_gpu.nic_in) == B


def test_a_relay_whose_nvlink_is_the_bottleneck_slows_its_whole_flow() -> None:
    # NVLink as slow as a NIC: the relay forwards to three GPUs, so its NVLink egress carries
    # three times the flow's rate: C/3, and the NIC leg waits for it (cut-through, no buffer).
    net = Network(nvlink_gbps=400.0)
    r = simulate_hops([0] * 4, [0, 8, 8, 8], [8, 9, 10, 11], [B], net)
    assert r.makespan_s == pytest.approx(3 * B / NIC, rel=1e-12)
    assert r.floor_s == pytest.approx(3 * B / NIC, rel=1e-12)
    assert r.busiest_resource == "gpu 8 NVLink egress"


def test_a_chain_carries_one_copy_per_hop_at_one_rate() -> None:
    # Trainer GPU 0 -> host 1 (GPU 8) -> host 2 (GPU 16) -> host 3 (GPU 24), beside a direct flow
    # 1 -> 16 that shares GPU 16's ingress: both get C/2 until the direct one ends.
    r = simulate_hops([0, 0, 0, 1], [0, 8, 16, 1], [8, 16, 24, 16], [B, B], NET)
    assert r.makespan_s == pytest.approx(2 * B / NIC, rel=1e-12)
    assert r.events == 1
    assert r.per_gpu.nic_out[:2] == (B, B)
    assert (r.per_gpu.nic_out[8], r.per_gpu.nic_out[16], r.per_gpu.nic_out[24]) == (B, B, 0)
    assert r.per_gpu.nic_in[16] == 2 * B


def test_one_hop_flows_time_as_simulate_does() -> None:
    rng = np.random.default_rng(3)
    src = rng.integers(0, 24, 60)
    dst = rng.integers(0, 24, 60)
    sizes = rng.choice([0, 10**6, 3 * 10**6, 7 * 10**6], 60)
    pairs: dict[tuple[int, int], int] = defaultdict(int)
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
        if n:
            pairs[(s, d)] += n
    ps = sorted(pairs)
    hops = simulate_hops(np.arange(len(ps)), [s for s, _ in ps], [d for _, d in ps], [pairs[p] for p in ps], NET)
    assert hops == simulate(src, dst, sizes, NET)


def test_bad_hops_raise() -> None:
    with pytest.raises(ValueError, match="one length"):
        simulate_hops([0, 0], [0], [8, 9], [B], NET)
    with pytest.raises(ValueError, match="below len"):
        simulate_hops([0, 1], [0, 0], [8, 9], [B], NET)
    with pytest.raises(ValueError, match="flow must be >= 0"):
        simulate_hops([-1], [0], [8], [B], NET)


def _reference_hops(flows: list[list[tuple[int, int]]], nbytes: list[int], net: Network) -> float:
    """Max-min sharing of flows over several hops, the plain way: a flow puts its rate on both
    ends of every hop (once per hop), fix the flows of the resource with the smallest fair share
    (capacity left over the hop count of its unfixed flows), advance to the next completions."""
    g = net.gpus_per_node
    use: list[dict[tuple[str, int], int]] = []
    for hops in flows:
        u: dict[tuple[str, int], int] = defaultdict(int)
        for s, d in hops:
            if s == d:
                continue
            kind = "nvl" if s // g == d // g else "nic"
            u[(f"{kind}-out", s)] += 1
            u[(f"{kind}-in", d)] += 1
        use.append(dict(u))
    rem = {i: float(n) for i, n in enumerate(nbytes) if n and use[i]}
    cap = {r: (net.nvlink_gbps if r[0].startswith("nvl") else net.nic_gbps) * 1e9 / 8 for u in use for r in u}
    t = 0.0
    while rem:
        left, rate, unfixed = dict(cap), {}, set(rem)
        while unfixed:
            weight: dict[tuple[str, int], int] = defaultdict(int)
            for f in sorted(unfixed):
                for r, w in use[f].items():
                    weight[r] += w
            bottleneck = min(weight, key=lambda r: left[r] / weight[r])
            share = left[bottleneck] / weight[bottleneck]
            for f in [f for f in sorted(unfixed) if bottleneck in use[f]]:
                rate[f] = share
                unfixed.discard(f)
                for r, w in use[f].items():
                    left[r] -= share * w
        until = {f: rem[f] / rate[f] for f in rem}
        first = min(until.values())
        done = [f for f in rem if until[f] <= first + 1e-9 * (t + first)]
        dt = max(until[f] for f in done)
        t += dt
        for f in done:
            del rem[f]
        for f in rem:
            rem[f] -= rate[f] * dt
    return t


@pytest.mark.parametrize("seed", range(30))
def test_relayed_flows_match_the_reference(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    net = Network(gpus_per_node=int(rng.integers(2, 5)), nic_gbps=float(rng.choice([100, 400])),
                  nvlink_gbps=float(rng.choice([200, 3600])))
    n_gpus = int(rng.integers(4, 16))
    flows: list[list[tuple[int, int]]] = []
    for _ in range(int(rng.integers(1, 25))):
        at = [int(rng.integers(0, n_gpus))]  # a random tree: each hop leaves a GPU already reached
        hops = []
        for _ in range(int(rng.integers(1, 6))):
            s = at[int(rng.integers(0, len(at)))]
            d = int(rng.integers(0, n_gpus))
            hops.append((s, d))
            at.append(d)
        flows.append(hops)
    sizes = (rng.integers(0, 1000, len(flows)) if seed % 2 else rng.choice([0, 100, 300, 700], len(flows))).tolist()
    f = [i for i, hops in enumerate(flows) for _ in hops]
    r = simulate_hops(f, [s for hops in flows for s, _ in hops], [d for hops in flows for _, d in hops], sizes, net)
    assert r.makespan_s == pytest.approx(_reference_hops(flows, sizes, net), rel=1e-9)
    assert r.floor_s <= r.makespan_s * (1 + 1e-12)
    hop_bytes = sum(n * len(hops) for n, hops in zip(sizes, flows, strict=True))
    assert r.bytes_total == hop_bytes == r.bytes_local + r.bytes_over_nics + r.bytes_over_nvlink
    assert sum(r.per_gpu.nic_out) == sum(r.per_gpu.nic_in) == r.bytes_over_nics
    assert sum(r.per_gpu.nvlink_out) == sum(r.per_gpu.nvlink_in) == r.bytes_over_nvlink
