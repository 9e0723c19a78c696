"""The rendezvous store as an attacker or a careless user meets it:
records bound to their key, name and incarnation; a private store directory; capped and
poisoned records; a TCPStore that listens only where its URL says; a wrong token reported
quickly; empty tokens and unusable names refused; a bounded lost-peer table.

Real stores (directories, torch TCPStore), real Transports in this process, real sockets.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import time
import urllib.parse
from pathlib import Path

import pytest
import torch

import transport
from transport._auth import Authenticator
from transport._errors import RecordTooLargeError, StoreError
from transport._liveness import Leases, LostTable
from transport._peers import MAX_NAME_BYTES, check_name
from transport._rendezvous import MAX_VALUE_BYTES, FileStore, TCPStore, open_store, serve_store

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def record_file(store_dir: Path, key: str) -> Path:
    return store_dir / urllib.parse.quote(key, safe="")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- records that bind what they are ------------------------------------------------------------


def test_a_signed_record_opens_only_under_its_own_key_name_and_incarnation():
    auth = Authenticator("s3cret")
    signed = auth.sign_record(b"body", key="peer/a", name="a", incarnation="i1")
    assert auth.open_bound(signed, "a", key="peer/a", name="a") == (b"body", "i1")
    for key, name in (("peer/b", "a"), ("peer/a", "b"), ("peer/b", "b")):
        with pytest.raises(transport.AuthenticationError, match="another key or name"):
            auth.open_bound(signed, name, key=key, name=name)
    # The incarnation travels in the clear but is covered by the tag: changing it breaks the tag.
    forged = signed.replace(b"i1".hex().encode(), b"i2".hex().encode())
    with pytest.raises(transport.AuthenticationError):
        auth.open_bound(forged, "a", key="peer/a", name="a")
    with pytest.raises(transport.AuthenticationError, match="another token"):
        Authenticator("guess").open_bound(signed, "a", key="peer/a", name="a")
    # Without a token nothing is checked, and the tag is only stripped.
    assert Authenticator(None).open_bound(signed, "a", key="peer/b", name="b") == (b"body", None)


@pytest.mark.parametrize("token", ["s3cret", None], ids=["token", "no-token"])
async def test_a_record_copied_to_another_name_is_refused(tmp_path, token):
    """The alias attack: gen-0's record copied to gen-1's key. A put to gen-1 is refused and
    never lands in gen-0's memory; waiting for gen-1 says why."""
    store_dir = tmp_path / "store"
    url = f"file://{store_dir}"
    async with transport.Transport("gen-0", store=url, backends=("tcp",), timeout=10, token=token) as gen0, \
            transport.Transport("trainer", store=url, backends=("tcp",), timeout=10, token=token) as trainer:
        w = torch.zeros(16)
        gen0.register("w", w)
        shutil.copyfile(record_file(store_dir, "peer/gen-0"), record_file(store_dir, "peer/gen-1"))

        refused = transport.AuthenticationError if token else transport.TransportError
        with pytest.raises(refused, match="another key or name" if token else "names 'gen-0', not 'gen-1'"):
            await trainer.put(torch.ones(16), "gen-1", key="w")
        assert torch.equal(w, torch.zeros(16))
        assert await trainer.lookup("gen-1") is None
        if token:
            with pytest.raises(transport.AuthenticationError, match="gen-1"):
                await trainer.peer("gen-1", timeout=10)
        else:
            with pytest.raises(transport.PeerNotFoundError, match=r"rejected.*names 'gen-0'"):
                await trainer.peer("gen-1", timeout=0.3)
        assert torch.equal(w, torch.zeros(16))
        # gen-0 itself is still reachable under its own name.
        await trainer.put(torch.full((16,), 3.0), "gen-0", key="w")
        assert torch.equal(w, torch.full((16,), 3.0))


# -- store permissions --------------------------------------------------------------------------


