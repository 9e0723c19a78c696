"""``python -m transport.plan simulate ...``: the mesh planner at cluster scale (see ``_simulate``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from .._errors import MeshLayoutError
from ._netsim import Network
from ._relays import Relays


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. Returns the exit status (2: bad arguments or a layout that does not fit)."""
    p = argparse.ArgumentParser(prog="python -m transport.plan", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("simulate", help="plan a cluster-sized job and time it with a flow-level network model")
    s.add_argument("--model", required=True,
                   help="kimi-k2, deepseek-v3, qwen3-235b-a22b, llama3-70b, or a path to a config.json")
    s.add_argument("--trainer", required=True, help="trainer mesh, e.g. fsdp=256 or fsdp=32,tp=8 or dp=2,fsdp=128")
    s.add_argument("--generator", required=True, help="generator replicas, e.g. tp=8,ep=8,replicas=16")
    s.add_argument("--gpus-per-node", type=int, default=8)
    s.add_argument("--nic-gbps", type=float, default=400.0, help="one NIC per GPU, each direction (Gbit/s)")
    s.add_argument("--nvlink-gbps", type=float, default=3600.0, help="NVLink per GPU, each direction (Gbit/s)")
    s.add_argument("--trainer-dtype", default="bfloat16")
    s.add_argument("--generator-dtype", default="bfloat16", help="e.g. float8_e4m3fn (cast at the source)")
    s.add_argument("--relays", choices=[r.value for r in Relays], default=Relays.OFF.value,
                   help="also simulate relay GPUs in each generator host (host), a chain of hosts (chain), "
                        "or both and choose the fastest (auto); off: the direct plan only")
    s.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)

    from ._simulate import format_report, run

    try:
        network = Network(args.gpus_per_node, args.nic_gbps, args.nvlink_gbps)
        report = run(args.model, args.trainer, args.generator, network, trainer_dtype=args.trainer_dtype,
                     generator_dtype=args.generator_dtype, relays=Relays(args.relays))
    except (MeshLayoutError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"report written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
