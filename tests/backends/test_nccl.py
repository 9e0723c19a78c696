"""The ``nccl`` backend.

On a machine without a GPU (CPU torch, no libcuda) everything that does not need a device runs
for real: the backend reports itself unavailable with its reason, the library loads from the
``nvidia-nccl-cu*`` wheel and reports its version, the config struct matches the wheel's
``nccl.h``, unique ids travel between two processes through a file store, NCCL's own init
failure surfaces as a clear error, and the agent protocol (``open``/``post``/``close``/``self``
requests sent by a real NcclBackend over a real agent connection, served by a real NcclBackend
against a real Transport's regions) refuses bad requests with the right typed errors.

GPU tests (marked ``gpu``) skip without CUDA: a 1-rank send-to-self through a Transport, and
two-process tests that need two GPUs (or one GPU with NCCL >= 2.30 and
``NCCL_MULTI_RANK_GPU_ENABLE=1``, which NCCL requires for two ranks on one device).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import secrets
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import torch

import transport
from tests._support import PYTHON, ROOT, nccl_headers, python_env
from transport._agent import AgentServer
from transport._auth import Authenticator
from transport._errors import (
    BackendUnavailableError,
    BoundsError,
    DTypeMismatchError,
    PeerLostError,
    ReadOnlyRegionError,
    RegistrationError,
    TransferAbortedError,
    TransferTimeoutError,
    TransportInternalError,
    WireError,
)
from transport._host import host_id
from transport._native import nccl as _nccl
from transport._rendezvous import FileStore, MemoryStore
from transport._routes import Routes
from transport._tensors import MemoryKind
from transport._wire import PeerRecord, RegionRecord, TransferOp
from transport.backends import BackendContext, availability
from transport.backends.nccl import NcclBackend, _comm
from transport.backends.nccl._backend import _Ticket
from transport.backends.nccl._comm import Comm
from transport.backends.nccl._endpoint import decode_endpoint, encode_endpoint
from transport.backends.nccl._ids import comm_id, normalize_uuid, publish_unique_id, read_unique_id

LIB, LIB_WHY = _nccl.library()
needs_lib = pytest.mark.skipif(LIB is None, reason=f"libnccl cannot be loaded: {LIB_WHY}")
GPU = torch.cuda.is_available() and NcclBackend.unavailable_reason() is None
needs_gpu = pytest.mark.skipif(
    not GPU,
    reason=f"needs a CUDA GPU with NCCL: {NcclBackend.unavailable_reason() or 'torch.cuda.is_available() is False'}",
)
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour; this machine has a GPU")


def wheel_root() -> Path | None:
    paths = _nccl.wheel_paths()
    return Path(paths[0]).parent.parent if paths else None


# -- availability and the library -----------------------------------------------------------


@no_gpu
def test_unavailable_with_its_reason() -> None:
    reason = availability()["nccl"]
    assert reason is not None
    assert reason == NcclBackend.unavailable_reason()
    if LIB is None:
        assert "libnccl.so.2 could not be loaded" in reason and "pip install 'transport[nccl]'" in reason
    else:
        assert f"NCCL {LIB.version_string} loads ({LIB.path})" in reason
        assert "nccl moves GPU memory" in reason
    if torch.version.cuda is None:
        assert f"torch {torch.__version__} is built without CUDA" in reason
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        assert "no CUDA driver (libcuda.so.1" in reason


@no_gpu
async def test_transport_refuses_nccl_with_the_reason() -> None:
    with pytest.raises(BackendUnavailableError) as info:
        async with transport.Transport("a", store=f"memory://{secrets.token_hex(4)}", backends=["nccl"]):
            pass
    assert "backend 'nccl' is unavailable" in str(info.value)
    assert NcclBackend.unavailable_reason() in str(info.value)


@no_gpu
async def test_default_backends_leave_nccl_out() -> None:
    async with transport.Transport("a", store=f"memory://{secrets.token_hex(4)}") as t:
        assert "nccl" not in t.backends and "tcp" in t.backends


@needs_lib
def test_library_loads_from_the_wheel_and_reports_its_version() -> None:
    assert LIB is not None
    root = wheel_root()
    if root is None or LIB.how != "wheel":
        pytest.skip(f"NCCL came from {LIB.path} ({LIB.how}), not from an nvidia-nccl wheel")
    assert LIB.path == os.path.realpath(root / "lib" / "libnccl.so.2")
    header = (root / "include" / "nccl.h").read_text()
    major, minor, patch = (
        int(re.search(rf"#define NCCL_{k}\s+(\d+)", header).group(1))  # type: ignore[union-attr]
        for k in ("MAJOR", "MINOR", "PATCH")
    )
    assert LIB.version == (major, minor, patch)
    code = int(re.search(r"#define NCCL_VERSION_CODE\s+(\d+)", header).group(1))  # type: ignore[union-attr]
    assert _nccl.version_code(LIB.version) == code and _nccl.version_tuple(code) == LIB.version
    assert LIB.has_windows == (LIB.version >= _nccl.WINDOW_VERSION)

    doctor = subprocess.run([PYTHON, "-m", "transport", "doctor"], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env=python_env(), check=False)
    assert f"NCCL library: {LIB.version_string} from {LIB.path} (wheel)" in doctor.stdout, doctor.stdout + doctor.stderr


def test_version_codes() -> None:
    assert _nccl.version_code((2, 8, 4)) == 2804 and _nccl.version_tuple(2804) == (2, 8, 4)
    assert _nccl.version_code((2, 32, 3)) == 23203 and _nccl.version_tuple(23203) == (2, 32, 3)
    assert _nccl.version_tuple(_nccl.version_code(_nccl.WINDOW_VERSION)) == _nccl.WINDOW_VERSION


def _c_fields(header: str, struct: str) -> list[tuple[str, str]]:
    """(type, name) of each member of ``typedef struct ... { ... } <struct>;`` in nccl.h."""
    end = re.search(r"\}\s*" + struct + r"\s*;", header)
    assert end, struct
    body = header[header.rfind("{", 0, end.start()) + 1 : end.start()]  # these structs nest no braces
    text = re.sub(r"/\*.*?\*/|//[^\n]*", "", body, flags=re.DOTALL)
    members = re.finditer(r"([A-Za-z_][\w\s\*]*?[\s\*])(\w+)\s*;", text)
    return [(" ".join(m.group(1).split()), m.group(2)) for m in members]


_C_TYPES = {
    "size_t": ctypes.c_size_t, "unsigned int": ctypes.c_uint, "int": ctypes.c_int, "const char *": ctypes.c_char_p,
}


def _macro(header: str, name: str) -> str | None:
    """The replacement text of ``#define <name> ...`` in nccl.h (continuation lines joined)."""
    m = re.search(r"^[ \t]*#[ \t]*define[ \t]+" + name + r"\b[ \t]*((?:[^\n]*\\\n)*[^\n]*)", header, re.M)
    return None if m is None else m.group(1).replace("\\\n", " ").strip()


