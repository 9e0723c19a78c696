"""What the peers of ``--peers`` (NIXL, Mooncake) share: their target process and its hello.

Each peer library is measured between this process (the initiator) and a target process of its
own. The initiator listens on a Unix socket in the run's temporary directory and starts the
target; the target sets the library up, registers one pre-faulted DRAM region and connects to
send a :class:`TargetHello` (the region's address and size, and the opaque bytes the initiator
needs to reach it). Then the target only waits: the connection closing is its exit bell, also
when the initiator dies. Its application code takes no part in any transfer.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TypeVar

from ..common.errors import BenchError
from ..common.procs import CHECKOUT, LoggedProcess, checkout_env, module_command
from ..common.sizes import MiB
from ._report import BenchConfig, PeerResult

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# The hello: magic, version, region address, region bytes, metadata length; then the metadata.
_HELLO = struct.Struct("!4sHQQI")
_HELLO_MAGIC = b"TBPR"
_HELLO_VERSION = 1
_MAX_METADATA_BYTES = 64 * MiB
START_TIMEOUT_S = 60.0
"""How long a target may take to connect: it imports torch and its library and pre-faults its region."""
_ACCEPT_POLL_S = 0.25  # while waiting for the target to connect, how often to check it has not died


@dataclass(frozen=True)
class TargetHello:
    """What a peer's target tells the initiator: where its registered region is, and the bytes
    that reach it (NIXL: its agent metadata; Mooncake: its session name)."""

    address: int
    nbytes: int
    metadata: bytes

    def encode(self) -> bytes:
        """The hello as sent on the socket."""
        header = _HELLO.pack(_HELLO_MAGIC, _HELLO_VERSION, self.address, self.nbytes, len(self.metadata))
        return header + self.metadata


def _recv_exact(sock: socket.socket, n: int, peer: str) -> bytes:
    """Exactly ``n`` bytes from ``sock`` (its own timeout bounds every wait).

    Raises:
        BenchError: the target closed the connection first.
        TimeoutError: the socket's timeout passed.
    """
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise BenchError(f"the {peer} target closed the connection {n - left} bytes into a {n}-byte message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_hello(sock: socket.socket, peer: str) -> TargetHello:
    """Reads and checks the target's hello (``peer`` names the library in errors).

    Raises:
        BenchError: not a hello of this version, or the connection closed early.
        TimeoutError: the socket's timeout passed.
    """
    magic, version, address, nbytes, md_len = _HELLO.unpack(_recv_exact(sock, _HELLO.size, peer))
    if magic != _HELLO_MAGIC or version != _HELLO_VERSION:
        raise BenchError(f"the {peer} target sent no hello of version {_HELLO_VERSION} (magic {magic!r}, v{version})")
    if not 0 < md_len <= _MAX_METADATA_BYTES:
        raise BenchError(f"the {peer} target announced {md_len} bytes of metadata")
    return TargetHello(address, nbytes, _recv_exact(sock, md_len, peer))


def send_hello_and_wait(socket_path: str, hello: TargetHello, timeout: float, lifetime: float) -> None:
    """The target's side: connects, sends ``hello``, then waits for the connection to close.

    Raises:
        BenchError: no exit bell came within ``lifetime`` s.
        OSError: the socket could not be reached.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(socket_path)
        conn.sendall(hello.encode())
        conn.settimeout(lifetime)
        try:
            while conn.recv(4096):  # the initiator sends nothing; EOF is the bell
                pass
        except TimeoutError as exc:
            raise BenchError(f"no exit bell within {lifetime:g}s") from exc


def _accept(listener: socket.socket, target: LoggedProcess, timeout: float, peer: str) -> socket.socket:
    """The target's connection, once it has set its library up and registered its region.

    Raises:
        BenchError: the target exited, or did not connect within ``timeout`` s.
    """
    deadline = time.monotonic() + timeout
    listener.settimeout(_ACCEPT_POLL_S)
    while time.monotonic() < deadline:
        try:
            conn, _ = listener.accept()
            return conn
        except TimeoutError:
            failure = target.failure()
            if failure is not None:
                raise BenchError(failure) from None
    raise BenchError(
        f"the {peer} target did not connect within {timeout:g}s; its output ends with:\n{target.output_tail()}"
    )


