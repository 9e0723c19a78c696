"""Relays in the cluster simulation (transport.plan._relays, ``simulate --relays``): the real
planner on tiny models, routed direct, through host relays and along a chain of hosts, timed by
the real network model. Byte counts are checked exactly; no timing thresholds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from transport.plan import ModelConfig, Planner, builtin_model, model_config
from transport.plan._netsim import Network, SimResult, simulate_hops
from transport.plan._relays import Fanout, Needs, Relays, Route, hop_arrays, needs_of, routes
from transport.plan._simulate import choose, job_layouts, parse_generator, run

#: Kimi-K2's architecture (DeepSeek-V3's MLA and MoE) at a size where every FP8 piece of a TP=4
#: rank falls on 128-element blocks, as vLLM's block-quantized layers need.
KIMI_MINI = {"model_type": "kimi_k2", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
             "intermediate_size": 512, "vocab_size": 1024, "n_routed_experts": 8, "moe_intermediate_size": 512,
             "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": 256, "kv_lora_rank": 128,
             "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}

#: (model, trainer, generator, GPUs per node, generator dtype): trainer GPUs first, then the
#: generator replicas in order, so every job below puts several generator GPUs on each host.
JOBS = [
    ("llama-tiny", "fsdp=4", "tp=1,replicas=8", 4, "bfloat16"),  # every GPU needs the whole model
    ("llama-tiny", "fsdp=4", "tp=2,replicas=4", 4, "bfloat16"),  # rank k of two replicas per host
    ("moe-tiny", "dp=2,fsdp=2", "tp=2,replicas=4", 4, "bfloat16"),  # shared parts cut per replica
    ("kimi-mini", "fsdp=8", "tp=4,replicas=4", 2, "float8_e4m3fn"),  # Kimi-K2's shape: TP spans hosts
    ("mla-tiny", "fsdp=4", "tp=2,replicas=8", 4, "bfloat16"),  # few trainer GPUs, many hosts
]


def _cfg(model: str) -> ModelConfig:
    return model_config(KIMI_MINI) if model == "kimi-mini" else builtin_model(model)


def _needs(model: str, trainer: str, generator: str, dtype: str) -> tuple[int, Needs]:
    gen = parse_generator(generator)
    layout, replicas = job_layouts(_cfg(model), trainer, gen, generator_dtype=dtype)
    plan = Planner(layout).plan(replicas)
    n_trainers = len(layout.ranks())
    return n_trainers, needs_of(plan, replicas, n_trainers)


def _simulate(routed: dict[Route, int], gpus_per_node: int) -> SimResult:
    return simulate_hops(*hop_arrays(routed), Network(gpus_per_node=gpus_per_node))


def _distinct(needs: Needs, gpus: list[int]) -> int:
    """Bytes of the keys ``gpus`` need, each (key, byte total) counted once."""
    return sum({(key, sum(by.values())): sum(by.values()) for g in gpus for key, by in needs[g].items()}.values())


@pytest.mark.parametrize("fanout", list(Fanout))
@pytest.mark.parametrize(("model", "trainer", "generator", "per_node", "dtype"), JOBS)
def test_every_gpu_receives_what_it_needs_once_from_a_trainer_rank(model, trainer, generator, per_node, dtype,
                                                                   fanout):
    n_trainers, needs = _needs(model, trainer, generator, dtype)
    got: dict[int, int] = defaultdict(int)
    for route, n in routes(needs, fanout, per_node).items():
        reached = [d for _, d in route]
        assert len(set(reached)) == len(reached)  # a tree: every GPU reached once per route
        starts = {s for s, _ in route} - set(reached)
        assert len(starts) == 1 and next(iter(starts)) < n_trainers  # rooted at one trainer rank
        if fanout is Fanout.HOST:  # relays stay inside one host
            assert len({d // per_node for d in reached}) == 1
        for d in reached:
            got[d] += n
    assert dict(got) == {g: sum(sum(by.values()) for by in keys.values()) for g, keys in needs.items()}


@pytest.mark.parametrize(("model", "trainer", "generator", "per_node", "dtype"), JOBS)
def test_host_relays_bring_a_hosts_distinct_bytes_across_its_nics_once(model, trainer, generator, per_node, dtype):
    n_trainers, needs = _needs(model, trainer, generator, dtype)
    direct = _simulate(routes(needs, Fanout.DIRECT, per_node), per_node)
    host = _simulate(routes(needs, Fanout.HOST, per_node), per_node)
    hosts: dict[int, list[int]] = defaultdict(list)
    for g in sorted(needs):
        hosts[g // per_node].append(g)
    for gpus in hosts.values():
        nic_in = sum(host.per_gpu.nic_in[g] for g in gpus)
        assert nic_in == _distinct(needs, gpus)
        assert nic_in <= sum(direct.per_gpu.nic_in[g] for g in gpus)
    assert sum(host.per_gpu.nic_out[:n_trainers]) == sum(host.per_gpu.nic_in[n_trainers:])


def test_every_gpu_needing_the_whole_model_each_host_receives_it_once_spread_over_its_nics():
    n_trainers, needs = _needs("llama-tiny", "fsdp=4", "tp=1,replicas=8", "bfloat16")
    model_bytes = sum(sum(by.values()) for by in needs[n_trainers].values())
    host = _simulate(routes(needs, Fanout.HOST, 4), 4)
    direct = _simulate(routes(needs, Fanout.DIRECT, 4), 4)
    largest_part = max(n for keys in needs.values() for by in keys.values() for n in by.values())
    for first in (4, 8):  # generator hosts 1 and 2
        gpus = range(first, first + 4)
        assert [direct.per_gpu.nic_in[g] for g in gpus] == [model_bytes] * 4
        assert sum(host.per_gpu.nic_in[g] for g in gpus) == model_bytes
        shares = [host.per_gpu.nic_in[g] for g in gpus]
        assert max(shares) - min(shares) <= largest_part  # relaying spread over the host's GPUs
        # What a GPU does not receive over its NIC it receives over NVLink, from the others.
        assert all(host.per_gpu.nvlink_in[g] == model_bytes - host.per_gpu.nic_in[g] for g in gpus)
    assert host.makespan_s < direct.makespan_s


@pytest.mark.parametrize(("model", "trainer", "generator", "per_node", "dtype"), JOBS)
def test_a_chain_sends_one_copy_of_each_distinct_slice_from_the_trainer(model, trainer, generator, per_node, dtype):
    n_trainers, needs = _needs(model, trainer, generator, dtype)
    chain = _simulate(routes(needs, Fanout.CHAIN, per_node), per_node)
    gpus = sorted(needs)
    assert sum(chain.per_gpu.nic_out[:n_trainers]) == _distinct(needs, gpus)
    # Each host takes its distinct bytes in once; every host but the last in a chain passes them on.
    hosts = sorted({g // per_node for g in gpus})
    into = {h: sum(chain.per_gpu.nic_in[g] for g in gpus if g // per_node == h) for h in hosts}
    assert into == {h: _distinct(needs, [g for g in gpus if g // per_node == h]) for h in hosts}
    assert sum(chain.per_gpu.nic_out[n_trainers:]) == sum(into.values()) - _distinct(needs, gpus)


@pytest.mark.parametrize(("model", "trainer", "generator", "per_node", "dtype"), JOBS)
def test_auto_never_chooses_a_fanout_slower_than_direct(model, trainer, generator, per_node, dtype):
    report = run(_cfg(model), trainer, generator, Network(gpus_per_node=per_node), generator_dtype=dtype,
                 relays=Relays.AUTO)
    rel = report["relays"]
    assert set(rel["fanouts"]) == {"direct", "host", "chain"}
    assert rel["fanouts"]["direct"]["makespan_s"] == report["makespan_s"]
    chosen = rel["fanouts"][rel["chosen"]]["makespan_s"]
    assert chosen <= report["makespan_s"]
    assert chosen == min(f["makespan_s"] for f in rel["fanouts"].values()) or rel["chosen"] != "chain"
    for f in rel["fanouts"].values():
        assert f["floor_s"] <= f["makespan_s"] * (1 + 1e-12)


def test_relays_pay_where_hosts_share_bytes_and_a_chain_where_the_trainer_link_binds():
    stream = run("llama-tiny", "fsdp=4", "tp=1,replicas=8", Network(gpus_per_node=4), relays=Relays.AUTO)
    assert stream["relays"]["chosen"] in ("host", "chain")
    few_trainers = run("mla-tiny", "fsdp=4", "tp=2,replicas=8", Network(gpus_per_node=4), relays=Relays.AUTO)
    rel = few_trainers["relays"]
    assert rel["chosen"] == "chain"
    assert rel["fanouts"]["chain"]["trainer_nic_out_bytes_max"] < rel["fanouts"]["host"]["trainer_nic_out_bytes_max"]


def test_choose_takes_more_relaying_only_when_it_is_one_percent_faster():
    d, h, c = Fanout.DIRECT, Fanout.HOST, Fanout.CHAIN
    assert choose({d: 1.0, h: 0.995, c: 0.9949})[0] is d  # neither is 1% below direct
    assert choose({d: 1.0, h: 0.5, c: 0.498})[0] is h  # the chain is not 1% below host
    assert choose({d: 1.0, h: 1.2, c: 0.5})[0] is c  # host loses, the chain still pays
    assert choose({d: 1.0})[0] is d
    chosen, why = choose({d: 2.0, h: 1.0, c: 0.25})
    assert chosen is c and "host 1.000 s is 2.00x faster than direct" in why and "4.00x faster than host" in why


def test_kimi_shaped_relays_report_is_the_same_in_every_process(tmp_path: Path):
    # DeepSeek/Kimi architecture, FP8 with block scales, TP spanning two hosts; two processes
    # with different hash seeds must print the same report (timings aside).
    (tmp_path / "config.json").write_text(json.dumps(KIMI_MINI))
    reports = []
    for seed in ("1", "2"):
        out = tmp_path / f"r{seed}.json"
        subprocess.run([sys.executable, "-m", "transport.plan", "simulate", "--model", str(tmp_path / "config.json"),
                        "--trainer", "fsdp=8",
                        "--generator", "tp=4,replicas=4", "--gpus-per-node", "2", "--generator-dtype",
                        "float8_e4m3fn", "--relays", "auto", "--json", str(out)],
                       check=True, capture_output=True, env={**os.environ, "PYTHONHASHSEED": seed})
        reports.append(_without_timings(json.loads(out.read_text())))
    assert reports[0] == reports[1]
    assert set(reports[0]["relays"]["fanouts"]) == {"direct", "host", "chain"}


def test_relays_off_leaves_the_report_as_it_was():
    report = run("llama-tiny", "fsdp=4", "tp=2,replicas=4", Network(gpus_per_node=4))
    assert "relays" not in report
    host = run("llama-tiny", "fsdp=4", "tp=2,replicas=4", Network(gpus_per_node=4), relays=Relays.HOST)
    assert set(host["relays"]["fanouts"]) == {"direct", "host"} and host["relays"]["chosen"] == "host"
    assert _without_timings(report) == _without_timings({k: v for k, v in host.items() if k != "relays"})


def test_cli_prints_the_fanouts_and_refuses_an_unknown_one(capsys):
    from transport.plan.__main__ import main

    args = ["simulate", "--model", "llama-tiny", "--trainer", "fsdp=4", "--generator", "tp=1,replicas=8",
            "--gpus-per-node", "4"]
    assert main([*args, "--relays", "auto"]) == 0
    out = capsys.readouterr().out
    assert "relays (auto):" in out and "\n  direct " in out and "\n  host " in out and "\n  chain " in out
    with pytest.raises(SystemExit) as exc:
        main([*args, "--relays", "tree"])
    assert exc.value.code == 2


def _without_timings(report: dict) -> dict:
    out = {k: v for k, v in report.items() if not k.endswith("_s") or k in ("makespan_s", "floor_s")}
    if "relays" in out:
        rel = dict(out["relays"])
        rel.pop("needs_s")
        rel["fanouts"] = {k: {kk: vv for kk, vv in f.items() if kk != "route_and_simulate_s"}
                          for k, f in rel["fanouts"].items()}
        out["relays"] = rel
    return out
