"""Command line: ``python -m transport <command>`` (also installed as ``transport``).

Commands:
    doctor  what can run here: backends, versions (the NCCL library in use), and whether
            same-host ipc between two unrelated processes is permitted (cross-memory attach,
            shared mappings, Yama).
    bench   put/get bandwidth and latency per backend against an in-process memcpy baseline
            (see :mod:`transport._bench`).
    store   hosts a TCPStore rendezvous for ``tcp://HOST:PORT`` stores until interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any, Sequence

_PROBE_TIMEOUT_S = 5.0
_YAMA_PATH = Path("/proc/sys/kernel/yama/ptrace_scope")
_YAMA_MEANING = {
    0: "classic: any process of the same user may attach",
    1: "restricted: only ancestors, or processes the target allows with PR_SET_PTRACER",
    2: "admin-only: attaching needs CAP_SYS_PTRACE",
    3: "no attach: ptrace is disabled",
}

# The probe runs in a child that loads only the torch-free native extension (fast start), and
# reads from its *parent*: a parent is not the child's descendant, so Yama ptrace_scope=1 judges
# this pair as it judges two unrelated peers. (A parent probing its own child would be allowed
# under Yama=1 and report a false "works".)
_PROBE_CHILD = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("transport._C", sys.argv[1])
C = importlib.util.module_from_spec(spec)
spec.loader.exec_module(C)
pid, addr, fd, nbytes = (int(x) for x in sys.argv[2:6])
out = {"cma_errno": C.cma_probe(pid, addr, 1)}
try:
    C.PeerMapping(pid, fd, nbytes, True)
    out["mapping_error"] = None
except Exception as exc:
    out["mapping_error"] = str(exc)
print(json.dumps(out), flush=True)
"""


# -------------------------------------------------------------------------------------------------
# doctor


def _yama_scope() -> int | None:
    try:
        return int(_YAMA_PATH.read_text().strip())
    except (OSError, ValueError):
        return None


def _probe_ipc() -> dict[str, Any]:
    """Runs the ipc permission probe with a short-lived child; always joins it.

    Returns:
        ``{"cma": None | reason, "mapping": None | reason}``, or ``{"error": reason}`` when the
        probe itself could not run.
    """
    import errno as errno_mod

    from ._native import load

    try:
        c = load()
    except Exception as exc:  # the extension is missing: nothing native can be probed
        return {"error": str(exc)}
    page = 4096
    buf = c.SharedBuffer(page, "transport-doctor")  # a memfd, as Transport.empty() makes
    cmd = [sys.executable, "-c", _PROBE_CHILD, c.__file__, str(os.getpid()), str(c.probe_address()), str(buf.fd), str(page)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=_PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=_PROBE_TIMEOUT_S)
        return {"error": f"the probe process did not finish within {_PROBE_TIMEOUT_S:g}s"}
    finally:
        del buf
    if proc.returncode != 0:
        return {"error": f"the probe process failed (exit {proc.returncode}): {err.decode(errors='replace').strip()[-500:]}"}
    try:
        result = json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"unexpected probe output: {out[-200:]!r}"}
    e = int(result["cma_errno"])
    if e == 0:
        cma = None
    elif e == errno_mod.EPERM:
        cma = "refused (EPERM): another user, or Yama ptrace_scope forbids it"
    else:
        cma = f"failed: {errno_mod.errorcode.get(e, e)}: {os.strerror(e)}"
    return {"cma": cma, "mapping": result["mapping_error"]}


def _describe_cuda() -> str:
    """The CUDA driver and devices this process sees, and the kernels this build embeds."""
    from . import _cuda
    from ._native import load

    arches = load().kernels_arches()
    kernels = f"kernels built for {arches}" if arches else "no kernels in this build (nvcc was not found)"
    why = _cuda.unavailable_reason()
    if why is not None:
        return f"unavailable: {why}; {kernels}"
    gpus = ", ".join(f"{i}: {_cuda.device_name(i)} ({_cuda.device_uuid(i)})" for i in range(_cuda.device_count()))
    return f"driver {_cuda.driver_version()}, devices {gpus}; {kernels}"


def doctor() -> int:
    """Prints what can run here. Returns 0 when at least one backend is available."""
    import torch

    from . import __version__
    from .backends import availability

    print(f"transport {__version__}, torch {torch.__version__}, Python {platform.python_version()}, {platform.platform()}")
    root_note = " (root: ptrace restrictions do not apply)" if os.getuid() == 0 else ""
    print(f"host {socket.gethostname()}, uid {os.getuid()}{root_note}")
    print("backends:")
    avail = availability()
    width = max(len(n) for n in avail)
    for name, reason in avail.items():
        print(f"  {name:<{width}}  {'available' if reason is None else 'unavailable: ' + reason}")
    from ._nccl import describe as describe_nccl

    print(f"CUDA: {_describe_cuda()}")
    print(f"NCCL library: {describe_nccl()}")

    if sys.platform.startswith("linux"):
        print("same-host ipc into an unrelated process of this user:")
        probe = _probe_ipc()
        if "error" in probe:
            print(f"  probe did not run: {probe['error']}")
        else:
            print(f"  cross-memory attach (process_vm_writev, any registered tensor): {probe['cma'] or 'works'}")
            print(f"  shared mapping (/proc/PID/fd, tensors from Transport.empty): {probe['mapping'] or 'works'}")
        scope = _yama_scope()
        if scope is None:
            print("  Yama ptrace_scope: not present (no Yama module)")
        else:
            print(f"  Yama ptrace_scope: {scope} ({_YAMA_MEANING.get(scope, 'unknown value')})")
    else:
        print("same-host ipc: needs Linux")
    return 0 if any(r is None for r in avail.values()) else 1