def _initializer(header: str) -> list[tuple[str, str]]:
    """(value, field) of each entry of ``NCCL_CONFIG_INITIALIZER`` (its comments name the fields)."""
    body = _macro(header, "NCCL_CONFIG_INITIALIZER")
    assert body is not None and body.startswith("{"), "nccl.h has no NCCL_CONFIG_INITIALIZER"
    return [(v.strip(), c.strip()) for v, c in re.findall(r"([^,{}]+?)\s*,?\s*/\*\s*([^*]+?)\s*\*/", body)]


def _int_value(header: str, expr: str) -> int:
    """An integer literal, or a macro of nccl.h that expands to one."""
    for _ in range(4):
        if re.fullmatch(r"0[xX][0-9a-fA-F]+[uUlL]*|\d+[uUlL]*", expr):
            return int(expr.rstrip("uUlL"), 0)
        text = _macro(header, expr)
        assert text is not None, f"{expr} is neither an integer literal nor a macro of nccl.h"
        expr = text.strip("() ")
    raise AssertionError(f"{expr}: macros nested too deep")


def _headers() -> list[tuple[str, Path]]:
    """Every nccl.h to check: the installed wheel's, and one of each NCCL series we load."""
    found = [(f"{package}-{version}", nccl_headers.path_of(package, version))
             for package, version in nccl_headers.VERSIONS]
    root = wheel_root()
    if root is not None:
        found.append(("installed wheel", root / "include" / "nccl.h"))
    return found


