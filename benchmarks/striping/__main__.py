"""``python -m benchmarks.striping [--rate-mbit 1000] [--size 200MB] [--repeat 4] [--rounds 2] [--out DIR]``

Builds hosts T and R (network namespaces, two NICs each, every link shaped to ``--rate-mbit``
each way with ``tbf``), then, in alternating rounds, runs one initiator on T putting ``--size``
bytes into one target on R ``--repeat`` times: first with both ends listening on NIC 0 only
(one link: no striping), then on both NICs (two lanes). The first put of each run is a warm-up;
the rate is the median of the others. Prints a table and the two-link/one-link ratio, and with
``--out`` writes ``striping-<date>.json`` and ``.md`` there. ``--uneven MBIT`` shapes T's second
NIC to another rate, to see the lanes share the bytes in proportion to their rates. ``--ucx`` also
measures the ``ucx`` backend over UCX's tcp transport on one NIC and on both, with UCX's own
multi-rail off (``UCX_MAX_RMA_RAILS=1``, its default) and on (2), and reports how many bytes each
of T's NICs sent in every run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common.machine import CpuSample, command_line, library, library_line, machine, other_load
from benchmarks.common.sizes import parse_size
from benchmarks.common.stats import median

# What is measured: (label, NICs each end listens on, backend, extra environment). UCX's own
# multi-rail stripes RMA puts only with UCX_MAX_RMA_RAILS > 1 (its default is 1); the ucx runs
# use UCX's tcp transport on the fabric's NICs.
Method = tuple[str, int, str, dict[str, str]]
TCP_METHODS: list[Method] = [("tcp, 1 link", 1, "tcp", {}), ("tcp, 2 links", 2, "tcp", {})]
_UCX = {"UCX_TLS": "tcp"}
UCX_METHODS = [
    ("ucx, eth0", 1, "ucx", {**_UCX, "UCX_NET_DEVICES": "eth0"}),
    ("ucx, eth0+eth1, RMA rails 1 (default)", 2, "ucx", {**_UCX, "UCX_NET_DEVICES": "eth0,eth1",
                                                         "UCX_MAX_RMA_RAILS": "1"}),
    ("ucx, eth0+eth1, RMA rails 2", 2, "ucx", {**_UCX, "UCX_NET_DEVICES": "eth0,eth1", "UCX_MAX_RMA_RAILS": "2"}),
]


def _tx_bytes(fab: Any) -> list[int]:
    """Bytes sent so far by each of T's NICs."""
    return [int(fab.run("T", ["cat", f"/sys/class/net/{fab.dev('T', i)}/statistics/tx_bytes"])) for i in (0, 1)]


