"""The Mooncake peer's target process: ``python -m benchmarks.p2p._mooncake_target ...``
(see :mod:`._mooncake`).

It initializes a Mooncake ``TransferEngine`` (TCP transport, P2P handshake metadata), registers
one pre-faulted DRAM region and sends its hello (the region and the engine's session name); then
it only waits. Its application code takes no part in any transfer: Mooncake's own threads serve
the initiator's writes and reads. The connection closing is the exit bell.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import torch

from ..common.errors import BenchError
from ._mooncake import HOST, load_api, make_engine, register
from ._peer import TargetHello, send_hello_and_wait


def serve(socket_path: str, nbytes: int, timeout: float, lifetime: float) -> None:
    """Registers ``nbytes`` of DRAM with Mooncake, sends the hello, waits for the connection to close.

    Raises:
        BenchError: Mooncake is not installed or failed to set up, or no exit bell came in time.
        OSError: the socket could not be reached.
    """
    api = load_api()
    if api is None:
        raise BenchError("Mooncake is not installed")
    region = torch.zeros(nbytes, dtype=torch.uint8)  # zeroed: every page touched before the timings
    engine = make_engine(api)
    register(engine, region)
    try:
        session = f"{HOST}:{engine.get_rpc_port()}"
        send_hello_and_wait(socket_path, TargetHello(region.data_ptr(), nbytes, session.encode()), timeout, lifetime)
    finally:
        engine.unregister_memory(region.data_ptr())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry of the target process.

    Returns:
        The exit code: 0 after the exit bell, 1 on any failure (one line on stderr).
    """
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.p2p._mooncake_target", description="Mooncake target (internal)"
    )
    p.add_argument("--socket", required=True)
    p.add_argument("--nbytes", type=int, required=True)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--lifetime", type=float, default=3600.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="mooncake-target %(levelname)s %(name)s: %(message)s")
    try:
        serve(args.socket, args.nbytes, args.timeout, args.lifetime)
    except Exception as exc:  # noqa: BLE001 - Mooncake raises its own types; the initiator quotes this line
        print(f"mooncake target: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