@pytest.mark.parametrize(("name", "path"), _headers(), ids=[n for n, _ in _headers()])
def test_config_layout_is_a_prefix_of_every_ncclconfig(name: str, path: Path) -> None:
    """NCCL reads ``size`` bytes of the config and defaults every field newer than ``version``:
    our struct must be exactly the leading members of the real one, for every NCCL we load
    (2.27 to 2.32). The magic and the defaults are read the way the header spells them: 2.27
    and 2.28 write the magic as a literal in NCCL_CONFIG_INITIALIZER, 2.29 on name it
    NCCL_API_MAGIC."""
    assert path.exists(), f"{path} is missing: run `python -m tests._support.nccl_headers` (scripts/test.sh does)"
    header = path.read_text()
    version = tuple(_int_value(header, f"NCCL_{part}") for part in ("MAJOR", "MINOR", "PATCH"))
    assert len(version) == 3
    real = _c_fields(header, "ncclConfig_t")
    init = _initializer(header)
    assert [field for _, field in init] == [n for _, n in real], "the initializer's fields are the struct's"
    for layout in (_nccl.config_layout((2, 14, 0)), _nccl.config_layout(version)):
        ours = layout._fields_
        assert [n for _, n in real[: len(ours)]] == [f[0] for f in ours], (name, layout.__name__)
        for (ctype, field), mine in zip(real, ours, strict=False):  # the header may have more fields than ours
            assert _C_TYPES[ctype] is mine[1], (name, field, ctype)
    values = {field: value for value, field in init}
    assert _int_value(header, values["magic"]) == _nccl.NCCL_API_MAGIC
    assert values["blocking"] == "NCCL_CONFIG_UNDEF_INT" and _macro(header, "NCCL_CONFIG_UNDEF_INT") == "INT_MIN"
    assert _int_value(header, "NCCL_UNIQUE_ID_BYTES") == _nccl.UNIQUE_ID_BYTES
    cfg = _nccl.make_config(version, b"name")
    assert cfg.magic == _nccl.NCCL_API_MAGIC and cfg.blocking == 0 and cfg.size == ctypes.sizeof(cfg)
    assert cfg.version == _nccl.version_code(type(cfg).VERSION)


def test_uuid_forms_compare_equal() -> None:
    forms = [
        "cuda:GPU-5a1b2c3d-0000-1111-2222-333344445555",
        "GPU-5A1B2C3D-0000-1111-2222-333344445555",
        "5a1b2c3d-0000-1111-2222-333344445555",
    ]
    assert len({normalize_uuid(f) for f in forms}) == 1


# -- unique ids through the store, and NCCL's own failure without a GPU ------------------------

_PUBLISH_CHILD = r"""
import sys, anyio
from transport._auth import Authenticator
from transport._native.nccl import library
from transport._rendezvous import FileStore
from transport.backends.nccl._ids import publish_unique_id
lib, why = library()
uid = lib.unique_id()
anyio.run(publish_unique_id, FileStore(sys.argv[1]), Authenticator(sys.argv[2]), sys.argv[3], uid)
print(uid.hex(), flush=True)
"""


@needs_lib
async def test_unique_id_travels_through_a_file_store_between_processes(tmp_path: Path) -> None:
    store_dir, token = tmp_path / "store", "s3cret"
    cid = comm_id("trainer", "i1", "gen-0", "i2", "aaaa", "bbbb", 1)
    proc = await anyio.run_process([PYTHON, "-c", _PUBLISH_CHILD, str(store_dir), token, cid], env=python_env(),
                                   cwd=ROOT)
    published = bytes.fromhex(proc.stdout.decode().strip())
    assert len(published) == _nccl.UNIQUE_ID_BYTES and any(published)

    store = FileStore(store_dir)
    assert await read_unique_id(store, Authenticator(token), cid, "trainer") == published
    with pytest.raises(TransportInternalError, match="signed with another token"):
        await read_unique_id(store, Authenticator("other"), cid, "trainer")
    with pytest.raises(TransportInternalError, match="no NCCL unique id for comm"):
        await read_unique_id(store, Authenticator(token), cid + "x", "trainer")

    # The id is a real one: NCCL accepts it and fails only for want of a GPU (here).
    if torch.cuda.is_available():
        return
    assert LIB is not None
    with pytest.raises(_nccl.NcclError) as info:
        _nccl.Communicator.start(LIB, published, 2, 1, 0, cid)
    assert info.value.code == _nccl.NcclResult.UNHANDLED_CUDA_ERROR
    assert f"ncclCommInitRankConfig(rank 1 of 2, cuda:0) of comm {cid}" in str(info.value)


@needs_lib
@no_gpu
def test_init_without_a_gpu_is_a_clear_error() -> None:
    assert LIB is not None
    with pytest.raises(_nccl.NcclError) as info:
        _nccl.Communicator.start(LIB, LIB.unique_id(), 1, 0, 0, "solo")
    msg = str(info.value)
    assert "ncclCommInitRankConfig(rank 0 of 1, cuda:0) of comm solo: UNHANDLED_CUDA_ERROR" in msg
    assert "Cuda failure" in msg or "cuda" in msg.lower()
    with pytest.raises(_nccl.NcclError, match="unique id of 3 bytes"):
        _nccl.Communicator.start(LIB, b"abc", 1, 0, 0, "solo")