def test_a_new_store_directory_is_private_and_its_records_too(tmp_path):
    old = os.umask(0)  # the modes must not depend on the caller's umask
    try:
        store = FileStore(tmp_path / "new" / "store")
        store.set("peer/a", b"record")
    finally:
        os.umask(old)
    assert mode(tmp_path / "new" / "store") == 0o700
    assert mode(record_file(tmp_path / "new" / "store", "peer/a")) == 0o600
    assert store.get("peer/a") == b"record"


@root_only
def test_a_store_directory_owned_by_another_user_is_refused(tmp_path):
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o700)
    os.chown(planted, 65534, 65534)  # nobody
    with pytest.raises(StoreError, match="owned by uid 65534") as info:
        open_store(f"file://{planted}")
    assert "chmod 700" in str(info.value) and "store=file://ANOTHER_DIR" in str(info.value)


@pytest.mark.parametrize("bits", [0o777, 0o770, 0o702])
async def test_a_store_directory_others_can_write_is_refused(tmp_path, bits):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, bits)
    with pytest.raises(StoreError, match=f"writable by other users \\(mode {bits:o}\\)") as info:
        FileStore(shared)
    assert "chmod 700" in str(info.value) and "store=file://ANOTHER_DIR" in str(info.value)
    with pytest.raises(StoreError, match="writable by other users"):
        async with transport.Transport("a", store=f"file://{shared}", backends=("tcp",), timeout=10):
            pass
    assert os.listdir(shared) == []  # nothing was written into it
    os.chmod(shared, 0o700)
    FileStore(shared)  # the fix the message names works


async def test_a_deleted_store_directory_is_recreated(tmp_path):
    store_dir = tmp_path / "store"
    url = f"file://{store_dir}"
    async with transport.Transport("a", store=url, backends=("tcp",), timeout=10) as a:
        shutil.rmtree(store_dir)
        assert await a.peers() == []  # a listing of the vanished directory is empty, not an error
        a.register("w", torch.zeros(4))  # republishes: the directory comes back, private
        assert mode(store_dir) == 0o700
        async with transport.Transport("b", store=url, backends=("tcp",), timeout=10) as b:
            await b.peer("a", regions=["w"], timeout=10)
            await b.put(torch.ones(4), "a", key="w")
            assert torch.equal(a.regions["w"].tensor, torch.ones(4))


# -- poisoned and oversized records -------------------------------------------------------------


async def test_a_huge_record_is_refused_unread_and_harms_nothing(tmp_path):
    store_dir = tmp_path / "store"
    url = f"file://{store_dir}"
    async with transport.Transport("a", store=url, backends=("tcp",), timeout=10) as a, \
            transport.Transport("b", store=url, backends=("tcp",), timeout=10) as b:
        w = torch.zeros(4)
        b.register("w", w)
        with open(record_file(store_dir, "peer/huge"), "wb") as f:
            f.truncate(300 << 20)  # sparse: 300 MB that cost no disk
        with pytest.raises(transport.PeerNotFoundError, match="record too large"):
            await a.peer("huge", timeout=0.3)
        assert await a.lookup("huge") is None
        with pytest.raises(transport.TransportError, match="record too large"):
            await a.put(torch.ones(4), "huge", key="w")
        assert sorted(await a.peers()) == ["a", "b", "huge"]
        await a.put(torch.ones(4), "b", key="w")  # everything else still works
        assert torch.equal(w, torch.ones(4))
    with pytest.raises(RecordTooLargeError):
        FileStore(store_dir).get("peer/huge")


async def test_a_deeply_nested_record_is_a_typed_error(tmp_path):
    store_dir = tmp_path / "store"
    async with transport.Transport("a", store=f"file://{store_dir}", backends=("tcp",), timeout=10) as a:
        FileStore(store_dir).set("peer/deep", b"[" * 200_000)
        with pytest.raises(transport.PeerNotFoundError, match="rejected"):
            await a.peer("deep", timeout=0.3)
        assert await a.lookup("deep") is None
        with pytest.raises(transport.TransportError):
            await a.put(torch.ones(4), "deep", key="w")


