"""The public backend registry and the testing kit: a backend registered from inside a test
passes ``transport.testing.check_backend``; the kit names the checks a broken backend fails;
registration is validated; entry-point plugins load from a real distribution on ``sys.path``,
and a broken one is a warning that names it, never an import failure."""

from __future__ import annotations

import logging
import secrets
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import transport
from tests._support import PYTHON, python_env
from transport._channel import ChannelPool, hello
from transport._tensors import MemoryKind, dtype_name
from transport._wire import FrameKind, TransferOp
from transport.backends import (
    ENTRY_POINT_GROUP,
    REGISTRY,
    Backend,
    availability,
    backend_class,
    default_backends,
    register_backend,
    registered_backends,
    unregister_backend,
)
from transport.backends.tcp import TcpBackend
from transport.testing import (
    CHECKS,
    Fault,
    FaultKind,
    check_backend,
    faulty,
    pair_factory,
    temporary_backend,
)

TCP = REGISTRY["tcp"]
FAST = ("roundtrip", "offsets", "handle_fields", "fence")  # enough to show a backend is wired in


def only(*names: str) -> set[str]:
    return set(CHECKS) - set(names)


class KitTcp(TcpBackend):
    """A test backend: the tcp backend's code under a name of its own."""

    name = "kit_tcp"


@pytest.fixture
def kit_tcp() -> Iterator[type[Backend]]:
    register_backend("kit_tcp", KitTcp)
    try:
        yield KitTcp
    finally:
        unregister_backend("kit_tcp")


async def test_a_backend_registered_in_a_test_passes_check_backend(kit_tcp, memory_store):
    assert backend_class("kit_tcp") is KitTcp and registered_backends()["kit_tcp"] is KitTcp
    await check_backend(pair_factory("kit_tcp", memory_store))


class KitFrames(Backend):
    """A third-party backend with a target side of its own: the initiator sends its own
    ``FrameKind.BACKEND_DATA`` requests to the peer's agent, which hands them to this class's
    ``serve_frame`` there (the hook ``tcp`` is built on); nothing in the core knows of it."""

    name = "kit_frames"
    one_sided = False
    memory_kinds = frozenset({MemoryKind.CPU})

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self._pool = ChannelPool(ctx.tg, hello(ctx.name, ctx.incarnation, "kit_frames"), ctx.auth)

    def unreachable_reason(self, peer: Any, region: Any, local: Any) -> str | None:
        return None if region.device == "cpu" else "host memory only"

    async def _request(self, op: str, local: Any, remote: Any, **io: Any) -> None:
        chan = await self._pool.get(remote.peer.name, remote.peer.incarnation, remote.peer.agent)
        meta = {"backend": self.name, "op": op, "key": remote.region.key, "dtype": dtype_name(local.tensor.dtype),
                "offset": remote.offset, "nbytes": remote.nbytes}
        await chan.request(FrameKind.BACKEND_DATA, meta, **io)

    async def put(self, local: Any, remote: Any) -> None:
        await self._request("put", local, remote, payload=local.view)

    async def get(self, local: Any, remote: Any) -> None:
        await self._request("get", local, remote, into=local.view)

    async def serve_frame(self, conn: Any, kind: FrameKind, rid: int, meta: Any, payload_len: int) -> None:
        op = TransferOp.PUT if meta.get("op") == "put" else TransferOp.GET
        try:
            nbytes = meta.get("nbytes")
            if op == TransferOp.PUT and nbytes != payload_len:
                raise transport.WireError("payload does not match nbytes")
            region = self.ctx.regions.check(op, meta.get("key"), meta.get("dtype"), meta.get("offset"), nbytes)
        except transport.TransportError as exc:
            await conn.discard(payload_len)
            await conn.refuse(rid, exc)
            return
        view = region.view[meta["offset"] : meta["offset"] + nbytes]
        if op == TransferOp.PUT:
            await conn.recv_into([view])
            await conn.reply(FrameKind.OK, rid, {})
        else:
            await conn.discard(payload_len)
            await conn.reply(FrameKind.DATA, rid, {}, view)

    def forget_peer(self, peer: str) -> None:
        self._pool.forget_peer(peer)

    def close(self) -> None:
        self._pool.close()


async def test_a_third_party_backend_serves_its_own_frames_through_the_target_hook(memory_store):
    register_backend("kit_frames", KitFrames)
    try:
        await check_backend(pair_factory("kit_frames", memory_store))
    finally:
        unregister_backend("kit_frames")


async def test_registered_backends_run_only_where_named(kit_tcp, memory_store):
    assert "kit_tcp" not in default_backends() and default_backends() == tuple(REGISTRY)
    assert availability()["kit_tcp"] is None
    async with transport.Transport("plain", store=memory_store) as t:
        assert "kit_tcp" not in t.backends
    async with transport.Transport("named", store=memory_store, backends=("kit_tcp", "tcp")) as t:
        assert t.backends == ("kit_tcp", "tcp")


