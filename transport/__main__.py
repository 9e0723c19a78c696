"""Command line: ``python -m transport <command>`` (also installed as ``transport``).

Commands:
    doctor  what can run here: backends, versions (the NCCL library in use), and whether
            same-host ipc between two unrelated processes is permitted (cross-memory attach,
            shared mappings, Yama).
    bench   put/get bandwidth and latency per backend against an in-process memcpy baseline: a
            thin entry to the harness in the source checkout's ``benchmarks/`` package
            (:mod:`benchmarks.p2p`, also run as ``python -m benchmarks.p2p``).
    store   hosts a TCPStore rendezvous for ``tcp://HOST:PORT`` stores until interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import platform
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

_PROBE_TIMEOUT_S = 5.0
_YAMA_PATH = Path("/proc/sys/kernel/yama/ptrace_scope")
_YAMA_MEANING = {
    0: "classic: any process of the same user may attach",
    1: "restricted: only ancestors, or processes the target allows with PR_SET_PTRACER",
    2: "admin-only: attaching needs CAP_SYS_PTRACE",
    3: "no attach: ptrace is disabled",
}


# -------------------------------------------------------------------------------------------------
# doctor


def _yama_scope() -> int | None:
    try:
        return int(_YAMA_PATH.read_text().strip())
    except (OSError, ValueError):
        return None


def _probe_ipc() -> dict[str, Any]:
    """Runs the ipc permission probe (a short-lived child process; always joined).

    Returns:
        ``{"cma": None | reason, "mapping": None | reason}``, or ``{"error": reason}`` when the
        probe itself could not run.
    """
    import errno as errno_mod

    from ._errors import TransportError
    from ._native import probe_ipc

    try:
        probe = probe_ipc(_PROBE_TIMEOUT_S)
    except (TransportError, RuntimeError) as exc:  # no extension, no memfd, or the child failed
        return {"error": str(exc)}
    e = probe.cma_errno
    if e == 0:
        cma = None
    elif e == errno_mod.EPERM:
        cma = "refused (EPERM): another user, or Yama ptrace_scope forbids it"
    else:
        cma = f"failed: {errno_mod.errorcode.get(e, e)}: {os.strerror(e)}"
    return {"cma": cma, "mapping": probe.mapping_error}


def _describe_cuda() -> str:
    """The CUDA driver and devices this process sees, and the kernels this build embeds."""
    from . import _cuda
    from ._native import cuda

    arches = cuda.kernels_arches()
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

    print(
        f"transport {__version__}, torch {torch.__version__}, Python {platform.python_version()}, {platform.platform()}"
    )
    root_note = " (root: ptrace restrictions do not apply)" if os.getuid() == 0 else ""
    print(f"host {socket.gethostname()}, uid {os.getuid()}{root_note}")
    print("backends:")
    avail = availability()
    width = max(len(n) for n in avail)
    from .backends.nccl import describe as describe_nccl
    from .backends.nccl._availability import doctor_reason as nccl_reason

    for name, reason in avail.items():
        if name == "nccl" and reason is not None:
            reason = nccl_reason() or reason  # the library and the driver have lines of their own below
        print(f"  {name:<{width}}  {'available' if reason is None else 'unavailable: ' + reason}")

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


_BENCH_HARNESS = "benchmarks.p2p"


def _bench_harness() -> ModuleType | None:
    """The benchmark harness (``benchmarks.p2p``), or None when it cannot be imported.

    The harness is not part of the library: it lives in the source checkout's ``benchmarks/``
    package. When this ``transport`` is a checkout (an editable install), that checkout's harness
    is used, whatever the working directory.
    """
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "benchmarks" / "p2p" / "__init__.py").is_file() and str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    try:
        return importlib.import_module(_BENCH_HARNESS)
    except ModuleNotFoundError as exc:
        if exc.name not in ("benchmarks", _BENCH_HARNESS):
            raise  # the harness is there but something it imports is missing: say so
        return None


def bench(argv: Sequence[str]) -> int:
    """Runs the micro-benchmark (``benchmarks.p2p``) with its command-line arguments.

    Returns:
        Its exit code; 2 when the harness is not importable here (not a source checkout).
    """
    harness = _bench_harness()
    if harness is None:
        print(
            "transport bench: the benchmark harness (the benchmarks/ package) is not importable here; "
            "run it from a source checkout of transport (its root directory, or an editable install)",
            file=sys.stderr,
        )
        return 2
    code: int = harness.main(list(argv), prog="python -m transport bench")
    return code


# -------------------------------------------------------------------------------------------------
# store


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def store(args: argparse.Namespace) -> int:
    """Hosts a TCPStore until Ctrl-C / SIGTERM (or ``--duration`` seconds)."""
    from ._errors import StoreError
    from ._rendezvous import TCPStore

    try:
        # With no --host it listens on every interface (peers reach it by this host's name).
        s = TCPStore(args.host, args.port, is_host=True, timeout=args.timeout,
                     bind="0.0.0.0" if args.host_defaulted else None)
    except StoreError as exc:
        print(f"transport store: {exc}", file=sys.stderr)
        return 1
    url = f"tcp://{args.host}:{s.port}"
    print(f"hosting a rendezvous store; peers use store={url!r}  (Ctrl-C to stop)", flush=True)
    # Installed explicitly, SIGINT too: a shell starting us in the background (``&``, ``nohup``)
    # leaves SIGINT ignored, and Python then installs no handler of its own.
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    deadline = None if args.duration is None else time.monotonic() + args.duration
    try:
        while deadline is None or time.monotonic() < deadline:
            time.sleep(1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic())))
    except KeyboardInterrupt:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
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
    p = argparse.ArgumentParser(
        prog="python -m transport", description="transport: one-sided tensor movement between processes"
    )
    from . import __version__

    p.add_argument("--version", action="version", version=f"transport {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("doctor", help="what can run here (backends, versions, ipc permissions)")

    # Its options belong to the harness (benchmarks.p2p), which parses them: `bench --help` lists them.
    sub.add_parser("bench", help="put/get bandwidth and latency per backend vs memcpy", add_help=False)

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

    skipped: list[str] = []
    dumps = load_dumps(sorted(Path(directory).glob("*.json")), skipped)
    for line in skipped:
        print(f"skipped {line}", file=sys.stderr)
    if not dumps:
        print(f"no flight-recorder dumps in {directory}", file=sys.stderr)
        return 1
    print(analyze(dumps))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; returns the process exit code (0 success, 1 failure, 2 bad usage)."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "doctor":
        return doctor()
    if args.command == "bench":
        return bench(rest)
    if args.command == "flight":
        return flight(args.dir)
    if args.command == "store":
        args.host_defaulted = args.host is None
        if args.host is None:
            args.host = _default_store_host()
        return store(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse rejects unknown ones


if __name__ == "__main__":
    sys.exit(main())