def test_a_tcp_store_value_over_the_cap_is_refused_and_the_store_lives_on():
    """torch's server already refuses such a value (its own payload cap is below ours); ``get``
    would refuse one over MAX_VALUE_BYTES from any other server."""
    host = open_store("tcp://127.0.0.1:0?host=1", timeout=10)
    with pytest.raises(StoreError):
        open_store(host.url, timeout=10).set("peer/big", b"x" * (MAX_VALUE_BYTES + 1))
    other = open_store(host.url, timeout=10)
    assert other.get("peer/big") is None
    other.set("peer/ok", b"x" * 1024)
    assert host.get("peer/ok") == b"x" * 1024


# -- the hosted TCPStore listens where its URL says ---------------------------------------------


def listening_addresses(port: int) -> set[str]:
    """Local addresses of the LISTEN sockets on ``port`` (from /proc/net/tcp and tcp6), as hex."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            addr, hex_port = fields[1].rsplit(":", 1)
            if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: TCP_LISTEN
                out.add(addr)
    return out


def other_local_address() -> str | None:
    """A non-loopback IPv4 address of this machine, or None (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.255", 9))
        except OSError:
            return None
        addr = s.getsockname()[0]
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc/net/tcp")
def test_a_hosted_tcp_store_listens_only_on_its_host():
    store = open_store("tcp://127.0.0.1:0?host=1", timeout=10)
    assert isinstance(store, TCPStore)
    assert listening_addresses(store.port) == {"0100007F"}  # 127.0.0.1, and nothing else
    other = other_local_address()
    if other is not None:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((other, store.port), timeout=5).close()
    joined = open_store(store.url, timeout=10)  # still reachable where it should be
    joined.set("k", b"v")
    assert store.get("k") == b"v"

    everywhere = serve_store("0.0.0.0:0", timeout=10)
    assert isinstance(everywhere, TCPStore)
    assert listening_addresses(everywhere.port) == {"00000000"}
    if other is not None:
        socket.create_connection((other, everywhere.port), timeout=5).close()


def test_hosting_on_a_busy_port_is_a_store_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        with pytest.raises(StoreError, match="cannot host"):
            open_store(f"tcp://127.0.0.1:{busy.getsockname()[1]}?host=1", timeout=10)


# -- tokens -------------------------------------------------------------------------------------


async def test_a_wrong_token_is_an_authentication_error_within_a_second(memory_store):
    async with transport.Transport("a", store=memory_store, backends=("tcp",), timeout=30, token="s3cret") as a, \
            transport.Transport("wrong", store=memory_store, backends=("tcp",), timeout=30, token="guess") as wrong, \
            transport.Transport("none", store=memory_store, backends=("tcp",), timeout=30):
        w = torch.zeros(4)
        a.register("w", w)
        start = time.monotonic()
        with pytest.raises(transport.AuthenticationError, match="another token"):
            await wrong.peer("a")
        assert time.monotonic() - start < 1.0
        start = time.monotonic()
        with pytest.raises(transport.AuthenticationError, match="not signed"):
            await a.peer("none")
        assert time.monotonic() - start < 1.0
        with pytest.raises(transport.AuthenticationError, match="another token"):
            await wrong.put(torch.ones(4), "a", key="w")
        assert torch.equal(w, torch.zeros(4))


def test_an_empty_token_is_refused_and_an_empty_env_token_means_none(monkeypatch):
    for empty in ("", b""):
        with pytest.raises(ValueError, match="empty token"):
            Authenticator(empty)
        with pytest.raises(ValueError, match="empty token"):
            transport.Transport("a", store="memory://x", token=empty)
    with pytest.raises(TypeError):
        Authenticator(123)  # type: ignore[arg-type]
    monkeypatch.setenv("TRANSPORT_TOKEN", "")
    assert not Authenticator(None).enabled
    monkeypatch.setenv("TRANSPORT_TOKEN", "t")
    assert Authenticator(None).enabled


# -- names --------------------------------------------------------------------------------------


def test_check_name_accepts_usable_names_and_says_why_not():
    assert check_name("x" * MAX_NAME_BYTES) == "x" * MAX_NAME_BYTES
    assert check_name("é" * (MAX_NAME_BYTES // 2)) == "é" * (MAX_NAME_BYTES // 2)
    cases = [
        ("x" * (MAX_NAME_BYTES + 1), "256 bytes long"),
        ("x" * 5000, "5000 bytes long"),
        ("é" * 128, "256 bytes long"),
        ("", "empty"),
        ("a/b", "'/'"),
        ("a\x00b", "control"),
        ("a\nb", "control"),
        ("a\x85b", "control"),
        ("a\ud800", "control"),
        (7, "must be a str"),
    ]
    for name, why in cases:
        with pytest.raises(ValueError, match=why):
            check_name(name, "peer name")


async def test_unusable_peer_names_are_value_errors_at_the_call(memory_store):
    async with transport.Transport("a", store=memory_store, backends=("tcp",), timeout=10) as a:
        long = "x" * 5000
        with pytest.raises(ValueError, match="5000 bytes"):
            await a.peer(long)
        with pytest.raises(ValueError, match="5000 bytes"):
            await a.lookup(long)
        with pytest.raises(ValueError, match="5000 bytes"):
            a.put(torch.ones(4), long, key="w")
        with pytest.raises(ValueError, match="control"):
            a.put(torch.ones(4), "b\x00", key="w")
        with pytest.raises(transport.PeerNotFoundError):  # neither a name nor a Peer
            a.put(torch.ones(4), 5, key="w")  # type: ignore[arg-type]


def test_a_too_long_transport_name_is_a_value_error():
    """Needs ``check_name(name)`` in ``Transport.__init__`` (the integrator's part)."""
    with pytest.raises(ValueError, match="5000 bytes"):
        transport.Transport("x" * 5000, store="memory://x")


async def test_the_longest_names_work_with_a_file_store(tmp_path):
    """A name of MAX_NAME_BYTES escapes to a file name longer than NAME_MAX: the store keeps it
    under a digest, and still lists it."""
    url = f"file://{tmp_path / 'store'}"
    for name in ("x" * MAX_NAME_BYTES, "é" * (MAX_NAME_BYTES // 2)):
        async with transport.Transport(name, store=url, backends=("tcp",), timeout=10) as far, \
                transport.Transport("near", store=url, backends=("tcp",), timeout=10) as near:
            w = far.register("w", torch.zeros(4)).tensor
            await near.peer(name, regions=["w"], timeout=10)
            assert name in await near.peers()
            await near.put(torch.ones(4), name, key="w")
            assert torch.equal(w, torch.ones(4))
    store = FileStore(tmp_path / "s2")
    key = "peer/" + "k" * 400
    store.set(key, b"v")
    assert store.get(key) == b"v" and store.keys("peer/") == [key]
    store.delete(key)
    assert store.get(key) is None and store.keys("peer/") == []


# -- the lost-peer table ------------------------------------------------------------------------


async def test_the_lost_peer_table_stays_small_across_restarts(memory_store, tmp_path):
    async with transport.Transport("observer", store=memory_store, backends=("tcp",), timeout=10,
                                   flight_dir=tmp_path) as observer:
        incarnations = set()
        for _ in range(50):
            async with transport.Transport("p", store=memory_store, backends=("tcp",), timeout=10) as p:
                seen = await observer.peer("p", timeout=10)
                assert seen.incarnation == p.incarnation
                incarnations.add(p.incarnation)
                observer.exclude("p")
                with pytest.raises(transport.PeerLostError, match="excluded"):
                    await observer.put(torch.ones(4), "p", key="w")
        assert len(incarnations) == 50
        assert len(observer._directory._lost) <= 4


def test_lost_table_and_leases_are_bounded():
    table = LostTable(per_name=4, capacity=100)
    for i in range(1000):
        table.add("p", f"inc{i}", RuntimeError(str(i)))
        table.add(f"q{i}", "inc", RuntimeError(str(i)))
    assert len(table) <= 100
    assert ("p", "inc999") in table and ("p", "inc0") not in table
    assert not table.add("p", "inc999", RuntimeError("again"))
    leases = Leases(10.0)
    for i in range(100):
        assert leases.expired("p", f"inc{i}", f"inc{i} 1".encode()) is None
    assert len(leases._seen) == 1