def with_target(
    peer: str,
    module: str,
    args: Sequence[str],
    workdir: Path,
    timeout: float,
    measure: Callable[[TargetHello], _T],
) -> _T:
    """Starts the target (``python -m module --socket PATH ARGS``), reads its hello, runs
    ``measure(hello)`` while it serves, and always joins it (closing the connection rings its bell).

    Args:
        peer: the library's name, for the socket, the log and errors.
        module: the target's module, dotted in full.
        args: its other arguments.
        workdir: a private temporary directory (the socket and the target's log go there).
        timeout: seconds bounding the hello once the target has connected.
        measure: what runs against the target (blocking).

    Returns:
        What ``measure`` returned.

    Raises:
        BenchError: the target failed, did not connect in time, or sent no valid hello.
        BaseException: whatever ``measure`` raised (the target is killed and joined first).
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        path = workdir / f"{peer}.sock"
        listener.bind(str(path))
        listener.listen(1)
        cmd = module_command(module, "--socket", str(path), *args)
        target = LoggedProcess(cmd, workdir / f"{peer}-target.log", env=checkout_env(), cwd=CHECKOUT)

        def initiate() -> _T:
            with _accept(listener, target, START_TIMEOUT_S + timeout, peer) as conn:
                conn.settimeout(timeout)
                return measure(read_hello(conn, peer))

        return target.supervise(initiate)


def measure_peer(
    peer: str,
    load_api: Callable[[], ModuleType | None],
    install_hint: str,
    version: Callable[[], str],
    target: str,
    args: Sequence[str],
    workdir: Path,
    config: BenchConfig,
    initiate: Callable[[ModuleType, TargetHello], PeerResult],
) -> PeerResult:
    """Measures one other library against its own target process (``python -m target``),
    never raising: not installed, or anything about it failing, becomes the result's
    ``unavailable`` reason, so the rest of the run stands.

    Args:
        peer: the library's name.
        load_api: imports it (None: not installed; BenchError: installed but broken).
        install_hint: how to install it, for the report.
        version: its version, for the report of a failure.
        target: the target's module, dotted in full.
        args: the target's other arguments.
        workdir: a private temporary directory (the socket and the target's log go there).
        config: the run's configuration: its timeout bounds each step (see :func:`with_target`),
            and the target must have registered its ``region_bytes``.
        initiate: the measurement, given the imported module and the target's hello.
    """
    try:
        api = load_api()
    except BenchError as exc:
        return PeerResult(peer, unavailable=f"failed: {exc}")
    if api is None:
        return PeerResult(peer, unavailable=f"not installed ({install_hint})")
    try:

        def checked(hello: TargetHello) -> PeerResult:
            if hello.nbytes < config.region_bytes:
                raise BenchError(f"the {peer} target registered {hello.nbytes} bytes, not {config.region_bytes}")
            return initiate(api, hello)

        return with_target(peer, target, args, workdir, config.timeout, checked)
    except Exception as exc:  # whatever the library raised becomes the reason; our rows stand
        log.debug("%s measurement failed", peer, exc_info=True)
        why = str(exc).strip() if isinstance(exc, BenchError) else f"{type(exc).__name__}: {str(exc).strip()}"
        return PeerResult(peer, detail=version(), unavailable=f"failed: {why}")


def timed(op: Callable[[], object], iters: int, warmup: int) -> list[float]:
    """Runs ``op`` ``warmup`` times, then ``iters`` times; returns the timed durations (s)."""
    for _ in range(warmup):
        op()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        op()
        times.append(time.perf_counter() - t0)
    return times
