"""``python -m benchmarks.striping [--rate-mbit 1000] [--size 200MB] [--repeat 4] [--rounds 2] [--out DIR]``

Builds hosts T and R (network namespaces, two NICs each, every link shaped to ``--rate-mbit``
each way with ``tbf``), then, in alternating rounds, runs one initiator on T putting ``--size``
bytes into one target on R ``--repeat`` times: first with both ends listening on NIC 0 only
(one link: no striping), then on both NICs (two lanes). The first put of each run is a warm-up;
the rate is the median of the others. Prints a table and the two-link/one-link ratio, and with
``--out`` writes ``striping-<date>.json`` and ``.md`` there. ``--uneven MBIT`` shapes T's second
NIC to another rate, to see the lanes share the bytes in proportion to their rates.
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


def _one(fab: Any, nics: int, nbytes: int, repeat: int) -> dict[str, Any]:
    from tests._support import PYTHON, ROOT, python_env

    store = tempfile.mkdtemp(prefix="stripe-store-")
    procs = {}
    for role, host, name, peer in (("target", "R", "R", "T"), ("initiator", "T", "T", "R")):
        spec = {"role": role, "name": name, "peer": peer, "store": f"file://{store}",
                "listen": ",".join(fab.addrs(host)[:nics]), "nbytes": nbytes, "seed": 11, "timeout": 120,
                "repeat": repeat, "poll": False, "signal_done": True}
        procs[role] = fab.popen(host, [PYTHON, "-m", "tests.peers.stripe_peer", json.dumps(spec)], env=python_env(),
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
    return {"nics": nics, "seconds": [round(s, 4) for s in init["seconds"]], "rate_MBps": round(median(rates) / 1e6, 1),
            "lanes_last_put": init["lanes"], "lane_stats": init["stats"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.striping", description=__doc__.split("\n\n")[1])
    ap.add_argument("--rate-mbit", type=float, default=1000.0, help="every link's rate, each way (default 1000)")
    ap.add_argument("--size", type=parse_size, default=200_000_000, help="bytes per put (default 200MB)")
    ap.add_argument("--repeat", type=int, default=4, help="puts per run, the first a warm-up (default 4)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating one-link/two-link rounds (default 2)")
    ap.add_argument("--out", type=Path, help="write striping-<date>.json/.md here")
    ap.add_argument("--tag", default="", help="added to the result files' names")
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
            for nics in (1, 2):
                run = _one(fab, nics, args.size, args.repeat)
                run["round"] = r
                runs.append(run)
                print(f"round {r} {nics} link(s): {run['rate_MBps']:8.1f} MB/s  puts {run['seconds']}  "
                      f"lanes {run['lanes_last_put']}", flush=True)
    one = median([x["rate_MBps"] for x in runs if x["nics"] == 1])
    two = median([x["rate_MBps"] for x in runs if x["nics"] == 2])
    wire = args.rate_mbit * 1e6 / 8 / 1e6
    both = wire + (args.uneven or args.rate_mbit) * 1e6 / 8 / 1e6
    result = {"date": datetime.date.today().isoformat(), "command": command_line(argv, "benchmarks.striping"),
              "machine": machine(), "library": library(), "other_load": other_load(start, CpuSample.take()),
              "rate_mbit": args.rate_mbit, "size": args.size, "repeat": args.repeat, "runs": runs,
              "one_link_MBps": one, "two_links_MBps": two, "ratio": round(two / one, 3), "link_MBps": wire,
              "second_link_mbit": args.uneven or args.rate_mbit}
    table = ["| links | rate MB/s (median of rounds) | share of the links' rate |", "| --- | --- | --- |",
             f"| 1 | {one:.1f} | {one / wire:.2f} |", f"| 2 | {two:.1f} | {two / both:.2f} |"]
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
              f"{args.size / 1e6:g} MB into one registered region on R over tcp, {args.repeat} times per run "
              f"(the first a warm-up, the rate is the median of the rest); runs alternate one link (both ends "
              f"listen on NIC 0 only) and two (both NICs). Other load during the run: "
              f"{result['other_load']['other_cores_avg']} cores on average.", "", *table, "",
              f"**Two links / one link: {two / one:.2f}x** (target >= 1.8x with equal links; the two links' "
              f"rates add up to {both / wire:.2f}x one).", "",
              "| round | links | MB/s | put seconds (first: warm-up) | bytes per lane, last put |",
              "| --- | --- | --- | --- | --- |",
              *[f"| {x['round']} | {x['nics']} | {x['rate_MBps']} | {x['seconds']} | "
                f"{', '.join(f'{k}: {v / 1e6:.1f} MB' for k, v in x['lanes_last_put'].items()) or 'one connection'} |"
                for x in runs]]
        (args.out / f"{stem}.md").write_text("\n".join(md) + "\n")
        print(f"wrote {args.out / stem}.json and .md")


if __name__ == "__main__":
    main(sys.argv[1:])