async def test_the_fault_wrapper_without_faults_passes(memory_store):
    with temporary_backend(faulty(TCP, name="plain_faulty_tcp")) as cls:
        await check_backend(pair_factory(cls.name, memory_store), skip=only(*FAST))
        assert cls.injected == []
    with pytest.raises(ValueError, match="unknown backend 'plain_faulty_tcp'"):
        backend_class("plain_faulty_tcp")


async def test_check_backend_names_the_checks_a_broken_backend_fails(memory_store):
    broken = faulty(TCP, Fault(FaultKind.FAIL, op=transport.TransferOp.GET), name="broken_tcp")  # every first get
    with temporary_backend(broken), pytest.raises(AssertionError) as info:
        await check_backend(pair_factory("broken_tcp", memory_store), skip=only(*FAST))
    message = str(info.value)
    assert "2 check(s) failed" in message, message
    assert "roundtrip: TransportInternalError: injected fault: get of" in message
    assert "offsets: TransportInternalError" in message
    assert "handle_fields" not in message and "fence" not in message  # puts only: they pass
    assert isinstance(info.value.__cause__, transport.TransportInternalError)


async def test_check_backend_argument_errors(memory_store):
    with pytest.raises(ValueError, match="unknown checks"):
        await check_backend(pair_factory("tcp", memory_store), skip=["no_such_check"])
    with pytest.raises(ValueError, match="pass backend="):
        await check_backend(pair_factory_two(memory_store), skip=only("handle_fields"))
    await check_backend(pair_factory_two(memory_store), backend="tcp", skip=only("handle_fields"))


