"""The fan-out benchmark's harness: builds the fabric, runs each method in fresh processes on
its hosts, and gathers what they recorded (see the package docstring for the what and why).

Hosts (:class:`tests._support.netns.Fabric`): T (the trainer) and A, B (``--per-host``
generators each, named ``gen-a0``, ``gen-a1``, ... so that ``gen-a0`` is host A's relay by the
library's rule: the first subscriber of a host by name). Every host has two NICs, each on its
own switch; every link is shaped to ``--rate-mbit`` each way. The one-link methods use NIC 0
only (every Transport listens on its host's NIC 0 address, gloo binds ``eth0``); ``striped``
lists both addresses of every host.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..common.errors import BenchError
from ..common.machine import CpuSample, command_line, library, machine, other_load
from ..common.procs import CHECKOUT, checkout_env
from ..common.sizes import format_size, parse_size
from . import _report

METHODS = ("direct", "relays", "striped", "gloo", "mesh-direct", "mesh-relays", "floor", "stop", "kill")
"""Every method, in the order they run (``floor`` is computed from the stream references)."""
MESH_METHODS = ("mesh-direct", "mesh-relays")
HOSTS = ("A", "B")
ROLES = "benchmarks.fanout._roles"
MESH_ROLES = "benchmarks.fanout._mesh_roles"
_POLL_S = 0.1
GLOO_PORT = 29531
STREAM_PORT = 5311


def generator_names(per_host: int) -> dict[str, list[str]]:
    return {h: [f"gen-{h.lower()}{i}" for i in range(per_host)] for h in HOSTS}


class Procs:
    """The processes of one method on the fabric, each logging to its own file; :meth:`close`
    kills and reaps whatever still runs."""

    def __init__(self, fab: Any, tmp: Path) -> None:
        self.fab, self.tmp = fab, tmp
        self.procs: dict[str, Any] = {}
        self.logs: dict[str, Path] = {}

    def start(self, host: str, who: str, role: str, spec: dict[str, Any], env: dict[str, str] | None = None,
              module: str = ROLES) -> Any:
        log = self.tmp / f"{who}.log"
        self.logs[who] = log
        with open(log, "wb") as f:
            p = self.fab.popen(host, [sys.executable, "-m", module, role, json.dumps(spec)],
                               env={**checkout_env(), **(env or {})}, cwd=CHECKOUT, stdout=f, stderr=f)
        self.procs[who] = p
        return p

    def tail(self, who: str, limit: int = 2500) -> str:
        try:
            return self.logs[who].read_bytes()[-limit:].decode(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"

    def last_line(self, who: str) -> str:
        """The last line of its log (a Python error's message)."""
        lines = self.tail(who).strip().splitlines()
        return lines[-1] if lines else "(no output)"

    def wait(self, who: Sequence[str], timeout: float, allow_fail: Sequence[str] = ()) -> dict[str, int]:
        """Waits until every process in ``who`` exited (at most ``timeout`` s in all); returns their
        exit codes.

        Raises:
            BenchError: one still ran at the timeout, or one not in ``allow_fail`` failed (the
                message quotes its log); the others are killed by :meth:`close`.
        """
        deadline = time.monotonic() + timeout
        codes: dict[str, int] = {}
        while len(codes) < len(who):
            for w in who:
                if w not in codes and (rc := self.procs[w].poll()) is not None:
                    codes[w] = rc
                    if rc != 0 and w not in allow_fail:
                        raise BenchError(f"{w} exited with code {rc}: {self.last_line(w)}; its log ends with:\n"
                                         f"{self.tail(w)}")
            if time.monotonic() > deadline:
                late = [w for w in who if w not in codes]
                raise BenchError(f"{', '.join(late)} still running after {timeout:g} s; "
                                 + "; ".join(f"{w}'s log ends with:\n{self.tail(w)}" for w in late))
            time.sleep(_POLL_S)
        return codes

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


def nic_bytes(fab: Any) -> dict[str, dict[str, int]]:
    """Every host NIC's byte counters (``host/ethN`` -> rx, tx), read in its namespace."""
    out = {}
    for host in ("T", *HOSTS):
        for nic in range(fab.hosts[host]):
            dev = fab.dev(host, nic)
            rx, tx = fab.run(host, ["cat", f"/sys/class/net/{dev}/statistics/rx_bytes",
                                    f"/sys/class/net/{dev}/statistics/tx_bytes"]).split()
            out[f"{host}/{dev}"] = {"rx": int(rx), "tx": int(tx)}
    return out


def nic_delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {k: {d: after[k][d] - before[k][d] for d in ("rx", "tx")} for k in after}


def read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


# ---- references: a plain socket stream --------------------------------------------------------

def stream(fab: Any, tmp: Path, args: argparse.Namespace, nics: int) -> dict[str, Any]:
    """One plain TCP stream of the state's size from T over each of ``nics`` NICs at once (to
    host A's NIC of the same number), ``--reps`` times: the goodput one / two shaped links
    carry, end to end (from the sender's connect to the receiver's last byte)."""
    rates = []
    for rep in range(args.reps):
        procs = Procs(fab, tmp)
        try:
            outs = []
            for nic in range(nics):
                base = {"addr": fab.addr("A", nic), "port": STREAM_PORT, "timeout": args.timeout}
                recv = {**base, "out": str(tmp / f"stream{nics}-{rep}-{nic}-recv.json")}
                send = {**base, "nbytes": args.state_bytes, "out": str(tmp / f"stream{nics}-{rep}-{nic}-send.json")}
                procs.start("A", f"stream{nics}-{rep}-{nic}-recv", "stream-recv", recv)
                procs.start("T", f"stream{nics}-{rep}-{nic}-send", "stream-send", send)
                outs.append((recv["out"], send["out"]))
            procs.wait(list(procs.procs), args.timeout)
            got = [(read(Path(r)), read(Path(s))) for r, s in outs]
        finally:
            procs.close()
        if any(r["bytes"] != args.state_bytes for r, _ in got):
            raise BenchError(f"a stream arrived short: {[r['bytes'] for r, _ in got]} of {args.state_bytes}")
        seconds = max(r["end_at"] for r, _ in got) - min(s["start_at"] for _, s in got)
        rates.append(nics * args.state_bytes / seconds)
    return {"nics": nics, "bytes_per_s": rates, "median_bytes_per_s": statistics.median(rates)}


# ---- transport.weights methods ------------------------------------------------------------

def weights_method(fab: Any, tmp: Path, args: argparse.Namespace, method: str,
                   fault: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run of a ``transport.weights`` method: ``--warmup`` + ``--reps`` versions (a fault
    run: warm-up versions, then one version with the fault)."""
    relays = method != "direct"
    striped = method == "striped"
    versions = args.warmup + (1 if fault else args.reps)
    names = generator_names(args.per_host)
    store = f"file://{tmp / 'store'}"
    common = {"store": store, "state_bytes": args.state_bytes, "versions": versions, "relays": relays,
              "relay_timeout": args.relay_timeout, "timeout": args.timeout, "version_timeout": args.timeout,
              "start_timeout": args.timeout, "run_timeout": args.run_timeout}

    def listen(host: str) -> str:
        return ",".join(fab.addrs(host)) if striped else fab.addr(host, 0)

    procs = Procs(fab, tmp)
    try:
        for host in HOSTS:
            for name in names[host]:
                procs.start(host, name, "generator", {**common, "name": name, "listen": listen(host),
                                                      "backends": ["ipc", "tcp"], "out": str(tmp / f"{name}.json")})
        gens = [n for h in HOSTS for n in names[h]]
        deadline = args.fault_deadline if fault else args.deadline
        spec = {**common, "generators": gens, "listen": listen("T"), "backends": ["tcp"], "deadline": deadline,
                "out": str(tmp / "trainer.json")}
        if fault:
            victim = names["A"][0]
            spec["fault"] = {**fault, "victim": victim, "pid": procs.procs[victim].pid}
        procs.start("T", "trainer", "trainer", spec)
        procs.wait(["trainer", *[g for g in gens if not fault or g != spec["fault"]["victim"]]], args.run_timeout)
        trainer = read(tmp / "trainer.json")
        gen = {n: read(tmp / f"{n}.json") for n in gens if (tmp / f"{n}.json").exists()}
    finally:
        procs.close()
    return _report.weights_rows(method, trainer, gen, names, args.warmup, spec.get("fault"))


# ---- transport.weights mesh methods -------------------------------------------------------

def mesh_method(fab: Any, tmp: Path, args: argparse.Namespace, method: str) -> dict[str, Any]:
    """One run of a mesh method: ``MESH_TRAINER_RANKS`` trainer ranks on T, a tp=1 replica per
    generator process, ``--warmup`` + ``--reps`` versions (see :mod:`._mesh_roles`)."""
    from ._mesh_roles import MESH_TRAINER_RANKS, trainer_name

    names = generator_names(args.per_host)
    gens = [n for h in HOSTS for n in names[h]]
    trainers = [trainer_name(r) for r in range(MESH_TRAINER_RANKS)]
    common = {"store": f"file://{tmp / 'store'}", "state_bytes": args.state_bytes, "versions": args.warmup + args.reps,
              "ranks": MESH_TRAINER_RANKS, "relays": method == "mesh-relays", "relay_timeout": args.relay_timeout,
              "backends": ["ipc", "tcp"], "timeout": args.timeout, "version_timeout": args.timeout,
              "start_timeout": args.timeout, "run_timeout": args.run_timeout}
    procs = Procs(fab, tmp)
    try:
        for host in HOSTS:
            for name in names[host]:
                procs.start(host, name, "generator", {**common, "name": name, "listen": fab.addr(host, 0),
                                                      "poll_s": args.mesh_poll_ms / 1e3,
                                                      "out": str(tmp / f"{name}.json")}, module=MESH_ROLES)
        for rank, who in enumerate(trainers):
            procs.start("T", who, "trainer", {**common, "rank": rank, "generators": gens, "listen": fab.addr("T", 0),
                                              "deadline": args.deadline, "out": str(tmp / f"{who}.json")},
                        module=MESH_ROLES)
        procs.wait([*trainers, *gens], args.run_timeout)
        ranks = [read(tmp / f"{who}.json") for who in trainers]
        gen = {n: read(tmp / f"{n}.json") for n in gens}
    finally:
        procs.close()
    return _report.mesh_rows(ranks, gen, names, args.warmup)


# ---- gloo -------------------------------------------------------------------------------------

def gloo_method(fab: Any, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    names = generator_names(args.per_host)
    ranks = [("T", "rank0")] + [(h, f"rank{1 + i + k * args.per_host}:{n}") for k, h in enumerate(HOSTS)
                                for i, n in enumerate(names[h])]
    versions = args.warmup + args.reps
    procs = Procs(fab, tmp)
    try:
        for rank, (host, who) in enumerate(ranks):
            spec = {"rank": rank, "world_size": len(ranks), "init_method": f"tcp://{fab.addr('T', 0)}:{GLOO_PORT}",
                    "state_bytes": args.state_bytes, "versions": versions, "bucket_bytes": args.bucket_bytes,
                    "timeout": args.timeout, "out": str(tmp / f"gloo-{rank}.json")}
            procs.start(host, who.replace(":", "-"), "gloo", spec, env={"GLOO_SOCKET_IFNAME": fab.dev(host, 0)})
        procs.wait([w.replace(":", "-") for _, w in ranks], args.run_timeout)
        rows = [read(tmp / f"gloo-{r}.json") for r in range(len(ranks))]
    finally:
        procs.close()
    gen_names = ["trainer"] + [n for h in HOSTS for n in names[h]]
    return _report.gloo_rows(rows, gen_names, args.warmup)


# ---- the run ----------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict[str, Any]:
    from tests._support.netns import Fabric

    tmp = Path(tempfile.mkdtemp(prefix="fanout-", dir=args.tmp))
    methods: dict[str, Any] = {}
    cpu0 = CpuSample.take()
    try:
        with Fabric({"T": 2, "A": 2, "B": 2}, rate_mbit=args.rate_mbit) as fab:
            refs = {"one_link": stream(fab, tmp / _mk(tmp, "stream1"), args, 1)}
            if "striped" in args.methods:
                refs["two_links"] = stream(fab, tmp / _mk(tmp, "stream2"), args, 2)
            print(_report.refs_line(refs, args), flush=True)
            for method in [m for m in METHODS if m in args.methods and m != "floor"]:
                t0 = time.monotonic()
                counters = nic_bytes(fab)
                try:
                    d = tmp / _mk(tmp, method)
                    if method == "gloo":
                        methods[method] = gloo_method(fab, d, args)
                    elif method in MESH_METHODS:
                        methods[method] = mesh_method(fab, d, args, method)
                    elif method in ("stop", "kill"):
                        normal = methods.get("relays", {}).get("median_s")
                        after = args.fault_after * (normal or _report.floor(args, refs)["rate_s"])
                        fault = {"signal": "SIGSTOP" if method == "stop" else "SIGKILL", "after_s": after}
                        methods[method] = weights_method(fab, d, args, "relays", fault)
                    else:
                        methods[method] = weights_method(fab, d, args, method)
                except Exception as exc:  # noqa: BLE001 - a method that cannot run is reported, the rest go on
                    methods[method] = {"error": f"{type(exc).__name__}: {exc}"}
                methods[method]["wall_s"] = time.monotonic() - t0
                methods[method]["nic_bytes"] = nic_delta(counters, nic_bytes(fab))
                print(_report.method_line(method, methods[method]), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"benchmark": "fanout", "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(), "library": library(), "command": command_line(args.argv, "benchmarks.fanout"),
            "load": other_load(cpu0, CpuSample.take()), "platform": platform.platform(),
            "args": {"rate_mbit": args.rate_mbit, "state_bytes": args.state_bytes, "per_host": args.per_host,
                     "reps": args.reps, "warmup": args.warmup, "methods": list(args.methods),
                     "relay_timeout": args.relay_timeout, "deadline": args.deadline,
                     "fault_deadline": args.fault_deadline, "bucket_bytes": args.bucket_bytes,
                     "fault_after": args.fault_after, "mesh_poll_ms": args.mesh_poll_ms, "note": args.note},
            "refs": refs, "floor": _report.floor(args, refs), "methods": methods}


def _mk(tmp: Path, name: str) -> str:
    (tmp / name).mkdir()
    return name


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    doc = sys.modules["benchmarks.fanout"].__doc__ or ""
    p = argparse.ArgumentParser(prog="python -m benchmarks.fanout", description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated, any of {', '.join(METHODS)} (default: all)")
    p.add_argument("--size", default="200MB", help="the bf16 state's size (default 200MB)")
    p.add_argument("--rate-mbit", type=float, default=1000.0, help="every link's rate, each way (default 1000)")
    p.add_argument("--per-host", type=int, default=3, help="generator processes per host (default 3)")
    p.add_argument("--reps", type=int, default=3, help="timed versions per method (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed versions first (default 1)")
    p.add_argument("--relay-timeout", type=float, default=None,
                   help="Publisher(relay_timeout=...) of the relay methods (default: not passed; the library "
                        "bounds a failed relay by the deadline)")
    p.add_argument("--deadline", type=float, default=60.0, help="Publisher(deadline=...) (default 60)")
    p.add_argument("--fault-deadline", type=float, default=10.0,
                   help="Publisher(deadline=...) of the fault runs: what a failed relay may cost (default 10)")
    p.add_argument("--fault-after", type=float, default=0.4,
                   help="the fault runs' signal comes this fraction of the relays' median time into the version")
    p.add_argument("--bucket-mib", type=float, default=64.0, help="gloo broadcast bucket (default 64 MiB)")
    p.add_argument("--timeout", type=float, default=120.0, help="each wait of each process (default 120 s)")
    p.add_argument("--mesh-poll-ms", type=float, default=100.0,
                   help="the mesh methods: how often a replica's leader tries commit() besides when the trainer "
                        "ranks say they published (default 100)")
    p.add_argument("--run-timeout", type=float, default=900.0, help="one method's processes in all (default 900 s)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--markdown", type=Path, help="write the report here")
    p.add_argument("--record", type=Path, help="directory: write fanout-DATE[-LABEL].{md,json} there")
    p.add_argument("--label", default="", help="the record's file name suffix")
    p.add_argument("--note", action="append", default=[], help="a line for the record (repeatable)")
    p.add_argument("--tmp", default=None, help="where the run's files go (default: the system's temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the run's files (logs, records)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        p.error(f"unknown methods {', '.join(unknown)} (known: {', '.join(METHODS)})")
    args.state_bytes = parse_size(args.size)
    args.bucket_bytes = int(args.bucket_mib * (1 << 20))
    if args.reps < 1 or args.warmup < 0 or args.per_host < 1:
        p.error("--reps >= 1, --warmup >= 0, --per-host >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from tests._support.netns import unavailable_reason

    args = parse(argv)
    why = unavailable_reason()
    if why is not None:
        print(f"python -m benchmarks.fanout: cannot build the fabric: {why}", file=sys.stderr)
        return 2
    print(f"fan-out of a {format_size(args.state_bytes)} bf16 state, T -> {len(HOSTS)} hosts x {args.per_host} "
          f"generators, links {args.rate_mbit:g} Mbit/s; methods {', '.join(args.methods)}", flush=True)
    result = run(args)
    result["summary"] = _report.summarize(result)
    text = _report.table(result)
    print(text, flush=True)
    md = _report.markdown(result)
    outs = []
    if args.record:
        stem = f"fanout-{result['date'][:10]}" + (f"-{args.label}" if args.label else "")
        outs += [(args.record / f"{stem}.json", None), (args.record / f"{stem}.md", md)]
    if args.json:
        outs.append((args.json, None))
    if args.markdown:
        outs.append((args.markdown, md))
    for path, body in outs:
        path.write_text(body if body is not None else json.dumps(result, indent=1))
    failed = [m for m, r in result["methods"].items() if "error" in r or r.get("wrong")]
    return 1 if failed else 0
