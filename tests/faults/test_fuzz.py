"""Property-based tests (hypothesis): random put/get arguments against a real pair of
Transports, and random bytes into every decoder. Every case either moves exactly the right
bytes or raises a TransportError subclass; nothing crashes and nothing lands outside the
addressed range."""

from __future__ import annotations

import uuid

import anyio
import anyio.from_thread
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import transport
from transport._auth import Authenticator
from transport._errors import WireError
from transport._wire import FRAME_HEADER, PeerRecord, decode_header, decode_meta
from transport.backends.tcp._frames import RunsRequest
from transport.weights._layout import Layout

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int64, torch.bool, torch.float64]
REGION_NUMEL = 257  # float32 region "r": 1028 bytes
FUZZ = settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module", params=["ipc", "tcp"])
def live_pair(request):
    """A pair of Transports running on an event loop in a background thread for the module."""
    backend = request.param
    store = f"memory://{uuid.uuid4().hex}"
    with (
        anyio.from_thread.start_blocking_portal("trio") as portal,
        portal.wrap_async_context_manager(transport.Transport("a", store=store, backends=(backend,), timeout=10)) as a,
        portal.wrap_async_context_manager(transport.Transport("b", store=store, backends=(backend,), timeout=10)) as b,
    ):
        region = torch.zeros(REGION_NUMEL, dtype=torch.float32)
        b.register("r", region)
        b.register("ro", torch.zeros(8), writable=False)
        portal.call(lambda: a.peer("b", regions=["r", "ro"]))
        yield portal, a, region


@st.composite
def transfer_args(draw):
    # Biased towards valid transfers (about half), so the success path is exercised as much
    # as every way of getting it wrong.
    dtype = draw(st.sampled_from([torch.float32] * 8 + DTYPES))
    numel = draw(st.one_of(st.integers(0, 300), st.integers(0, 64)))
    offset = draw(st.one_of(st.integers(0, 257).map(lambda i: 4 * i), st.integers(-16, 1100),
                            st.sampled_from([0, 4, 1024, 1028, 2**40, -(2**40)])))
    key = draw(st.sampled_from(["r"] * 8 + ["ro", "nope", ""]))
    peer = draw(st.sampled_from(["b"] * 8 + ["nobody", "a"]))
    op = draw(st.sampled_from(["put", "get"]))
    strided = draw(st.booleans())
    seed = draw(st.integers(0, 2**31))
    return dtype, numel, offset, key, peer, op, strided, seed


def make(dtype: torch.dtype, numel: int, strided: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = numel * 2 if strided else numel
    if dtype != torch.bool:
        base = torch.randint(0, 100, (n,), generator=g).to(dtype)
    else:
        base = torch.randint(0, 2, (n,), generator=g).bool()
    return base[::2] if strided else base


@FUZZ
@given(args=transfer_args())
def test_put_get_arguments(live_pair, args):
    portal, a, region = live_pair
    dtype, numel, offset, key, peer, op, strided, seed = args
    t = make(dtype, numel, strided, seed)
    before = region.clone()
    nbytes = t.numel() * t.element_size()

    async def run() -> None:
        if op == "put":
            await a.put(t, peer, key=key, offset=offset)
        else:
            await a.get(t, peer, key=key, offset=offset)

    valid = (peer == "b" and key == "r" and dtype == torch.float32 and 0 <= offset and offset % 4 == 0
             and offset + nbytes <= REGION_NUMEL * 4 and not (op == "get" and strided and numel > 1))
    event("valid" if valid else "invalid")
    try:
        portal.call(run)
    except transport.TransportError:
        assert not valid, f"valid arguments raised: {args}"
        assert torch.equal(region, before), "a refused transfer changed the region"
        return
    assert (
        valid
        or (op == "get" and key == "ro" and peer == "b" and dtype == torch.float32
            and 0 <= offset and offset % 4 == 0 and offset + nbytes <= 32)
        or (nbytes == 0 and peer == "b" and key in ("r", "ro") and dtype == torch.float32 and 0 <= offset)
    ), f"invalid arguments succeeded: {args}"
    lo = offset // 4
    if op == "put" and key == "r":
        assert torch.equal(region[lo : lo + t.numel()], t.contiguous()), "wrong bytes landed"
        mask = torch.ones(REGION_NUMEL, dtype=torch.bool)
        mask[lo : lo + t.numel()] = False
        assert torch.equal(region[mask], before[mask]), "bytes landed outside the addressed range"
    else:
        assert torch.equal(region, before)
        if key == "r":
            assert torch.equal(t, region[lo : lo + t.numel()])


DECODE_ERRORS = (WireError, transport.TransportError)


@FUZZ
@given(data=st.binary(max_size=400))
def test_decoders_reject_random_bytes(data):
    for decode in (PeerRecord.decode, Layout.decode, decode_meta):
        try:
            decode(data)
        except DECODE_ERRORS:
            pass
    try:
        decode_header(data[: FRAME_HEADER.size] if len(data) >= FRAME_HEADER.size else data)
    except DECODE_ERRORS:
        pass
    try:
        Authenticator("k").open_record(data, "x")
    except transport.AuthenticationError:
        pass


@FUZZ
@given(groups=st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                           lambda c: st.lists(c, max_size=5), max_leaves=30),
       staged=st.none() | st.booleans() | st.integers())
def test_run_group_tables_decode_or_are_refused(groups, staged):
    """A PUTR / GETR group table from the network: a valid one or a WireError, nothing else."""
    try:
        request = RunsRequest.from_meta({"groups": groups, "staged": staged})
    except WireError:
        return
    assert 0 < len(request.groups) and isinstance(request.staged, bool)
    for key, dtype, count in request.groups:
        assert isinstance(key, str) and isinstance(dtype, str)
        assert type(count) is int and count > 0
    assert request.table_bytes == 16 * request.count


@FUZZ
@given(doc=st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                        max_leaves=20),
       field=st.sampled_from(
           ["name", "incarnation", "seq", "pid", "pid_start", "host", "agent", "backends", "regions"]))
def test_peer_record_with_mutated_fields(doc, field):
    import json

    base = json.loads(PeerRecord(
        name="p", incarnation="i", seq=1, pid=2, pid_start=3,
        host=__import__("transport._wire", fromlist=["HostId"]).HostId("h", "b", 1),
        agent=("127.0.0.1", 1), backends={"tcp": b""}, regions={},
    ).encode())
    base[field] = doc
    try:
        PeerRecord.decode(json.dumps(base).encode())
    except WireError:
        pass