@needs_lib
def test_a_blocking_override_is_refused_before_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL_COMM_BLOCKING=1 would make rank 0's init wait, holding the event loop, for a peer
    that is asked to join only afterwards."""
    assert LIB is not None
    monkeypatch.setenv(_nccl.COMM_BLOCKING_ENV, "1")
    with pytest.raises(_nccl.NcclError, match="NCCL_COMM_BLOCKING=1 makes every communicator blocking") as info:
        _nccl.Communicator.start(LIB, bytes(_nccl.UNIQUE_ID_BYTES), 2, 0, 0, "c")
    assert info.value.code == _nccl.NcclResult.INVALID_USAGE
    monkeypatch.setenv(_nccl.COMM_BLOCKING_ENV, "0")
    assert not _nccl.forced_blocking()


# -- descriptors and reachability -------------------------------------------------------------


def _record(
    name: str, incarnation: str, agent: tuple[str, int], backends: dict[str, bytes],
    regions: dict[str, RegionRecord] | None = None,
) -> PeerRecord:
    return PeerRecord(name, incarnation, 1, os.getpid(), 0, host_id(), agent, backends, regions or {})


@needs_lib
def test_endpoint_descriptor_roundtrip_and_garbage() -> None:
    assert LIB is not None
    info = decode_endpoint(encode_endpoint(LIB), "p")
    assert info.version == LIB.version and info.windows == LIB.has_windows
    bad_version = json.dumps({"format": "transport.nccl", "v": 1, "nccl": [2, "x", 1], "windows": True}).encode()
    for bad in (b"", b"{}", b"not json", bad_version):
        with pytest.raises(WireError, match="p: unreadable nccl endpoint descriptor"):
            decode_endpoint(bad, "p")


@contextlib.asynccontextmanager
async def nccl_backend(
    name: str, store: Any, auth: Authenticator | None = None, incarnation: str | None = None
) -> AsyncIterator[NcclBackend]:
    """A real NcclBackend with its own task group (no CUDA is touched until a transfer)."""
    async with anyio.create_task_group() as tg:
        ctx = BackendContext(name=name, incarnation=incarnation or secrets.token_hex(8), pid=os.getpid(),
                             host=host_id(), tg=tg,
                             copier=None, timeout=10.0, auth=auth or Authenticator(None), store=store)
        backend = NcclBackend(ctx)
        try:
            yield backend
        finally:
            backend.close()
            tg.cancel_scope.cancel()


@needs_lib
async def test_unreachable_reasons() -> None:
    assert LIB is not None
    async with nccl_backend("a", MemoryStore(secrets.token_hex(4))) as a:
        gpu_region = RegionRecord("w", "float32", (4,), 16, True, {},
                                  device="cuda:GPU-00000000-0000-0000-0000-000000000001")
        host_region = RegionRecord("h", "float32", (4,), 16, True, {})
        other = _record("b", "i", ("127.0.0.1", 1), {"nccl": encode_endpoint(LIB)})
        assert a.unreachable_reason(other, host_region, MemoryKind.CUDA) == (
            "b:'h' is host memory; nccl moves GPU memory only"
        )
        assert a.unreachable_reason(other, gpu_region, MemoryKind.CUDA) is None
        older = json.dumps({"format": "transport.nccl", "v": 1, "nccl": [2, 21, 5], "windows": False}).encode()
        why = a.unreachable_reason(_record("c", "i", ("127.0.0.1", 1), {"nccl": older}), gpu_region, MemoryKind.CUDA)
        assert why == (
            f"c runs NCCL 2.21.5 and this process NCCL {LIB.version_string}: NCCL needs the same version on both ends"
        )
        why = a.unreachable_reason(_record("d", "i", ("127.0.0.1", 1), {}), gpu_region, MemoryKind.CUDA)
        assert "does not run nccl" in why  # type: ignore[operator]
        why = a.unreachable_reason(_record("e", "i", ("127.0.0.1", 1), {"nccl": b"?"}), gpu_region, MemoryKind.CUDA)
        assert "unreadable nccl endpoint descriptor" in why  # type: ignore[operator]


# -- the agent protocol, against a real Transport's regions ------------------------------------


def nccl_routes(t: transport.Transport, backend: NcclBackend) -> Routes:
    """The agent routes of a real Transport, except that BACKEND requests go to a real
    NcclBackend (a Transport refuses to run nccl on a machine without a GPU)."""
    return Routes(t.name, t._regions, [backend], t._signals)


@contextlib.asynccontextmanager
async def target_and_initiator(
    token: str | None = None,
) -> AsyncIterator[tuple[transport.Transport, NcclBackend, NcclBackend, PeerRecord]]:
    """Transport "b" (regions "w" float32[256], "ro" read-only) whose agent serves nccl
    requests with a real NcclBackend; the initiator's real NcclBackend; b's record."""
    space = secrets.token_hex(4)
    store = MemoryStore(space)
    async with transport.Transport("b", store=f"memory://{space}", backends=("tcp",), timeout=10, token=token) as b:
        b.register("w", torch.zeros(256))
        b.register("ro", torch.zeros(16), writable=False)
        async with nccl_backend("b", store, Authenticator(token), b.incarnation) as served, \
                nccl_backend("a", store, Authenticator(token)) as a:
            server = AgentServer("b", b.incarnation, Authenticator(token), nccl_routes(b, served))
            async with anyio.create_task_group() as tg:
                tg.start_soon(server.serve, tg)
                record = _record("b", b.incarnation, server.address, {"nccl": served.endpoint_descriptor()})
                try:
                    yield b, served, a, record
                finally:
                    tg.cancel_scope.cancel()


def _post(a: NcclBackend, **fields: Any) -> dict[str, Any]:
    meta = {"cid": "a.x>b.y/0>0/1", "seq": 0, "dir": "put", "key": "w", "dtype": "float32", "offset": 0, "nbytes": 1024,
            "timeout": 5.0}
    meta.update(fields)
    return a._meta("post", **meta)


@needs_lib
async def test_post_refusals_arrive_as_typed_errors_before_anything_moves() -> None:
    async with target_and_initiator() as (b, _served, a, record):
        before = b.regions["w"].tensor.clone()
        cases = [
            ({"key": "nope"}, RegistrationError, "b has no region 'nope'"),
            ({"dtype": "float16"}, DTypeMismatchError, "the data is float16 but the region is float32"),
            ({"offset": 1000}, BoundsError, "1024 bytes at offset 1000 of b:'w': exceeds its 1024 bytes"),
            ({"offset": -8, "nbytes": 8}, BoundsError, "exceed"),
            ({"key": "ro", "nbytes": 64}, ReadOnlyRegionError, "b:'ro' is read-only"),
            ({"dir": "sideways"}, TransportInternalError, "dir='sideways'"),
            ({"nbytes": 0}, TransportInternalError, "bad nccl post of 0 bytes"),
            ({"seq": "1"}, TransportInternalError, "seq='1'"),
        ]
        for fields, error, text in cases:
            with pytest.raises(error) as info:
                await a.request(record, _post(a, **fields))
            assert text in str(info.value), (fields, str(info.value))
            assert str(info.value).startswith("b refused: ")
        # Valid requests reach the memory check: these regions are host memory.
        with pytest.raises(TransportInternalError, match="b:'w' is host memory; nccl moves GPU memory only"):
            await a.request(record, _post(a))
        with pytest.raises(TransportInternalError, match="b:'ro' is host memory"):
            # gets from read-only regions pass the checks
            await a.request(record, _post(a, key="ro", dir="get", nbytes=64))
        assert torch.equal(b.regions["w"].tensor, before)


@needs_lib
async def test_open_close_self_and_unknown_requests() -> None:
    async with target_and_initiator(token="t0ken") as (_b, served, a, record):
        cid = comm_id("a", a.ctx.incarnation, "b", record.incarnation, "aaaa", "bbbb", 1)
        open_meta = a._meta("open", cid=cid, device="cuda:GPU-00000000-0000-0000-0000-00000000beef", pair="aaaa>bbbb",
                            timeout=5.0)
        with pytest.raises(TransportInternalError, match=f"no NCCL unique id for comm {re.escape(cid)}"):
            await a.request(record, open_meta)
        assert LIB is not None
        await publish_unique_id(a.ctx.store, Authenticator("wrong"), cid, LIB.unique_id())
        with pytest.raises(TransportInternalError, match="signed with another token"):
            await a.request(record, open_meta)
        await publish_unique_id(a.ctx.store, a.ctx.auth, cid, LIB.unique_id())
        with pytest.raises(TransportInternalError, match="b sees no GPU GPU-00000000-0000-0000-0000-00000000beef"):
            await a.request(record, open_meta)
        assert served._comms._served == {}

        assert await a.request(record, a._meta("close", cid=cid)) == {"comm": "closed"}
        with pytest.raises(TransportInternalError, match="no local nccl transfer 7 is waiting"):
            await a.request(record, a._meta("self", ticket=7, dir="put", key="w", dtype="float32", offset=0, nbytes=8))
        with pytest.raises(TransportInternalError, match="unknown nccl request 'frobnicate'"):
            await a.request(record, a._meta("frobnicate"))
        with pytest.raises(TransportInternalError, match=r"bad nccl request: cid=None"):
            await a.request(record, a._meta("close"))


@needs_lib
async def test_a_transport_without_nccl_refuses_nccl_requests() -> None:
    space = secrets.token_hex(4)
    async with transport.Transport("c", store=f"memory://{space}", backends=("tcp",), timeout=10) as c:
        c.register("w", torch.zeros(8))
        data = MemoryStore(space).get("peer/c")
        assert data is not None
        record = PeerRecord.decode(data)
        async with nccl_backend("a", MemoryStore(space)) as a:
            with pytest.raises(TransportInternalError, match="c does not run backend 'nccl'"):
                await a.request(record, _post(a, nbytes=32))


# -- abort paths, with a communicator that fails on demand ----------------------------------------


class FakeComm:
    """Stands in for :class:`transport._native.nccl.Communicator`: records calls, fails on demand."""

    rank, nranks, device = 0, 2, 0

    def __init__(self) -> None:
        self.aborted = False
        self.failure: _nccl.NcclError | None = None
        self.calls: list[str] = []

    def state(self) -> _nccl.NcclResult:
        if self.failure is not None:
            raise self.failure
        return _nccl.NcclResult.SUCCESS

    def abort(self) -> None:
        self.aborted = True

    def grouped(self, what: str, calls: Any) -> _nccl.NcclResult:
        self.calls.append(what)
        return _nccl.NcclResult.SUCCESS


class DoneEvent:
    """A CUDA event whose work has finished (as it has once an abort cut the work short)."""

    def query(self) -> bool:
        return True


@needs_lib
async def test_a_completed_event_on_an_aborted_link_is_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    destroyed: list[str] = []
    monkeypatch.setattr(_comm, "_destroy_stream", lambda handle, device, cid: destroyed.append(cid))
    async with nccl_backend("a", MemoryStore(secrets.token_hex(4))):
        link = Comm("a>b/1", "b", "i", FakeComm(), None, 1, None, None)
        await link.wait(DoneEvent(), "nccl get")
        link.abort(PeerLostError("b left"), tell=False)
        assert link.nccl.aborted and destroyed == ["a>b/1"]
        with pytest.raises(PeerLostError, match=r"nccl get: comm a>b/1 was aborted: b left"):
            await link.wait(DoneEvent(), "nccl get")

        failing = Comm("a>b/2", "b", "i", FakeComm(), None, 2, None, None)
        failing.nccl.failure = _nccl.NcclError("ncclRecv", _nccl.NcclResult.REMOTE_ERROR)
        with pytest.raises(PeerLostError, match=r"nccl get failed on comm a>b/2 with b: ncclRecv: REMOTE_ERROR"):
            await failing.wait(DoneEvent(), "nccl get")
        assert failing.lost is not None and failing.nccl.aborted and destroyed == ["a>b/1", "a>b/2"]


@needs_lib
async def test_a_self_transfer_cancelled_while_its_comm_opens_is_never_enqueued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with nccl_backend("a", MemoryStore(secrets.token_hex(4))) as a:
        tensor = SimpleNamespace(device=torch.device("cuda", 0), data_ptr=lambda: 1 << 20)
        ticket = _Ticket(TransferOp.GET, SimpleNamespace(tensor=tensor), ready=None)
        a._tickets[7] = ticket
        comm = FakeComm()

        async def self_comm(device: int) -> Comm:
            del a._tickets[7]  # the transfer is cancelled (its tensor may be freed) meanwhile
            return Comm("self", "a", a.ctx.incarnation, comm, None, 1, None, None)

        monkeypatch.setattr(a._comms, "self_comm", self_comm)
        meta = a._meta("self", ticket=7, dir="get", key="w", dtype="float32", offset=0, nbytes=8)
        with pytest.raises(TransferAbortedError, match="cancelled before it was enqueued"):
            await a.serve_request(meta, lambda op, m, n: SimpleNamespace(key="w", tensor=tensor))
        assert comm.calls == [] and ticket.comm is None and not comm.aborted


# -- GPU -----------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
async def test_one_rank_put_and_get_to_self(memory_store: str) -> None:
    assert LIB is not None
    print(f"NCCL {LIB.version_string} from {LIB.path} on {torch.cuda.get_device_name(0)}")
    async with transport.Transport("solo", store=memory_store, backends=["nccl"], timeout=60) as t:
        n = 1 << 20
        dst = torch.zeros(n, dtype=torch.float32, device="cuda")
        t.register("dst", dst)
        src = torch.randn(n, device="cuda")
        h = t.put(src, "solo", key="dst")
        await h
        assert h.backend == "nccl"
        assert torch.equal(dst, src)

        part = torch.arange(1000, dtype=torch.float32, device="cuda")
        await t.put(part, "solo", key="dst", offset=4 * 5000)
        assert torch.equal(dst[5000:6000], part) and torch.equal(dst[:5000], src[:5000])
        back = torch.empty(1000, device="cuda")
        await t.get(back, "solo", key="dst", offset=4 * 5000)
        assert torch.equal(back, part)

        # Stream semantics: the put waits for work queued on the caller's stream before it.
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            late = torch.zeros(n, device="cuda")
            torch.cuda._sleep(50_000_000)  # keep the stream busy so that the fill lands late
            late.fill_(7.0)
            h = t.put(late, "solo", key="dst")
        await h
        assert bool((dst == 7.0).all())

        with pytest.raises(BoundsError):
            await t.put(torch.zeros(n + 1, device="cuda"), "solo", key="dst")
        ro = torch.zeros(16, device="cuda")
        t.register("ro", ro, writable=False)
        with pytest.raises(ReadOnlyRegionError):
            await t.put(torch.ones(16, device="cuda"), "solo", key="ro")
        await t.get(torch.empty(16, device="cuda"), "solo", key="ro")

        # Host tensors reach a device region through a GPU staging buffer (nccl moves device
        # memory only): what a publisher's packed host buckets need for GPU slots across hosts.
        host = torch.randn(n)
        h = t.put(host, "solo", key="dst")
        await h
        assert h.backend == "nccl" and torch.equal(dst.cpu(), host)
        host_back = torch.empty(1000)
        await t.get(host_back, "solo", key="dst", offset=4 * 5000)
        assert torch.equal(host_back, host[5000:6000])


_PEER_CHILD = r"""
import json, os, signal, sys, time, anyio, torch, transport
from transport._native import nccl as _nccl
spec = json.loads(sys.argv[1])
mode = spec.get("mode", "normal")
inflight = []

