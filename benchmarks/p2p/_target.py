"""The point-to-point benchmark's target process: ``python -m benchmarks.p2p._target ...``.

It opens a Transport, allocates one destination region with :meth:`transport.Transport.empty`
(shareable, pre-faulted) and then only waits for the exit doorbell: its application code takes no
part in any transfer, so what the initiator (:mod:`benchmarks.p2p`) measures is the one-sided
path (for ``tcp``: the background agent alone).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import torch

import transport

from ..common.errors import BenchError

TARGET_NAME = "bench-target"
REGION_KEY = "bench.dst"
EXIT_SIGNAL = "bench.exit"
PARENT_POLL_S = 0.5


async def serve(
    store: str,
    name: str,
    nbytes: int,
    backends: Sequence[str],
    timeout: float,
    lifetime: float,
    parent: int | None,
) -> None:
    """The target: registers ``nbytes`` shareable bytes and waits for the exit doorbell.

    Returns when the doorbell rings. Cancelling it closes the Transport (the region goes with it).

    Args:
        store: the rendezvous store URL shared with the initiator.
        name: this peer's name.
        nbytes: size of the region under :data:`REGION_KEY`.
        backends: the backends to speak.
        timeout: the Transport's default timeout (s).
        lifetime: seconds to wait for the doorbell at most.
        parent: the initiator's pid; when this process is orphaned it exits by itself.

    Raises:
        BenchError: the parent process went away, or no doorbell came within ``lifetime`` s.
    """
    import trio

    async with transport.Transport(name, store=store, backends=tuple(backends), timeout=timeout) as t:
        t.empty(REGION_KEY, (nbytes,), dtype=torch.uint8)
        async with trio.open_nursery() as nursery:

            async def watch_parent() -> None:
                # An orphaned target (the bench was killed) exits by itself.
                # Polls the OS (getppid): there is no event to wait on.
                while parent is None or os.getppid() == parent:
                    await trio.sleep(PARENT_POLL_S)
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch_parent)
            try:
                await t.wait_signal(EXIT_SIGNAL, at_least=1, timeout=lifetime)
            except transport.TransferTimeoutError as exc:
                raise BenchError(f"no exit doorbell within {lifetime:g}s") from exc
            nursery.cancel_scope.cancel()
        if t.signal_value(EXIT_SIGNAL) is None:
            raise BenchError(f"parent process {parent} went away")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry of the target process.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 after the doorbell, 1 on a :class:`BenchError` (printed to stderr).
    """
    import trio

    p = argparse.ArgumentParser(prog="python -m benchmarks.p2p._target", description="bench target process (internal)")
    p.add_argument("--store", required=True)
    p.add_argument("--name", default=TARGET_NAME)
    p.add_argument("--nbytes", type=int, required=True)
    p.add_argument("--backends", required=True)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--lifetime", type=float, default=3600.0)
    p.add_argument("--parent", type=int, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="bench-target %(levelname)s %(name)s: %(message)s")
    backends = tuple(b for b in args.backends.split(",") if b)
    try:
        trio.run(serve, args.store, args.name, args.nbytes, backends, args.timeout, args.lifetime, args.parent)
    except BenchError as exc:
        print(f"bench target: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
