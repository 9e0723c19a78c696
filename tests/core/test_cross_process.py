"""Real separate processes: one-sidedness, cross-process conformance, dead peers, refused CMA."""

from __future__ import annotations

import signal

import anyio
import pytest
import torch

import transport
from tests._support import PYTHON, put_and_read_back, put_each_dtype, python_env, sha


async def test_target_blocked_in_sleep_receives_64mib_over_ipc(targets, file_store):
    n = 64 << 20
    async with transport.Transport("init", store=file_store, backends=("ipc",)) as t:
        target = targets({
            "name": "sleeper", "store": file_store, "backends": ["ipc"], "initiator": "init", "mode": "sleep",
            "regions": [
                {"key": "cma", "dtype": "uint8", "numel": n},
                {"key": "shm", "dtype": "uint8", "numel": n, "shared": True},
            ],
        })
        await t.wait_signal("ready", timeout=60)
        src = torch.randint(0, 256, (n,), dtype=torch.uint8)
        # The target's thread is now stuck in time.sleep: nothing on its side can run.
        await put_and_read_back(t, "sleeper", ("cma", "shm"), src, "ipc")
        target.go()
        info = await target.result()
    assert info["woke_by_go"], "the target woke by its deadline, not after the puts"
    assert info["sha256"] == {"cma": sha(src), "shm": sha(src)}


@pytest.mark.parametrize(
    ("backend", "shared"), [("ipc", False), ("ipc", True), ("tcp", False)], ids=["ipc-cma", "ipc-shm", "tcp"]
)
async def test_cross_process_conformance(targets, file_store, backend, shared):
    sizes = {"float32": 1_000_003, "bfloat16": 4097, "float16": 7, "int8": 1, "uint8": 0, "int64": 65536, "bool": 12345}
    regions = [{"key": k, "dtype": k, "numel": n, "shared": shared} for k, n in sizes.items()]
    async with transport.Transport("init", store=file_store, backends=(backend,)) as t:
        target = targets({"name": "server", "store": file_store, "backends": [backend], "initiator": "init",
                          "mode": "serve", "regions": regions})
        await t.wait_signal("ready", timeout=60)
        expected = await put_each_dtype(t, "server", sizes, backend)
        await t.signal("server", "done", 1)
        info = await target.result()
    assert info["sha256"] == expected


async def test_dead_target_raises_peer_lost(targets, file_store, backend):
    async with transport.Transport("init", store=file_store, backends=(backend,), timeout=10) as t:
        target = targets({"name": "victim", "store": file_store, "backends": [backend], "initiator": "init",
                          "mode": "serve", "regions": [{"key": "w", "dtype": "float32", "numel": 1 << 20}]})
        await t.wait_signal("ready", timeout=60)
        await t.peer("victim", regions=["w"])
        await t.put(torch.ones(1 << 20), "victim", key="w")
        target.proc.send_signal(signal.SIGKILL)
        target.proc.wait(timeout=30)
        with anyio.fail_after(15):
            with pytest.raises(transport.PeerLostError, match="victim"):
                await t.put(torch.ones(1 << 20), "victim", key="w")
        with pytest.raises(transport.PeerNotFoundError, match="stale"):
            await t.peer("victim", timeout=0.2)


async def test_refused_cma_falls_back_with_the_reason(targets, file_store, tmp_path):
    """An initiator without CAP_SYS_PTRACE cannot attach to an undumpable target: ipc says why
    and the transfer goes over tcp instead; with ipc alone it is a clear error."""
    script = tmp_path / "init.py"
    script.write_text(f"""
import logging, sys, trio, torch, transport
logging.basicConfig(level=logging.WARNING)
async def main():
    async with transport.Transport("init", store={file_store!r}, backends=("ipc", "tcp")) as t:
        await t.wait_signal("ready", timeout=60)
        await t.peer("locked", regions=["w"])
        h = t.put(torch.full((1000,), 3.0), "locked", key="w")
        await h
        print("BACKEND", h.backend)
        async with transport.Transport("init-ipc-only", store={file_store!r}, backends=("ipc",)) as t2:
            try:
                await t2.put(torch.ones(1000), "locked", key="w")
            except transport.BackendUnavailableError as exc:
                print("IPC-ONLY", type(exc).__name__, exc)
        await t.signal("locked", "done", 1)
trio.run(main)
""")
    target = targets({"name": "locked", "store": file_store, "backends": ["ipc", "tcp"], "initiator": "init",
                      "mode": "serve", "undumpable": True,
                      "regions": [{"key": "w", "dtype": "float32", "numel": 1000}]})
    proc = await anyio.run_process(["setpriv", "--bounding-set=-sys_ptrace", PYTHON, str(script)], env=python_env(),
                                   check=False)
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    assert "BACKEND tcp" in out
    assert "not permitted" in err  # the fallback is logged with its reason
    assert "IPC-ONLY BackendUnavailableError" in out and "not permitted" in out
    info = await target.result()
    assert info["sha256"]["w"] == sha(torch.full((1000,), 3.0))
