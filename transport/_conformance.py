"""The conformance checks behind :func:`transport.testing.check_backend`.

Each check opens a fresh pair of Transports (an initiator ``a`` and a target ``b`` that speak
the backend under test) from the caller's factory, both in this process so that the target's
memory is inspected directly, and raises AssertionError (or the unexpected error) when the
backend does not behave as the library promises.

Size: one concept, a flat list of independent checks (each a short async function plus its
registration); splitting the list would only scatter it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from . import (
    BoundsError,
    ClosedError,
    DTypeMismatchError,
    LayoutError,
    PeerNotFoundError,
    ReadOnlyRegionError,
    RegistrationError,
    TransferAbortedError,
    TransferTimeoutError,
    Transport,
    gather,
)
from ._tensors import MemoryKind
from ._transfers import SYNC_MAX_BYTES
from .backends import Backend, backend_class

log = logging.getLogger(__name__)

PairFactory = Callable[[], AbstractAsyncContextManager[tuple[Transport, Transport]]]
"""Called once per check; ``async with make_pair() as (a, b)`` gives two open Transports."""

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int64, torch.bool)
SIZES = (0, 1, 7, 4097, 1_000_003)


def pair_factory(
    backend: str,
    store_url: str | None = None,
    *,
    names: tuple[str, str] = ("a", "b"),
    loopback: bool = False,
    **kw: Any,
) -> PairFactory:
    """A :data:`PairFactory` of two Transports in this process that speak only ``backend``.

    Args:
        backend: the backend's registered name.
        store_url: the rendezvous store both use (default: a fresh ``memory://`` store per pair).
        names: the initiator's and the target's names.
        loopback: yield one Transport as both ``a`` and ``b`` (transfers to itself), for a
            backend that cannot pair two endpoints in one process (e.g. nccl on one GPU).
        kw: more :class:`transport.Transport` arguments (``timeout`` defaults to 20 s).

    Returns:
        The factory; each call opens a new pair (closed when its ``async with`` ends).
    """
    kw.setdefault("timeout", 20.0)

    @contextlib.asynccontextmanager
    async def make_pair() -> AsyncIterator[tuple[Transport, Transport]]:
        store = store_url or f"memory://{uuid.uuid4().hex}"
        if loopback:
            async with Transport(names[0], store=store, backends=(backend,), **kw) as t:
                yield t, t
            return
        async with Transport(names[0], store=store, backends=(backend,), **kw) as a, \
                Transport(names[1], store=store, backends=(backend,), **kw) as b:
            yield a, b

    return make_pair


@dataclass
class _Env:
    """One check's pair and what it is expected to do."""

    a: Transport
    b: Transport
    backend: str
    device: torch.device
    after_close: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    @property
    def peer(self) -> str:
        return self.b.name

    @property
    def loopback(self) -> bool:
        return self.a is self.b

    def zeros(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def full(self, n: int, value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((n,), value, dtype=dtype, device=self.device)

    def random(self, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        if dtype == torch.bool:
            t = torch.randint(0, 2, (n,), generator=g).bool()
        elif dtype.is_floating_point:
            t = torch.randn(n, generator=g).to(dtype)
        else:
            info = torch.iinfo(dtype)
            lo, hi = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
            t = torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype)
        return t.to(self.device)


class _SetupError(ValueError):
    """check_backend was called in a way that cannot work (reported at once, not as a check)."""


_Check = Callable[[_Env], Awaitable[None]]
_REGISTRY: dict[str, _Check] = {}


def _check(name: str) -> Callable[[_Check], _Check]:
    def add(fn: _Check) -> _Check:
        _REGISTRY[name] = fn
        return fn

    return add


def _ensure(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


@contextlib.contextmanager
def _raises(expected: type[BaseException], match: str | None = None) -> Iterator[list[BaseException]]:
    """Like ``pytest.raises``: the block must raise ``expected`` (whose message matches)."""
    caught: list[BaseException] = []
    try:
        yield caught
    except expected as exc:
        if match is not None and not re.search(match, str(exc)):
            raise AssertionError(f"{type(exc).__name__}({str(exc)!r}) does not match {match!r}") from exc
        caught.append(exc)
        return
    raise AssertionError(f"expected {expected.__name__}{f' matching {match!r}' if match else ''}, nothing was raised")


def _same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    return torch.equal(x.view(torch.uint8) if x.numel() else x, y.view(torch.uint8) if y.numel() else y)


# -- the checks, in the order they run ----------------------------------------------------------


@_check("roundtrip")
async def _roundtrip(env: _Env) -> None:
    a, b = env.a, env.b
    for dtype in DTYPES:
        for numel in SIZES:
            case = f"{str(dtype).removeprefix('torch.')}[{numel}]"
            key = f"r.{case}"
            dst = env.zeros(numel, dtype=dtype)
            b.register(key, dst)
            await a.peer(env.peer, regions=[key])
            src = env.random(numel, dtype, seed=numel)
            h = a.put(src, env.peer, key=key)
            await h
            _ensure(h.done() and h.exception() is None, f"{case}: the handle did not end cleanly: {h!r}")
            _ensure(h.nbytes == src.numel() * src.element_size(), f"{case}: nbytes {h.nbytes}")
            _ensure(_same_bytes(dst, src), f"{case}: target memory differs from what was put")
            back = torch.empty(numel, dtype=dtype, device=env.device)
            await a.get(back, env.peer, key=key)
            _ensure(_same_bytes(back, src), f"{case}: get returned different bytes")
            _ensure(h.backend == env.backend, f"{case}: carried by {h.backend!r}, not {env.backend!r}")
            b.unregister(key)


@_check("offsets")
async def _offsets(env: _Env) -> None:
    a, b = env.a, env.b
    dst = env.zeros(1000, dtype=torch.int64)
    b.register("o", dst)
    await a.peer(env.peer, regions=["o"])
    src = env.random(100, torch.int64, 1)
    await a.put(src, env.peer, key="o", offset=300 * 8)
    _ensure(torch.equal(dst[300:400], src), "the put did not land at its offset")
    _ensure(not dst[:300].any() and not dst[400:].any(), "a put at an offset touched bytes outside its range")
    part = torch.empty(10, dtype=torch.int64, device=env.device)
    await a.get(part, env.peer, key="o", offset=350 * 8)
    _ensure(torch.equal(part, src[50:60]), "a get at an offset read the wrong bytes")


@_check("non_contiguous_source")
async def _non_contiguous_source(env: _Env) -> None:
    a, b = env.a, env.b
    dst = env.zeros(64, 32)
    b.register("nc", dst)
    await a.peer(env.peer, regions=["nc"])
    src = torch.randn(32, 64, device=env.device).t()  # non-contiguous view, 64x32
    _ensure(not src.is_contiguous(), "the source view should be non-contiguous")
    await a.put(src, env.peer, key="nc")
    _ensure(torch.equal(dst, src), "a non-contiguous source arrived wrong")


@_check("key_default")
async def _key_default(env: _Env) -> None:
    a, b = env.a, env.b
    src = torch.randn(256, device=env.device)
    if not env.loopback:  # (a loopback pair's region "w" is src itself)
        b.register("w", env.zeros(256))
    a.register("w", src)
    await a.peer(env.peer, regions=["w"])
    h = a.put(src, env.peer)
    _ensure(h.key == "w", f"the key should default to the local registration 'w', got {h.key!r}")
    await h
    _ensure(torch.equal(b.regions["w"].tensor, src), "the put with a default key did not arrive")


def _synchronous(env: _Env) -> bool:
    """Whether ``env``'s backend has a synchronous path for host transfers (``Backend.mover``)."""
    return env.device.type == "cpu" and backend_class(env.backend).mover is not Backend.mover


async def warm_sync_route(a: Transport, peer: str, src: torch.Tensor, key: str, offset: int = 0) -> None:
    """Puts ``src`` until one completes inside ``put()``: a backend may open its synchronous
    path on first use (the tcp direct lane connects in the background). Bounded: 10 s."""
    with anyio.fail_after(10):
        while not (h := a.put(src, peer, key=key, offset=offset)).done():
            await h
            await anyio.sleep(0.01)


@_check("many_in_flight")
async def _many_in_flight(env: _Env) -> None:
    a, b = env.a, env.b
    count, chunk = 128, 4096
    dst = env.zeros(count * chunk, dtype=torch.int64)
    b.register("many", dst)
    await a.peer(env.peer, regions=["many"])
    srcs = [env.full(chunk, i + 1, torch.int64) for i in range(count)]
    if _synchronous(env):
        await warm_sync_route(a, env.peer, srcs[0], "many")
    handles = [a.put(s, env.peer, key="many", offset=i * chunk * 8) for i, s in enumerate(srcs)]
    if _synchronous(env):  # put() completes small host transfers itself (Backend.mover)
        # A reply later than the synchronous bound (2 ms; a loaded machine) sends a put, and
        # those behind it while its lane is busy, the asynchronous way: "most", of one of three
        # bursts. A backend whose synchronous path never works fails all three.
        inline = [sum(h.done() for h in handles)]
        while inline[-1] <= count // 2 and len(inline) < 3:
            await gather(*handles)
            handles = [a.put(s, env.peer, key="many", offset=i * chunk * 8) for i, s in enumerate(srcs)]
            inline.append(sum(h.done() for h in handles))
        _ensure(inline[-1] > count // 2,
                f"small host puts on a known route should complete inside put() (of {count}, {inline} did)")
    else:
        _ensure(sum(not h.done() for h in handles) > 100, "transfers should be in flight concurrently")
    await gather(*handles)
    expected = torch.arange(1, count + 1, dtype=torch.int64, device=env.device).repeat_interleave(chunk)
    _ensure(torch.equal(dst, expected), "concurrent puts left the wrong bytes")


@_check("signal_ordering")
async def _signal_ordering(env: _Env) -> None:
    """The doorbell is visible only after every earlier put: puts are not awaited before it."""
    a, b = env.a, env.b
    count, n = 32, 1 << 18
    dst = env.zeros(count * n)
    b.register("sig", dst)
    await a.peer(env.peer, regions=["sig"])
    for i in range(count):
        a.put(env.full(n, float(i + 1)), env.peer, key="sig", offset=i * n * 4)
    seen: dict[str, Any] = {}

    async def target() -> None:
        seen["v"] = await b.wait_signal("version", at_least=7, timeout=20)
        seen["data"] = dst.clone()  # what the target sees the moment the doorbell rings

    async with anyio.create_task_group() as tg:
        tg.start_soon(target)
        await a.signal(env.peer, "version", 7)
    _ensure(seen["v"] == 7, f"wait_signal returned {seen['v']!r}, not 7")
    expected = torch.arange(1, count + 1, dtype=torch.float32, device=env.device).repeat_interleave(n)
    _ensure(torch.equal(seen["data"], expected), "signal became visible before the puts before it")
    _ensure(b.signal_value("version") == 7, "signal_value does not show the signal")


@_check("bad_input")
async def _bad_input(env: _Env) -> None:
    """Every bad input raises its typed error and leaves the target memory as it was."""
    a, b, p, dev = env.a, env.b, env.peer, env.device
    dst = torch.arange(1024, dtype=torch.float32, device=dev)
    ro = torch.arange(16, dtype=torch.float32, device=dev)
    b.register("e", dst)
    b.register("ro", ro, writable=False)
    await a.peer(p, regions=["e", "ro"])
    before, ro_before = dst.clone(), ro.clone()
    src = env.full(16, 1.0)
    cases: list[tuple[type[Exception], Callable[[], Awaitable[None]]]] = [
        (BoundsError, lambda: a.put(src, p, key="e", offset=1024 * 4 - 8)),
        (BoundsError, lambda: a.put(env.full(2048, 1.0), p, key="e")),
        (BoundsError, lambda: a.put(src, p, key="e", offset=-4)),
        (BoundsError, lambda: a.put(src, p, key="e", offset=2)),  # misaligned
        (DTypeMismatchError, lambda: a.put(src.double(), p, key="e")),
        (DTypeMismatchError, lambda: a.put(src.to(torch.bfloat16), p, key="e")),
        (RegistrationError, lambda: a.put(src, p, key="no-such-key")),
        (RegistrationError, lambda: a.put(src, p)),  # src not registered, no key
        (ReadOnlyRegionError, lambda: a.put(src, p, key="ro")),
        (PeerNotFoundError, lambda: a.put(src, "nobody", key="e")),
        (BoundsError, lambda: a.get(torch.empty(2048, device=dev), p, key="e")),
        (DTypeMismatchError, lambda: a.get(torch.empty(4, dtype=torch.int32, device=dev), p, key="e")),
        (LayoutError, lambda: a.get(torch.empty(8, 8, device=dev)[:, ::2], p, key="e")),
        (RegistrationError, lambda: a.get(torch.empty(4, device=dev), p, key="nope")),
    ]
    for i, (exc_type, op) in enumerate(cases):
        try:
            await op()
        except exc_type as exc:
            _ensure(bool(str(exc)), f"case {i}: {exc_type.__name__} with an empty message")
        else:
            raise AssertionError(f"case {i}: expected {exc_type.__name__}")
        _ensure(torch.equal(dst, before), f"case {i} changed the target region")
        _ensure(torch.equal(ro, ro_before), f"case {i} changed the read-only region")
    out = torch.empty(16, device=dev)  # reading a read-only region is fine
    await a.get(out, p, key="ro")
    _ensure(torch.equal(out, ro), "a get from a read-only region read the wrong bytes")


@_check("unknown_peer_timeout")
async def _unknown_peer_timeout(env: _Env) -> None:
    with anyio.fail_after(10):
        t0 = anyio.current_time()
        with _raises(PeerNotFoundError, match="nobody"):
            await env.a.peer("nobody", timeout=0.3)
        _ensure(anyio.current_time() - t0 >= 0.3, "peer() gave up before its timeout")


@_check("wait_signal_timeout")
async def _wait_signal_timeout(env: _Env) -> None:
    with _raises(TransferTimeoutError, match="never"):
        await env.b.wait_signal("never", timeout=0.2)


@_check("closed")
async def _closed(env: _Env) -> None:
    a, b = env.a, env.b
    x = env.zeros(4)
    b.register("x", x)
    await a.peer(env.peer)

    async def after_close() -> None:  # the factory has closed the pair now
        with _raises(ClosedError):
            a.put(env.zeros(4), env.peer, key="x")
        with _raises(ClosedError):
            await a.peer(env.peer)
        with _raises(ClosedError):
            a.register("y", env.zeros(1))
        _ensure(not x.any(), "closing a wrote to its peer")
        with _raises(ClosedError):
            b.register("z", env.zeros(1))

    env.after_close.append(after_close)


@_check("cancel_before_start")
async def _cancel_before_start(env: _Env) -> None:
    a, b = env.a, env.b
    n = 2 * SYNC_MAX_BYTES // 4  # float32s past the synchronous limit: put() returns before a byte moves
    dst = env.zeros(n)
    b.register("c", dst)
    await a.peer(env.peer, regions=["c"])
    h = a.put(env.full(n, 1.0), env.peer, key="c")
    h.cancel()  # before the transfer task has had a chance to run
    with _raises(TransferAbortedError) as caught:
        await h
    _ensure(getattr(caught[0], "partial", None) is False, "a transfer cancelled before it started reports partial")
    _ensure(not dst.any(), "a transfer cancelled before it started moved bytes")


@_check("cancel_in_flight")
async def _cancel_in_flight(env: _Env) -> None:
    a, b = env.a, env.b
    n = 256 << 20
    dst = env.zeros(n, dtype=torch.uint8)
    b.register("c", dst)
    await a.peer(env.peer, regions=["c"])
    src = env.full(n, 7, torch.uint8)
    outcomes = set()
    for delay in (0.0005, 0.002, 0.01):
        h = a.put(src, env.peer, key="c")
        await anyio.sleep(delay)
        h.cancel()
        try:
            await h
            outcomes.add("completed")
            _ensure(torch.equal(dst, src), "a cancelled transfer that completed left the wrong bytes")
        except TransferAbortedError:
            outcomes.add("aborted")
        _ensure(h.done(), "a cancelled transfer is not done")
    # Afterwards the pair still works and a complete write defines the contents again.
    await a.put(src, env.peer, key="c")
    _ensure(torch.equal(dst, src), "a complete write after cancellations left the wrong bytes")
    _ensure(bool(outcomes), "no outcome")


@_check("cancel_awaiting_task")
async def _cancel_awaiting_task(env: _Env) -> None:
    a, b = env.a, env.b
    dst = env.zeros(1 << 20)
    b.register("c", dst)
    await a.peer(env.peer, regions=["c"])
    h = a.put(env.full(1 << 20, 1.0), env.peer, key="c")
    with anyio.move_on_after(0):
        await h
    with anyio.fail_after(10), contextlib.suppress(TransferAbortedError):
        await h.wait()  # the cancelled wait has cancelled the transfer: it ends
    err = h.exception()
    _ensure(err is None or isinstance(err, TransferAbortedError), f"ended with {err!r}")


@_check("handle_fields")
async def _handle_fields(env: _Env) -> None:
    a, b = env.a, env.b
    b.register("f", env.zeros(100))
    await a.peer(env.peer, regions=["f"])
    h = a.put(env.full(10, 1.0), env.peer, key="f", offset=40)
    _ensure((h.peer, h.key, h.nbytes, h.offset) == (env.peer, "f", 40, 40), f"wrong fields: {h!r}")
    await h
    _ensure(h.backend == env.backend and h.done() and h.elapsed >= 0, f"wrong fields after completion: {h!r}")
    _ensure("done" in repr(h), f"repr does not say done: {h!r}")


@_check("fence")
async def _fence(env: _Env) -> None:
    a, b = env.a, env.b
    dst = env.zeros(8, 1 << 18)
    b.register("fe", dst)
    await a.peer(env.peer, regions=["fe"])
    hs = [a.put(env.full(1 << 18, float(i)), env.peer, key="fe", offset=i * (1 << 20)) for i in range(8)]
    await a.fence(env.peer)
    _ensure(all(h.done() for h in hs), "fence returned before the puts started before it ended")
    expected = torch.arange(8.0, device=env.device).unsqueeze(1).expand(8, 1 << 18)
    _ensure(torch.equal(dst, expected), "the fenced puts left the wrong bytes")


@_check("fence_failure")
async def _fence_failure(env: _Env) -> None:
    a, b = env.a, env.b
    b.register("ff", env.zeros(4))
    await a.peer(env.peer, regions=["ff"])
    a.put(env.zeros(8), env.peer, key="ff")  # out of bounds, not awaited
    with _raises(BoundsError):
        await a.fence(env.peer)


@_check("unregister")
async def _unregister(env: _Env) -> None:
    a, b = env.a, env.b
    b.register("u", env.zeros(4))
    await a.peer(env.peer, regions=["u"])
    await a.put(env.full(4, 1.0), env.peer, key="u")
    b.unregister("u")
    with _raises(RegistrationError):
        await a.put(env.full(4, 1.0), env.peer, key="u")
    with _raises(RegistrationError):
        b.unregister("u")


@_check("register_many")
async def _register_many(env: _Env) -> None:
    a, b = env.a, env.b
    sd = {"l1.w": env.zeros(3, 4), "l1.b": env.zeros(4), "l2.w": env.zeros(4, 2, dtype=torch.bfloat16)}
    regions = b.register_many(sd, prefix="policy.")
    _ensure(set(regions) == {"policy.l1.w", "policy.l1.b", "policy.l2.w"}, f"register_many returned {set(regions)}")
    peer = await a.peer(env.peer, regions=list(regions))
    _ensure(peer.regions["policy.l2.w"].dtype == "bfloat16", "the peer record has the wrong dtype")
    _ensure(peer.regions["policy.l1.w"].shape == (3, 4), "the peer record has the wrong shape")
    # Re-register with a larger tensor: the initiator's cached record is refreshed on demand.
    b.unregister("policy.l1.b")
    bigger = env.zeros(16)
    b.register("policy.l1.b", bigger)
    await a.put(env.full(16, 1.0), env.peer, key="policy.l1.b")
    _ensure(bool(bigger.sum() == 16), "a put into a re-registered, larger region did not arrive")


@_check("registration_errors")
async def _registration_errors(env: _Env) -> None:
    b = env.b
    with _raises(RegistrationError, match="contiguous"):
        b.register("nc", env.zeros(4, 4).t())
    b.register("dup", env.zeros(1))
    with _raises(RegistrationError, match="already"):
        b.register("dup", env.zeros(1))
    with _raises(RegistrationError):
        b.register("", env.zeros(1))
    with _raises(RegistrationError, match="already"):
        b.register_many({"fresh": env.zeros(1), "dup": env.zeros(1)})
    _ensure("fresh" not in b.regions, "a failed register_many must register nothing")
    with _raises(TypeError):
        b.register("t", [1, 2, 3])  # type: ignore[arg-type]


@_check("empty")
async def _empty(env: _Env) -> None:
    """Host memory only: skipped for a backend that does not serve host memory."""
    a, b = env.a, env.b
    t = b.empty("shm", (16, 16), torch.bfloat16)
    _ensure(t.shape == (16, 16) and t.dtype == torch.bfloat16 and not t.float().any(), "empty() is not zeroed")
    await a.peer(env.peer, regions=["shm"])
    src = torch.randn(16, 16).to(torch.bfloat16)
    await a.put(src, env.peer, key="shm")
    _ensure(_same_bytes(t, src), "a put into empty() memory did not arrive")


CHECKS: tuple[str, ...] = tuple(_REGISTRY)
"""The names of the checks :func:`check_backend` runs, in order (for its ``skip=``)."""


async def check_backend(
    make_pair: PairFactory,
    *,
    backend: str | None = None,
    device: str | torch.device | None = None,
    skip: Collection[str] = (),
    timeout: float = 120.0,
) -> None:
    """Runs the conformance checks against the backend that ``make_pair``'s Transports speak.

    Every check (see :data:`CHECKS`) opens its own pair, so one failure cannot spoil the next.
    All checks run; then the failures, if any, are reported together.

    Args:
        make_pair: called once per check; ``async with make_pair() as (a, b)`` must give two
            open Transports in this process that share a store and speak the backend under test
            (``a`` initiates, ``b`` is the target; ``b is a`` is allowed: a loopback pair).
            :func:`pair_factory` makes one.
        backend: the name every transfer must report as its ``Transfer.backend``; default: the
            one backend ``a`` speaks.
        device: where regions and local tensors live; default ``"cpu"`` when the backend serves
            host memory, else ``"cuda"``. The ``empty`` check (host memory by definition) is
            skipped for a backend that does not serve host memory.
        skip: names of checks not to run.
        timeout: seconds for one check, opening and closing its pair included.

    Raises:
        AssertionError: a check failed; the message names every failing check and its error
            (the first one is chained as ``__cause__``).
        ValueError: ``skip`` names an unknown check, or the pair speaks several backends and
            ``backend`` was not given.

    Cancellation: the check running is cancelled and its pair closed; nothing is reported.
    """
    unknown = sorted(set(skip) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown checks {unknown}; known: {', '.join(CHECKS)}")
    failures: list[tuple[str, Exception]] = []
    for name in CHECKS:
        if name in skip:
            continue
        try:
            with anyio.fail_after(timeout):
                ran = await _run_check(name, make_pair, backend, device)
        except _SetupError:
            raise
        except TimeoutError as exc:
            failures.append((name, AssertionError(f"did not finish within {timeout:g}s")))
            failures[-1][1].__cause__ = exc
        except Exception as exc:  # noqa: BLE001 - a check failed: an assertion or an unexpected error
            failures.append((name, exc))
        else:
            log.info("check_backend: %s %s", name, "passed" if ran else "skipped (not applicable)")
    if failures:
        lines = "\n".join(f"  {name}: {type(exc).__name__}: {exc}" for name, exc in failures)
        raise AssertionError(f"check_backend: {len(failures)} check(s) failed:\n{lines}") from failures[0][1]


async def _run_check(name: str, make_pair: PairFactory, backend: str | None, device: str | torch.device | None) -> bool:
    """Runs one check on a fresh pair; returns False when it does not apply to this backend."""
    async with make_pair() as (a, b):
        if backend is None:
            if len(a.backends) != 1:
                raise _SetupError(f"the pair speaks {a.backends}; pass backend= to name the one under test")
            backend = a.backends[0]
        _ensure(backend in a.backends and backend in b.backends,
                f"the pair does not speak {backend!r} (a: {a.backends}, b: {b.backends})")
        serves_host = MemoryKind.CPU in backend_class(backend).memory_kinds
        if name == "empty" and not serves_host:
            return False
        where = torch.device(device if device is not None else ("cpu" if serves_host else "cuda"))
        env = _Env(a, b, backend, where)
        await _REGISTRY[name](env)
    for after in env.after_close:
        await after()
    return True
