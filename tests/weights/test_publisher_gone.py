"""A generator outlives its trainer: versions the trainer completed into a generator's slots
before it left are applied by every apply path, however it left: it closed and exited (its
record leaves the store), or it was killed (a crash: on another host its record stays listed,
and every read of it fails).

The trainer is a real process (tests/peers/leaving_publisher.py) that publishes versions 1 and 2
and leaves; the subscribers are real Transports in this process, each trying its apply path only
once the trainer's process has ended. "Another host" is a trainer in its own PID namespace
(``unshare --pid``), which the library treats as another host (no ipc; tcp only). Before the
fix, ``apply_async()`` and ``wait_version(2)`` raised ``PeerNotFoundError`` / ``PeerLostError``
(they asked the publisher's control block over the network before taking a version past the
last vouched one) while ``apply()`` took it; a mesh leader could not commit once no trainer
rank was listed, and catching up, pulling and waiting raised ``PeerLostError`` for a trainer
rank listed but gone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
import torch

import transport
from tests._support import PYTHON, ROOT, python_env
from transport.plan import GeneratorRank, LocalTensor, Piece, full_box
from transport.weights import MeshSubscriber, Subscriber
from transport.weights._mesh_control import MeshKeys

NUMEL = 1 << 12
UNSHARE = ["unshare", "--pid", "--fork"]


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=30).returncode == 0


other_host = pytest.mark.skipif(not _can_unshare(), reason="needs unshare --pid (root or user namespaces)")
WHERE = [pytest.param("ipc", id="ipc"), pytest.param("tcp", id="tcp"),
         pytest.param("other-host", id="other-host", marks=other_host)]
LEAVES = [pytest.param("close", id="exited"), pytest.param("kill", id="killed")]


class _Trainer:
    """tests/peers/leaving_publisher.py as a process (in its own PID namespace for
    ``other-host``), always reaped."""

    def __init__(self, tmp: Path, store: str, where: str, leave: str, **spec: object) -> None:
        self.leave = leave
        spec = {"name": "trainer", "store": store, "numel": NUMEL, "versions": [1, 2],
                "backends": ["ipc" if where == "ipc" else "tcp"], "leave": "close" if leave == "close" else "stay",
                **spec}
        self.log = open(tmp / "trainer.log", "wb")
        self.proc = subprocess.Popen([*(UNSHARE if where == "other-host" else []), PYTHON, "-m",
                                      "tests.peers.leaving_publisher", json.dumps(spec)],
                                     env=python_env(), cwd=ROOT, stderr=self.log, start_new_session=True)

    async def gone(self, t: transport.Transport) -> None:
        """Waits until it has published version 2 (its signal to ``t``), kills it (``kill``),
        and waits for its process to end (a guard of 120 s against a hang)."""
        with anyio.fail_after(120):
            await t.wait_signal("published", at_least=2, timeout=120)
            if self.leave == "kill":
                os.killpg(self.proc.pid, signal.SIGKILL)
            rc = await anyio.to_thread.run_sync(self.proc.wait)
        self.log.flush()
        assert rc == (0 if self.leave == "close" else -signal.SIGKILL), \
            f"trainer ended with {rc}:\n{Path(self.log.name).read_text(errors='replace')[-3000:]}"

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture
def trainer(tmp_path, file_store):
    made: list[_Trainer] = []

    def start(where: str, leave: str, **spec: object) -> _Trainer:
        made.append(_Trainer(tmp_path, file_store, where, leave, **spec))
        return made[-1]

    yield start
    for t in made:
        t.close()


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("leave", LEAVES)
async def test_every_apply_path_applies_what_the_trainer_completed_before_it_left(trainer, file_store, where,
                                                                                   leave, caplog):
    """Each subscriber holds version 2 complete in a slot, unapplied, when the trainer has gone;
    each path applies it. On the trainer's host (ipc) the subscriber still reads the trainer's
    control block through its own mapping, which outlives the trainer: version 2 is vouched
    for. Elsewhere the block cannot be read any more and version 2 is taken as it is, as
    ``apply()`` takes it (logged)."""
    caplog.set_level(logging.INFO, logger="transport.weights")
    paths = ["apply_async", "wait_version", "apply", "zero_copy"]
    backend = "ipc" if where == "ipc" else "tcp"
    async with contextlib.AsyncExitStack() as stack:
        ts = [await stack.enter_async_context(transport.Transport(f"gen-{p}", store=file_store, backends=(backend,),
                                                                    timeout=20)) for p in paths]
        proc = trainer(where, leave, expect=[t.name for t in ts], notify=ts[0].name)
        live = {p: {"w": torch.zeros(NUMEL)} for p in paths}
        subs = {p: await stack.enter_async_context(Subscriber(t, live[p], publisher="trainer",
                                                               zero_copy=p == "zero_copy"))
                for p, t in zip(paths, ts, strict=True)}
        await ts[0].signal("trainer", "go", 1)
        await proc.gone(ts[0])
        for p, sub in subs.items():
            assert sub.latest == 2 and sub.version is None, p  # complete in a slot, not yet applied
        assert await subs["apply_async"].apply_async() == 2
        assert await subs["wait_version"].wait_version(2, timeout=20) == 2
        assert subs["apply"].apply() == 2
        assert await subs["zero_copy"].apply_async() == 2
        for p, sub in subs.items():
            assert sub.version == 2 and bool((live[p]["w"] == 2).all()), p
            assert sub.apply() is None and await sub.apply_async() is None, p  # nothing newer, and no error
        with pytest.raises(transport.TransferTimeoutError):  # the only error wait_version raises for it
            await subs["wait_version"].wait_version(3, timeout=0.5)
    unasked = [r.getMessage() for r in caplog.records if "cannot ask trainer" in r.getMessage()]
    if where == "ipc":
        assert not unasked, unasked  # the mapping vouched for every one
    else:
        assert len(unasked) == len(paths), unasked


def _whole(numel: int) -> GeneratorRank:
    shape = (numel,)
    return GeneratorRank.of([LocalTensor("w", shape, "float32", (Piece("w", full_box(shape), full_box(shape)),))])


@pytest.mark.parametrize("where", [WHERE[0], WHERE[2]])
@pytest.mark.parametrize("leave", LEAVES)
async def test_a_mesh_replica_commits_and_applies_what_the_trainer_completed_before_it_left(trainer, file_store,
                                                                                           where, leave):
    """A replica of two ranks. The leader has seen the trainer rank once (a commit before any
    version: nothing to commit yet, but it knows the plan); rank 1 has not. The trainer
    publishes 1 and 2 to both and leaves. The leader commits 2, rank 1 sees it committed, both
    apply it; catching up and pulling find nothing to fetch and say so in their own terms
    (None, a timeout)."""
    backend = "ipc" if where == "ipc" else "tcp"
    async with (transport.Transport("gen0", store=file_store, backends=(backend,), timeout=20) as t0,
                transport.Transport("gen1", store=file_store, backends=(backend,), timeout=20) as t1):
        proc = trainer(where, leave, mesh=True, expect=["A/0", "A/1"], notify="gen0")
        async with (MeshSubscriber(t0, "m", replica="A", rank=0, size=2, layout=_whole(NUMEL), timeout=20) as s0,
                    MeshSubscriber(t1, "m", replica="A", rank=1, size=2, layout=_whole(NUMEL), timeout=20) as s1):
            await t0.peer("trainer", regions=[MeshKeys.of("m").snaps[1]], timeout=60)  # its last region
            assert await s0.commit() is None
            await t0.signal("trainer", "go", 1)
            await proc.gone(t0)
            assert await s0.commit() == 2
            assert await s1.wait_committed(2) == 2
            for s in (s0, s1):
                assert s.apply() == 2 and bool((s.tensors["w"] == 2).all())
                assert await s.catch_up(after=0.0) is None  # nothing to catch up from a trainer that left
                with pytest.raises(transport.TransferTimeoutError):
                    await s.pull(timeout=0.5)