def pair_factory_two(store: str):
    """A pair whose ends both speak tcp and ipc (in that preference order)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def make_pair():
        async with transport.Transport("a", store=store, backends=("tcp", "ipc"), timeout=20) as a, \
                transport.Transport("b", store=store, backends=("tcp", "ipc"), timeout=20) as b:
            yield a, b

    return make_pair


# -- registry validation ------------------------------------------------------------------------


class NoFlags(TcpBackend):
    name = "no_flags"
    one_sided = "yes"  # type: ignore[assignment]


class NoKinds(TcpBackend):
    name = "no_kinds"
    memory_kinds = frozenset()


class Abstract(Backend):
    name = "abstract"
    one_sided = False
    memory_kinds = TcpBackend.memory_kinds


@pytest.mark.parametrize("name", ["", "has space", "x" * 65, "1st", "a/b", 7])
def test_register_backend_refuses_bad_names(name):
    with pytest.raises(ValueError, match="backend name must be"):
        register_backend(name, KitTcp)


def test_register_backend_validates_the_class():
    with pytest.raises(TypeError, match="not a subclass"):
        register_backend("kit_tcp", object)
    with pytest.raises(TypeError, match="does not implement get, put, unavailable_reason"):
        register_backend("abstract", Abstract)
    with pytest.raises(ValueError, match=r"KitTcp.name is 'kit_tcp'; it must be 'other'"):
        register_backend("other", KitTcp)
    with pytest.raises(TypeError, match="one_sided must be a bool"):
        register_backend("no_flags", NoFlags)
    with pytest.raises(TypeError, match="memory_kinds must be a non-empty frozenset"):
        register_backend("no_kinds", NoKinds)

    class TakesSignals(KitTcp):  # a backend may serve kinds of its own, never the agent's
        name = "takes_signals"
        frames = frozenset({*TcpBackend.frames, FrameKind.SIGNAL})

    with pytest.raises(TypeError, match="frames must be a frozenset of frame kinds from"):
        register_backend("takes_signals", TakesSignals)
    assert not {"kit_tcp", "abstract", "other", "no_flags", "no_kinds", "takes_signals"} & set(registered_backends())


def test_no_silent_overwrite_and_replace(kit_tcp):
    class Other(TcpBackend):
        name = "kit_tcp"

    register_backend("kit_tcp", KitTcp)  # the same class again: a no-op
    with pytest.raises(ValueError, match=r"already registered .*KitTcp.*replace=True"):
        register_backend("kit_tcp", Other)
    with pytest.raises(ValueError, match="already registered"):
        register_backend("tcp", faulty(TCP))
    register_backend("kit_tcp", Other, replace=True)
    assert backend_class("kit_tcp") is Other
    register_backend("kit_tcp", KitTcp, replace=True)


def test_replacing_a_builtin_keeps_its_place_and_unregister_restores_it():
    order = default_backends()
    swapped = faulty(TCP)
    register_backend("tcp", swapped, replace=True)
    try:
        assert REGISTRY["tcp"] is swapped and default_backends() == order
    finally:
        unregister_backend("tcp")
    assert REGISTRY["tcp"] is TCP
    with pytest.raises(ValueError, match="built-in backend; it cannot be unregistered"):
        unregister_backend("tcp")
    with pytest.raises(ValueError, match="no backend named 'nope' is registered; known: ipc, ucx, nccl, tcp"):
        unregister_backend("nope")


def test_temporary_backend_restores_what_was_there():
    swapped = faulty(TCP)
    with temporary_backend(swapped, replace=True):
        assert backend_class("tcp") is swapped
    assert backend_class("tcp") is TCP
    with temporary_backend(KitTcp):
        assert backend_class("kit_tcp") is KitTcp
    assert "kit_tcp" not in registered_backends()


def test_unknown_backend_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown backend 'nope'; known: ipc, ucx, nccl, tcp"):
        backend_class("nope")


def test_fault_and_faulty_validate_their_arguments():
    with pytest.raises(ValueError, match="at_call"):
        Fault(FaultKind.FAIL, at_call=0)
    with pytest.raises(ValueError, match="at_byte"):
        Fault(FaultKind.STALL, at_byte=-1)
    with pytest.raises(TypeError, match="TransportError subclass"):
        Fault(FaultKind.FAIL, error=RuntimeError)
    with pytest.raises(TypeError, match="FaultKind"):
        Fault("fail")
    with pytest.raises(TypeError, match="concrete Backend subclass"):
        faulty(Abstract)
    with pytest.raises(TypeError, match="Fault objects"):
        faulty(TCP, "stall")
    cls = faulty(TCP, Fault(FaultKind.DROP), name="dropper")
    assert issubclass(cls, TCP) and cls.name == "dropper" and cls.faults == (Fault(FaultKind.DROP),)


# -- entry points -------------------------------------------------------------------------------


def make_distribution(root: Path, tag: str) -> dict[str, str]:
    """A real installed distribution (a module and its .dist-info) under ``root``, declaring one
    good backend plugin and four broken ones; returns their entry-point names."""
    module = f"tx_plugin_{tag}"
    names = {k: f"{k}_{tag}" for k in ("good", "missing", "notabackend", "misnamed", "raises")}
    (root / f"{module}.py").write_text(textwrap.dedent(f"""
        from transport.backends.tcp import TcpBackend

        class PluginBackend(TcpBackend):
            name = "{names['good']}"

        class Misnamed(TcpBackend):
            name = "something_else_{tag}"

        NOT_A_BACKEND = 42
    """))
    (root / f"tx_boom_{tag}.py").write_text("raise RuntimeError('plugin import exploded')\n")
    info = root / f"tx_plugin_{tag}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tx-plugin-{tag}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(f"""
        [{ENTRY_POINT_GROUP}]
        {names['good']} = {module}:PluginBackend
        {names['missing']} = tx_no_such_module_{tag}:Backend
        {names['notabackend']} = {module}:NOT_A_BACKEND
        {names['misnamed']} = {module}:Misnamed
        {names['raises']} = tx_boom_{tag}:Anything
    """))
    return names


@pytest.fixture
def plugin_dist(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    root = tmp_path / "site"
    root.mkdir()
    names = make_distribution(root, secrets.token_hex(4))
    sys.path.insert(0, str(root))
    try:
        yield root, names
    finally:
        sys.path.remove(str(root))
        for m in [m for m in sys.modules if m.startswith(("tx_plugin_", "tx_boom_"))]:
            del sys.modules[m]
        if names["good"] in registered_backends():
            unregister_backend(names["good"])


async def test_an_entry_point_plugin_loads_lazily_and_passes_check_backend(plugin_dist, caplog, memory_store):
    _root, names = plugin_dist
    caplog.set_level(logging.INFO, logger="transport.backends")
    cls = backend_class(names["good"])  # not registered yet: found through its entry point
    assert cls.__name__ == "PluginBackend" and cls.name == names["good"]
    assert availability()[names["good"]] is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for broken, why in [("missing", "ModuleNotFoundError"), ("notabackend", "not a transport.backends.Backend"),
                        ("misnamed", "name is 'something_else_"), ("raises", "plugin import exploded")]:
        assert any(names[broken] in w and why in w for w in warnings), (broken, warnings)
    assert len(warnings) == 4
    for broken in ("missing", "notabackend", "misnamed", "raises"):
        with pytest.raises(ValueError, match="unknown backend"):
            backend_class(names[broken])
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 4  # each is tried once
    assert names["good"] not in default_backends()
    await check_backend(pair_factory(names["good"], memory_store), skip=only(*FAST))
    unregister_backend(names["good"])
    assert names["good"] not in registered_backends()  # tried once: not loaded again behind our back


def test_a_broken_plugin_never_breaks_import_transport(tmp_path):
    root = tmp_path / "site"
    root.mkdir()
    names = make_distribution(root, "sub")
    env = python_env()
    env["PYTHONPATH"] = f"{root}:{env['PYTHONPATH']}"
    code = "import transport\nfrom transport.backends import availability\nprint(sorted(availability()))"
    out = subprocess.run([PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert names["good"] in out.stdout and names["missing"] not in out.stdout
    assert f"skipping backend plugin entry point {names['missing']}" in out.stderr
    assert "plugin import exploded" in out.stderr
