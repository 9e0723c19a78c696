"""The NIXL peer's target process: ``python -m benchmarks.p2p._nixl_target ...`` (see :mod:`._nixl`).

It creates a NIXL agent with the UCX backend, registers one pre-faulted DRAM region, connects to
the initiator's Unix socket and sends its hello (the region and its agent metadata); then it only
waits. Its application code takes no part in any transfer: the initiator's WRITEs and READs are
one-sided. The connection closing (at the end of the run, or because the initiator died) is the
exit bell.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import torch

from ..common.errors import BenchError
from ._nixl import MEM_TYPE, TARGET_AGENT, load_api, make_agent
from ._peer import TargetHello, send_hello_and_wait


def serve(socket_path: str, nbytes: int, timeout: float, lifetime: float) -> None:
    """Registers ``nbytes`` of DRAM with NIXL, sends the hello, waits for the connection to close.

    Args:
        socket_path: the initiator's listening Unix socket.
        nbytes: size of the region.
        timeout: seconds bounding the connect and the hello.
        lifetime: seconds to wait for the exit bell at most.

    Raises:
        BenchError: NIXL is not installed or has no UCX backend, or no exit bell came within
            ``lifetime`` s.
        OSError: the socket could not be reached.
    """
    api = load_api()
    if api is None:
        raise BenchError("NIXL is not installed")
    region = torch.zeros(nbytes, dtype=torch.uint8)  # zeroed: every page touched before the timings
    # NIXL's progress thread (its default) answers the initiator's connection set-up: this
    # process makes no NIXL call after the hello.
    agent = make_agent(api, TARGET_AGENT, progress_thread=True)
    descs = agent.get_reg_descs([(region.data_ptr(), nbytes, 0, "")], MEM_TYPE)
    agent.register_memory(descs)
    try:
        hello = TargetHello(region.data_ptr(), nbytes, agent.get_agent_metadata())
        send_hello_and_wait(socket_path, hello, timeout, lifetime)
    finally:
        agent.deregister_memory(descs)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry of the target process.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 after the exit bell, 1 on any failure (one line on stderr).
    """
    p = argparse.ArgumentParser(prog="python -m benchmarks.p2p._nixl_target", description="NIXL target (internal)")
    p.add_argument("--socket", required=True)
    p.add_argument("--nbytes", type=int, required=True)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--lifetime", type=float, default=3600.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="nixl-target %(levelname)s %(name)s: %(message)s")
    try:
        serve(args.socket, args.nbytes, args.timeout, args.lifetime)
    except Exception as exc:  # noqa: BLE001 - NIXL raises its own types; the initiator quotes this line
        print(f"nixl target: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