async def initiate(t, src, out):
    if spec.get("stall"):
        await t.signal(spec["peer"], "stall", 1)
        try:
            await t.put(src, spec["peer"], key="w", timeout=spec["stall"] / 3)
            out["stalled_put"] = "completed"
        except transport.TransportError as exc:
            out["stalled_put"] = type(exc).__name__
    h = t.put(src, spec["peer"], key="w")
    await h
    out["backend"] = h.backend
    back = torch.empty_like(src)
    await t.get(back, spec["peer"], key="w")
    out["get_ok"] = bool(torch.equal(back, src))
    await t.signal(spec["peer"], "done", 1)
    if mode == "close_in_flight":
        # leaving `async with` closes the Transport with these in flight
        inflight.extend(t.put(src, spec["peer"], key="w") for _ in range(4))
    else:
        await t.signal(spec["peer"], "bye", 1)

async def main():
    torch.cuda.set_device(spec["device"])
    out = {"nccl": _nccl.library()[0].version_string}
    n = spec["numel"]
    async with transport.Transport(spec["name"], store=spec["store"], backends=["nccl"], timeout=60) as t:
        if spec["role"] == "target":
            region = torch.zeros(n, dtype=torch.float32, device="cuda")
            t.register("w", region)
            if mode == "kill_target":
                await t.wait_signal("stall", 1, timeout=90)
                time.sleep(1.0)  # the agent is blocked: the put is posted, not served
                os.kill(os.getpid(), signal.SIGKILL)
            if spec.get("stall"):
                await t.wait_signal("stall", 1, timeout=90)
                time.sleep(spec["stall"])  # the agent (and so the receive) is blocked meanwhile
            await t.wait_signal("done", 1, timeout=120)
            torch.cuda.synchronize()
            out["sum"] = float(region.double().sum())
            if mode == "close_in_flight":
                await anyio.sleep(3)  # the initiator closes with a put in flight meanwhile
            else:
                await t.wait_signal("bye", 1, timeout=120)
        else:
            await t.peer(spec["peer"], regions=["w"], timeout=60)
            src = torch.arange(n, dtype=torch.float32, device="cuda")
            if mode == "kill_target":
                await t.signal(spec["peer"], "stall", 1)
                try:
                    await t.put(src, spec["peer"], key="w", timeout=45)
                    out["killed_put"] = "completed"
                except transport.TransportError as exc:
                    out["killed_put"] = type(exc).__name__
            else:
                await initiate(t, src, out)
    if spec["role"] == "initiator" and mode == "close_in_flight":
        out["inflight"] = sorted({type(h.exception()).__name__ if h.exception() else "completed" for h in inflight})
    out["closed"] = True  # Transport.aclose returned (it crashed the process once: SIGSEGV in ncclCommAbort's wake)
    print(json.dumps(out), flush=True)

