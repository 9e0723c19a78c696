"""Quickstart: a one-sided put into a process that is busy doing something else.

Two processes rendezvous through a temporary ``file://`` store:

* the **generator** (a child process) registers a ``weights`` tensor, then blocks in
  ``time.sleep`` -- no Python of it runs -- and only afterwards looks at what it received;
* the **trainer** (this process) waits for the generator, puts new weights into its memory over
  ``ipc`` while it sleeps, reads them back with a one-sided get, checks them, and rings a
  ``signal`` doorbell that the generator sees when it wakes up.

Run it with ``python examples/quickstart.py`` (asyncio) or ``python examples/quickstart.py --trio``;
the code is the same under both (``anyio`` for the few event-loop calls). It exits 0 when
everything checked out.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
import tempfile
import time

import anyio
import torch

import transport

N = 1 << 20  # float32 elements: 4 MiB
SLEEP_S = 2.0  # how long the generator stays blocked in time.sleep
TIMEOUT_S = 30.0  # bounds every wait, in both processes
# The generator's one-word status region, which the trainer reads with one-sided gets.
STARTING, SLEEPING, AWAKE = 0, 1, 2


def expected_weights() -> torch.Tensor:
    """What the trainer sends; the generator recomputes it to check what it received."""
    return torch.arange(N, dtype=torch.float32) * 0.5


# -------------------------------------------------------------------------------------------------
# generator (child process)


async def generator(store: str) -> bool:
    """Registers ``weights``, sleeps without running any Python, then checks what arrived."""
    async with transport.Transport("generator", store=store, backends=("ipc",), timeout=TIMEOUT_S) as t:
        weights = t.empty("weights", (N,), dtype=torch.float32)  # zeroed, shareable
        status = t.empty("status", (1,), dtype=torch.int64)
        status[0] = SLEEPING
        print(f"generator: registered 'weights' ({weights.nbytes} bytes); blocking in time.sleep({SLEEP_S:g})",
              flush=True)
        time.sleep(SLEEP_S)  # deliberately blocks the event loop: the trainer's put needs none of it
        status[0] = AWAKE
        version = await t.wait_signal("weights.version", at_least=1)
        ok = torch.equal(weights, expected_weights())
        print(f"generator: awake; doorbell says version {version}; weights {'correct' if ok else 'WRONG'}", flush=True)
        return ok


def generator_main(store: str, runtime: str) -> None:
    """Child process entry; its exit code is 0 only if the right weights arrived."""
    ok = asyncio.run(generator(store)) if runtime == "asyncio" else anyio.run(generator, store, backend="trio")
    sys.exit(0 if ok else 1)


# -------------------------------------------------------------------------------------------------
# trainer (this process)


async def read_status(t: transport.Transport) -> int:
    status = torch.zeros(1, dtype=torch.int64)
    await t.get(status, "generator", key="status")
    return int(status[0])


async def trainer(store: str, child: multiprocessing.process.BaseProcess) -> None:
    """Puts weights into the sleeping generator, reads them back, rings the doorbell.

    Raises:
        RuntimeError: the generator process exited before it showed up.
        RuntimeError: the data read back differs from the data sent.
        transport.TransportError: the generator did not show up, or a transfer failed.
    """
    async with transport.Transport("trainer", store=store, backends=("ipc",), timeout=TIMEOUT_S) as t:
        with anyio.fail_after(TIMEOUT_S):
            while True:  # the generator publishes itself first, its regions right after
                if not child.is_alive():
                    raise RuntimeError(f"the generator exited early (code {child.exitcode})")
                try:
                    peer = await t.peer("generator", timeout=0.5)
                except transport.PeerNotFoundError:
                    continue
                if {"weights", "status"} <= set(peer.regions) and await read_status(t) == SLEEPING:
                    break
                await anyio.sleep(0.02)
        print(f"trainer: found {peer.name} with regions {sorted(peer.regions)}; it is asleep", flush=True)

        weights = expected_weights()
        h = t.put(weights, "generator", key="weights")  # starts now; `await` waits for completion
        await h
        print(f"trainer: put {h.nbytes} bytes via {h.backend} in {h.elapsed * 1e3:.2f} ms", flush=True)

        back = torch.empty_like(weights)
        g = t.get(back, "generator", key="weights")
        await g
        if not torch.equal(back, weights):
            raise RuntimeError("the weights read back from the generator differ from those sent")
        print(f"trainer: got them back via {g.backend} in {g.elapsed * 1e3:.2f} ms: identical", flush=True)

        still_asleep = await read_status(t) == SLEEPING
        print(f"trainer: the generator {'was still' if still_asleep else 'was no longer'} in time.sleep: "
              f"{'nothing on its side ran' if still_asleep else 'it woke early'}", flush=True)

        started = time.perf_counter()
        await t.signal("generator", "weights.version", 1)  # delivered once its event loop runs again
        print(f"trainer: rang 'weights.version' = 1 (acknowledged after {time.perf_counter() - started:.2f} s, "
              "when the generator woke up)", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Runs both sides; returns 0 only if both succeeded. The child is always joined."""
    runtime = "trio" if "--trio" in (sys.argv[1:] if argv is None else argv) else "asyncio"
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="transport-quickstart-") as tmp:
        store = f"file://{tmp}"
        child = ctx.Process(target=generator_main, args=(store, runtime), name="generator")
        child.start()
        failed = False
        try:
            if runtime == "asyncio":
                asyncio.run(trainer(store, child))
            else:
                anyio.run(trainer, store, child, backend="trio")
        except Exception as exc:  # noqa: BLE001 - the program reports any failure and exits 1
            print(f"trainer: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
            failed = True
        finally:
            child.join(TIMEOUT_S if not failed else 5.0)
            if child.is_alive():
                print("trainer: the generator did not exit in time; killing it", file=sys.stderr)
                child.kill()
                child.join(5.0)
                failed = True
    if child.exitcode != 0:
        print(f"trainer: the generator exited with code {child.exitcode}", file=sys.stderr)
        failed = True
    if not failed:
        print(f"quickstart: OK (under {runtime})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
