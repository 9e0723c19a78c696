"""A striped put given up on midway must not land over a later put: the chunks it left on a
lane's connection settle before an overlapping transfer moves a byte.

Host T (initiator) and host R (target), two NICs each (tests/_support/netns.py), NIC 1 of T
shaped slow. T starts a striped put of the first bytes into R's region (a plain one, or a
prepared one: PUTR frames) and gives it up while the slow lane still has chunks in its socket's
buffer (``ss`` shows them): it is cancelled, or runs out of time, or NIC 1 is cut and the lane
given up for stalling (the put then ends on NIC 0). With NIC 1 cut, so that those bytes stay
on the wire, T puts the second bytes over the whole region, in pieces too small to stripe: they
take one connection, by NIC 0. A while later (or once that put is done) NIC 1 comes back, the
stale bytes reach R and R writes them. Once no byte to or from R's NIC 1 is queued anywhere,
R's region must hold exactly the second bytes.

Without settling, the second put is done long before NIC 1 comes back, and the first put's
chunks land over it (cancelled, or out of time: the lane's connection stays open, or is closed
with its queue still to send). With it, the pieces that overlap those chunks wait until R has
ended their connection, so they land last. The connection of a lane given up for stalling is
settled the same way (its queue is not dropped at once, and may still be delivered): that case
checks its chunks are waited for too, though it would also hold were the queue dropped. The
pause is choreography, not an assertion: with settling the result holds however long it is.
Needs root (network namespaces).
"""

from __future__ import annotations

import json
import subprocess

import anyio
import pytest
from anyio.abc import TaskGroup

from tests._support import PYTHON, ROOT, python_env
from tests._support.netns import Fabric, unavailable_reason

NBYTES = 32 << 20  # 8 chunks of the stripe (STRIPE_CHUNK)
PIECE = 4 << 20  # the second put's pieces: below STRIPE_MIN_BYTES, so one connection each
RATE_MBIT = 1000
SLOW_MBIT = 16  # T's NIC 1: a 4 MiB chunk takes about 2 s on it
QUEUED = 1 << 20  # bytes in the slow lane's socket, at least, before the first put is given up
TIMEOUT = 60.0
PAUSE_S = 5.0  # how long NIC 1 stays cut while the second put runs (unless it is done first)
FIRST_TIMEOUT_S = 2.0  # "timeout": the first put's (its slow lane needs twice that)
WAIT_S = 180.0

netns = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")


class _Peer:
    """A stripe_settle_peer process and the lines it prints, read by a task of ``tg``."""

    def __init__(self, fab: Fabric, tg: TaskGroup, host: str, spec: dict, log) -> None:
        self.proc = fab.popen(host, [PYTHON, "-m", "tests.peers.stripe_settle_peer", json.dumps(spec)],
                              env=python_env(), cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=log, text=True)
        self._send, self._lines = anyio.create_memory_object_stream[str](100)
        tg.start_soon(self._read)

    async def _read(self) -> None:
        async with self._send:
            while line := await anyio.to_thread.run_sync(self.proc.stdout.readline):
                await self._send.send(line)

    async def line(self, prefix: str) -> str:
        """The rest of the next line that starts with ``prefix``."""
        async for line in self._lines:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise AssertionError(f"no {prefix!r} line (exit {self.proc.wait()})")

    def tell(self, what: str = "go") -> None:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()


def _queued(fab: Fabric, host: str, peer: str, column: int) -> int:
    """Bytes queued on ``host``'s TCP sockets whose peer is the address ``peer``: column 1 of
    ``ss`` (Recv-Q: received, not yet read) or 2 (Send-Q: sent, not yet acknowledged)."""
    out = fab.run(host, ["ss", "-tnH", "state", "all", "dst", peer])
    return sum(int(row.split()[column]) for row in out.splitlines() if row.strip())


async def _until(check) -> None:
    while not check():
        await anyio.sleep(0.1)


@netns
@pytest.mark.parametrize("how", ["cancel", "timeout", "stall", "cancel-prepared"])
async def test_a_striped_put_given_up_does_not_land_over_the_next_put(tmp_path, how):
    prepared = how.endswith("-prepared")
    how = how.removesuffix("-prepared")
    with Fabric({"T": 2, "R": 2}, rate_mbit=RATE_MBIT) as fab:
        fab.run("T", ["tc", "qdisc", "replace", "dev", fab.dev("T", 1), "root", "tbf", "rate", f"{SLOW_MBIT}mbit",
                      "burst", "64k", "latency", "20ms"])
        slow_r, slow_t = fab.addr("R", 1), fab.addr("T", 1)
        store = f"file://{tmp_path / 'store'}"
        spec = {"store": store, "nbytes": NBYTES, "timeout": TIMEOUT, "piece": PIECE,
                "first_timeout": FIRST_TIMEOUT_S if how == "timeout" else TIMEOUT, "prepared": prepared}
        with open(tmp_path / "target.log", "w") as tlog, open(tmp_path / "initiator.log", "w") as ilog:
            async with anyio.create_task_group() as tg:
                target = _Peer(fab, tg, "R", {**spec, "role": "target", "name": "R", "peer": "T",
                                              "listen": ",".join(fab.addrs("R"))}, tlog)
                init = _Peer(fab, tg, "T", {**spec, "role": "initiator", "name": "T", "peer": "R",
                                            "listen": ",".join(fab.addrs("T"))}, ilog)
                try:
                    with anyio.fail_after(WAIT_S):
                        await init.line("START")
                        if how != "timeout":  # once the slow lane has chunks in its socket's buffer
                            await _until(lambda: _queued(fab, "T", slow_r, 2) >= QUEUED)
                        if how == "stall":
                            fab.link("T", 1, up=False)
                        init.tell(how)
                        ended = json.loads(await init.line("ENDED"))
                        fab.link("T", 1, up=False)
                        stale = _queued(fab, "T", slow_r, 2)
                        init.tell()  # the second put, by NIC 0
                        done = None
                        with anyio.move_on_after(PAUSE_S):
                            done = json.loads(await init.line("DONE"))
                        fab.link("T", 1, up=True)
                        if done is None:
                            done = json.loads(await init.line("DONE"))
                        # every byte the first put left on the wire reached R, and R read it
                        await _until(lambda: _queued(fab, "T", slow_r, 2) == 0)
                        await _until(lambda: _queued(fab, "R", slow_t, 1) == 0)
                        target.tell()
                        landed = json.loads(await target.line("RESULT"))
                finally:  # (their readers end with their output)
                    for peer in (init, target):
                        peer.proc.kill()
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))
    # the first put was given up as meant, with bytes of its slow lane on the wire
    lanes = {s["lane"].split(">")[1].rsplit(":", 1)[0]: s for s in ended.pop("lanes")}
    if how == "stall":
        assert ended == {"error": None, "partial": False}, (ended, logs)  # (NIC 0 carried the rest)
        assert lanes[slow_r]["failures"] == 1 and not lanes[slow_r]["up"], lanes
    else:
        error = "TransferAbortedError" if how == "cancel" else "TransferTimeoutError"
        assert ended == {"error": error, "partial": True}, (ended, logs)
        assert stale > 0, "the first put left nothing on the slow lane: the scenario did not happen"
    assert done["error"] is None, (done, logs)
    assert landed["exact"], (f"{landed['differ']} bytes of R's region are not the second put's, {landed['first']} of "
                             f"them the first put's: its chunks landed over the second put", logs)