anyio.run(main)
"""


def _spawn(spec: dict, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, "-c", _PEER_CHILD, json.dumps(spec)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


async def _run_pair(tmp_path: Path, devices: tuple[int, int], env_extra: dict[str, str], stall: float = 0.0,
                    mode: str = "normal") -> tuple[dict | None, dict]:
    """Runs a target and an initiator process (one rank each) and returns what each printed
    (None for a target that was killed, as ``mode="kill_target"`` asks). Every process that is
    not killed on purpose must exit with status 0: a crash at close fails the test."""
    env = {**python_env(), **env_extra}
    store = f"file://{tmp_path / 'store'}"
    n = 1 << 22
    specs = [
        {"role": "target", "name": "gen", "device": devices[1], "store": store, "numel": n, "stall": stall,
         "mode": mode},
        {"role": "initiator", "name": "trainer", "peer": "gen", "device": devices[0], "store": store, "numel": n,
         "stall": stall, "mode": mode},
    ]
    procs = [_spawn(spec, env) for spec in specs]
    try:
        with anyio.fail_after(240):
            while any(p.poll() is None for p in procs):
                await anyio.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
    outs: list[dict | None] = []
    for p, spec in zip(procs, specs, strict=True):
        stdout, stderr = p.stdout.read().decode(), p.stderr.read().decode()  # type: ignore[union-attr]
        p.stdout.close(), p.stderr.close()  # type: ignore[union-attr]
        if mode == "kill_target" and spec["role"] == "target":
            assert p.returncode == -9, (p.returncode, stderr[-4000:])
            outs.append(None)
            continue
        assert p.returncode == 0, (spec["role"], p.returncode, stderr[-4000:])
        out = json.loads(stdout.strip().splitlines()[-1])
        assert out["closed"], out
        outs.append(out)
    target, initiator = outs
    assert initiator is not None
    if mode == "kill_target":
        return target, initiator
    assert initiator["backend"] == "nccl" and initiator["get_ok"]
    assert target is not None and target["sum"] == float(n * (n - 1) // 2)
    return target, initiator


_ONE_GPU = pytest.mark.skipif(
    not GPU or LIB is None or LIB.version < _nccl.MULTI_RANK_GPU_VERSION,
    reason="two ranks on one GPU need NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1")
_MULTI_RANK = {_nccl.MULTI_RANK_GPU_ENV: "1"}


@pytest.mark.gpu
@pytest.mark.skipif(
    not GPU or torch.cuda.device_count() < 2,
    reason="needs two CUDA GPUs (NCCL puts at most one rank on a GPU by default)",
)
async def test_two_processes_two_gpus(tmp_path: Path) -> None:
    await _run_pair(tmp_path, (0, 1), {})


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
async def test_a_stalled_target_times_out_and_the_next_put_reopens(tmp_path: Path) -> None:
    _target, initiator = await _run_pair(tmp_path, (0, 1), {}, stall=6.0)
    assert initiator["stalled_put"] == TransferTimeoutError.__name__


@pytest.mark.gpu
@_ONE_GPU
async def test_two_processes_one_gpu_with_multi_rank_enabled(tmp_path: Path) -> None:
    """Put, get, then both processes close and exit with status 0 (the initiator once died with
    SIGSEGV in close: its pinned ack buffer came from torch's caching host allocator, which had
    recorded the comm's stream on it, and freeing it after the stream was destroyed recorded an
    event on a stream that no longer existed)."""
    await _run_pair(tmp_path, (0, 0), _MULTI_RANK)


@pytest.mark.gpu
@_ONE_GPU
async def test_one_gpu_close_with_puts_in_flight_exits_cleanly(tmp_path: Path) -> None:
    _target, initiator = await _run_pair(tmp_path, (0, 0), _MULTI_RANK, mode="close_in_flight")
    # each ended, completed or cut by the close; none hangs, nothing crashes
    assert set(initiator["inflight"]) <= {"completed", "ClosedError"}, initiator


@pytest.mark.gpu
@_ONE_GPU
async def test_one_gpu_target_killed_mid_put_is_a_peer_lost_error(tmp_path: Path) -> None:
    _target, initiator = await _run_pair(tmp_path, (0, 0), _MULTI_RANK, mode="kill_target")
    # PeerLostError, not the put's own 45 s deadline: the loss was seen, not waited out
    assert initiator["killed_put"] == PeerLostError.__name__, initiator


@pytest.mark.gpu
@_ONE_GPU
async def test_one_gpu_a_stalled_target_times_out_and_the_next_put_reopens(tmp_path: Path) -> None:
    _target, initiator = await _run_pair(tmp_path, (0, 0), _MULTI_RANK, stall=6.0)
    assert initiator["stalled_put"] == TransferTimeoutError.__name__