# -------------------------------------------------------------------------------------------------
# bench


def _is_interrupt(exc: BaseException) -> bool:
    """True for KeyboardInterrupt, also when trio delivered it inside a task group (then it
    arrives wrapped in a BaseExceptionGroup)."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    inner = getattr(exc, "exceptions", None)
    return isinstance(inner, tuple) and bool(inner) and all(_is_interrupt(e) for e in inner)


def bench(args: argparse.Namespace) -> int:
    """Runs the micro-benchmark with the parsed arguments; prints the tables (and writes JSON)."""
    from . import _bench
    from ._errors import TransportError

    try:
        sizes = _bench.parse_sizes(args.sizes) if args.sizes else _bench.DEFAULT_SIZES
        if args.max_size:
            cap = _bench.parse_size(args.max_size)
            sizes = tuple(n for n in sizes if n <= cap)
            if not sizes:
                raise ValueError(f"--max-size {args.max_size} leaves no size to measure")
        config = _bench.BenchConfig(
            backends=tuple(b.strip() for b in args.backends.split(",") if b.strip()),
            sizes=sizes,
            iters=args.iters,
            warmup=args.warmup,
            latency_iters=args.latency_iters,
            latency_bytes=_bench.parse_size(args.latency_size),
            timeout=args.timeout,
        )
    except ValueError as exc:
        print(f"transport bench: {exc}", file=sys.stderr)
        return 2
    try:
        report = _bench.run(config)
    except (ValueError, _bench.BenchError, TransportError) as exc:
        print(f"transport bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except BaseException as exc:
        if not _is_interrupt(exc):
            raise
        print("transport bench: interrupted", file=sys.stderr)  # the target was killed and joined
        return 130
    print(_bench.format_report(report))
    if args.json:
        path = Path(args.json)
        path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        print(f"results written to {path}")
    return 0


# -------------------------------------------------------------------------------------------------
# store


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def store(args: argparse.Namespace) -> int:
    """Hosts a TCPStore until Ctrl-C / SIGTERM (or ``--duration`` seconds)."""
    from ._rendezvous import StoreError, TCPStore

    try:
        s = TCPStore(args.host, args.port, is_host=True, timeout=args.timeout)
    except StoreError as exc:
        print(f"transport store: {exc}", file=sys.stderr)
        return 1
    url = f"tcp://{args.host}:{s.port}"
    print(f"hosting a rendezvous store; peers use store={url!r}  (Ctrl-C to stop)", flush=True)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    deadline = None if args.duration is None else time.monotonic() + args.duration
    try:
        while deadline is None or time.monotonic() < deadline:
            time.sleep(1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic())))
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        s.close()
    print("store stopped", flush=True)
    return 0


def _default_store_host() -> str:
    """This host's name when it resolves, else loopback."""
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
    except OSError:
        return "127.0.0.1"
    return name


# -------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m transport", description="transport: one-sided tensor movement between processes")
    p.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("doctor", help="what can run here (backends, versions, ipc permissions)")

    b = sub.add_parser("bench", help="put/get bandwidth and latency per backend vs memcpy")
    b.add_argument("--backends", default="ipc,ucx,tcp", help="comma-separated, in order (default: ipc,ucx,tcp; unavailable ones are skipped)")
    b.add_argument("--sizes", default=None, help="comma-separated sizes, e.g. 1MiB,64MiB,1GiB (default: 1MiB..1GiB, x4)")
    b.add_argument("--max-size", default=None, help="drop sizes above this one, e.g. 256MiB")
    b.add_argument("--iters", type=int, default=None, help="timed transfers per size and op (default: ~8 GiB moved, 5..50)")
    b.add_argument("--warmup", type=int, default=1, help="untimed transfers before each series (default: 1)")
    b.add_argument("--latency-iters", type=int, default=1000, help="small transfers timed for latency (default: 1000)")
    b.add_argument("--latency-size", default="8", help="small transfer size (default: 8 bytes)")
    b.add_argument("--timeout", type=float, default=120.0, help="seconds bounding each transfer and wait (default: 120)")
    b.add_argument("--json", default=None, metavar="PATH", help="also write all results as JSON here")

    s = sub.add_parser("store", help="host a TCPStore rendezvous (tcp://HOST:PORT) until Ctrl-C")
    s.add_argument("--port", type=int, required=True, help="port to listen on (0: any free port)")
    s.add_argument("--host", default=None, help="address peers use to reach it (default: this host's name)")
    s.add_argument("--timeout", type=float, default=30.0, help="TCPStore operation timeout in seconds (default: 30)")
    s.add_argument("--duration", type=float, default=None, help="stop after this many seconds (default: never)")
    f = sub.add_parser("flight", help="read flight-recorder dumps of many processes and say what stalled")
    f.add_argument("dir", help="directory of dumps (flight_dir= / $TRANSPORT_FLIGHT_DIR of the processes)")
    return p


def flight(directory: str) -> int:
    """Prints the flight-recorder report of every dump in ``directory``; 1 if there is none."""
    from ._flight import analyze, load_dumps

    dumps = load_dumps(sorted(Path(directory).glob("*.json")))
    if not dumps:
        print(f"no flight-recorder dumps in {directory}", file=sys.stderr)
        return 1
    print(analyze(dumps))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; returns the process exit code (0 success, 1 failure, 2 bad usage)."""
    args = _parser().parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "doctor":
        return doctor()
    if args.command == "bench":
        return bench(args)
    if args.command == "flight":
        return flight(args.dir)
    if args.command == "store":
        if args.host is None:
            args.host = _default_store_host()
        return store(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse rejects unknown ones


if __name__ == "__main__":
    sys.exit(main())