def _one(fab: Any, nics: int, nbytes: int, repeat: int, backend: str = "tcp",
         env: dict[str, str] | None = None) -> dict[str, Any]:
    from tests._support import PYTHON, ROOT, python_env

    store = tempfile.mkdtemp(prefix="stripe-store-")
    procs = {}
    sent = _tx_bytes(fab)
    for role, host, name, peer in (("target", "R", "R", "T"), ("initiator", "T", "T", "R")):
        spec = {"role": role, "name": name, "peer": peer, "store": f"file://{store}",
                "listen": ",".join(fab.addrs(host)[:nics]), "nbytes": nbytes, "seed": 11, "timeout": 120,
                "repeat": repeat, "poll": False, "signal_done": True, "backends": [backend]}
        procs[role] = fab.popen(host, [PYTHON, "-m", "tests.peers.stripe_peer", json.dumps(spec)],
                                env={**python_env(), **(env or {})}, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    out = {}
    for role, p in procs.items():
        stdout, stderr = p.communicate(timeout=120 * repeat + 120)
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            raise SystemExit(f"{role} failed (exit {p.returncode}): {stderr[-3000:]}")
        out[role] = json.loads(lines[-1][len("RESULT "):])
    init = out["initiator"]
    if init["error"] is not None or not out["target"]["exact"]:
        raise SystemExit(f"a put failed or landed wrong: {init['error']}, exact={out['target']['exact']}")
    rates = [nbytes / s for s in init["seconds"][1:]]
    tx = [round((b - a) / 1e6) for a, b in zip(sent, _tx_bytes(fab), strict=True)]
    return {"nics": nics, "backend": backend, "env": env or {}, "seconds": [round(s, 4) for s in init["seconds"]],
            "rate_MBps": round(median(rates) / 1e6, 1), "lanes_last_put": init["lanes"], "lane_stats": init["stats"],
            "tx_MB_per_nic": tx}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.striping", description=__doc__.split("\n\n")[1])
    ap.add_argument("--rate-mbit", type=float, default=1000.0, help="every link's rate, each way (default 1000)")
    ap.add_argument("--size", type=parse_size, default=200_000_000, help="bytes per put (default 200MB)")
    ap.add_argument("--repeat", type=int, default=4, help="puts per run, the first a warm-up (default 4)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating one-link/two-link rounds (default 2)")
    ap.add_argument("--out", type=Path, help="write striping-<date>.json/.md here")
    ap.add_argument("--tag", default="", help="added to the result files' names")
    ap.add_argument("--ucx", action="store_true",
                    help="also measure UCX's own multi-rail (ucx over UCX's tcp transport: one NIC, two with "
                         "UCX_MAX_RMA_RAILS=1, two with 2)")
    ap.add_argument("--uneven", type=float, metavar="MBIT",
                    help="shape T's second NIC (its egress, the put's direction) to this rate instead: the lanes "
                         "then split the bytes in proportion to their rates")
    args = ap.parse_args(argv)
    from tests._support.netns import Fabric

    start = CpuSample.take()
    runs = []
    with Fabric({"T": 2, "R": 2}, rate_mbit=args.rate_mbit) as fab:
        if args.uneven:
            fab.run("T", ["tc", "qdisc", "replace", "dev", fab.dev("T", 1), "root", "tbf", "rate",
                          f"{args.uneven:g}mbit", "burst", str(fab.burst_bytes), "latency", f"{fab.latency_ms:g}ms"])
        for r in range(args.rounds):
            for label, nics, backend, env in TCP_METHODS + (UCX_METHODS if args.ucx else []):
                run = _one(fab, nics, args.size, args.repeat, backend, env)
                run["round"], run["method"] = r, label
                runs.append(run)
                print(f"round {r} {label}: {run['rate_MBps']:8.1f} MB/s  puts {run['seconds']}  "
                      f"T's NICs sent {run['tx_MB_per_nic']} MB  lanes {run['lanes_last_put']}", flush=True)

    def rate(label: str) -> float:
        return median([x["rate_MBps"] for x in runs if x["method"] == label])

    one, two = rate(TCP_METHODS[0][0]), rate(TCP_METHODS[1][0])
    wire = args.rate_mbit * 1e6 / 8 / 1e6
    both = wire + (args.uneven or args.rate_mbit) * 1e6 / 8 / 1e6
    result = {"date": datetime.date.today().isoformat(), "command": command_line(argv, "benchmarks.striping"),
              "machine": machine(), "library": library(), "other_load": other_load(start, CpuSample.take()),
              "rate_mbit": args.rate_mbit, "size": args.size, "repeat": args.repeat, "runs": runs,
              "one_link_MBps": one, "two_links_MBps": two, "ratio": round(two / one, 3), "link_MBps": wire,
              "second_link_mbit": args.uneven or args.rate_mbit}
    table = ["| method | rate MB/s (median of rounds) | share of the links' rate | sent by T's NICs, last round (MB) |",
             "| --- | --- | --- | --- |"]
    for label, nics, _, _ in TCP_METHODS + (UCX_METHODS if args.ucx else []):
        last = [x for x in runs if x["method"] == label][-1]
        table.append(f"| {label} | {rate(label):.1f} | {rate(label) / (wire if nics == 1 else both):.2f} | "
                     f"{' + '.join(str(t) for t in last['tx_MB_per_nic'])} |")
    if args.ucx:
        result["ucx_rails_ratio"] = round(rate(UCX_METHODS[2][0]) / rate(UCX_METHODS[0][0]), 3)
    print("\n".join(table))
    print(f"two links / one link: {two / one:.2f}x (target >= 1.8x with equal links; the links' rates "
          f"add up to {both / wire:.2f}x one)")
    if args.out:
        stem = f"striping-{result['date']}{'-' + args.tag if args.tag else ''}"
        (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
        m = result["machine"]
        md = [f"# Striping over NICs, {result['date']}", "",
              f"`{result['command']}`", "",
              f"Machine: {m['cpu']}, {m['nproc']} cores, {m['memory_gib']} GiB; torch {m['torch']}. "
              + library_line(result["library"]), "",
              f"Fabric: hosts T and R as network namespaces, two NICs each (veth into a switch bridge per NIC), "
              f"every link tbf-shaped to {args.rate_mbit:g} Mbit/s each way"
              + (f" except T's second NIC's egress, {args.uneven:g} Mbit/s" if args.uneven else "")
              + ". One initiator on T puts "
              f"{args.size / 1e6:g} MB into one registered region on R (each method's backend), "
              f"{args.repeat} times per run "
              f"(the first a warm-up, the rate is the median of the rest); runs alternate one link (both ends "
              f"listen on NIC 0 only) and two (both NICs). Other load during the run: "
              f"{result['other_load']['other_cores_avg']} cores on average.", "", *table, "",
              f"**Two links / one link: {two / one:.2f}x** (target >= 1.8x with equal links; the two links' "
              f"rates add up to {both / wire:.2f}x one).", "",
              *([f"ucx with UCX_MAX_RMA_RAILS=2 over eth0+eth1 / ucx on eth0: {result['ucx_rails_ratio']:.2f}x "
                 "(UCX's own multi-rail; its default, 1 rail, leaves the second NIC unused).", ""]
                if args.ucx else []),
              "| round | method | MB/s | put seconds (first: warm-up) | bytes per lane, last put |",
              "| --- | --- | --- | --- | --- |",
              *[f"| {x['round']} | {x['method']} | {x['rate_MBps']} | {x['seconds']} | "
                f"{', '.join(f'{k}: {v / 1e6:.1f} MB' for k, v in x['lanes_last_put'].items()) or '-'} |"
                for x in runs]]
        (args.out / f"{stem}.md").write_text("\n".join(md) + "\n")
        print(f"wrote {args.out / stem}.json and .md")


if __name__ == "__main__":
    main(sys.argv[1:])
