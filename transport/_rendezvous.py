"""Rendezvous stores: where peers publish their records and find each other.

A store is a small key -> bytes map with three implementations chosen by URL:

* ``file://DIR`` (default): one file per key in DIR, written atomically (write + rename). One host,
  any number of processes, nothing to start. DIR is created 0700 and records are written 0600;
  a DIR that another user owns or could write is refused.
* ``tcp://HOST:PORT``: a ``torch.distributed.TCPStore``. One process hosts it, with
  ``tcp://HOST:PORT?host=1`` (or ``python -m transport store --port PORT``), listening on HOST
  only (``0.0.0.0`` for every interface); every other process joins with plain
  ``tcp://HOST:PORT``. Many hosts.
* ``memory://NAME``: a dict inside this process, shared by every Transport of the process that
  names the same NAME. For tests and single-process use.

Store calls are synchronous and short; the async helpers here run the blocking ones (and file
reads) in a worker thread and bound every wait by a timeout. A value larger than
``MAX_VALUE_BYTES`` is refused with RecordTooLargeError, unread where the store allows it.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import logging
import os
import secrets
import socket
import stat
import tempfile
import threading
import urllib.parse
from datetime import timedelta
from pathlib import Path

import anyio

from ._errors import RecordTooLargeError, StoreError
from ._wire import MAX_RECORD_BYTES

log = logging.getLogger(__name__)

DEFAULT_STORE_ENV = "TRANSPORT_STORE"


def default_store_url() -> str:
    """``$TRANSPORT_STORE``, else ``file://<tmp>/transport-<uid>``."""
    env = os.environ.get(DEFAULT_STORE_ENV)
    if env:
        return env
    return f"file://{Path(tempfile.gettempdir()) / f'transport-{os.getuid()}'}"


# No record this library writes comes near this; a larger value is refused without being read.
MAX_VALUE_BYTES = MAX_RECORD_BYTES  # no record is larger; nothing larger is read


class Store(abc.ABC):
    """A key -> bytes map shared by the peers of one namespace."""

    url: str
    blocking: bool = False  # True when calls may block on the network (run them in a thread)

    @abc.abstractmethod
    def set(self, key: str, value: bytes) -> None: ...

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value, or None when the key does not exist. Never waits for the key.

        Raises:
            RecordTooLargeError: the value exceeds :data:`MAX_VALUE_BYTES`.
            StoreError: the store cannot be read.
        """

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def keys(self, prefix: str) -> list[str]:
        """Existing keys that start with ``prefix``."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def aget(self, key: str) -> bytes | None:
        """:meth:`get`, in a worker thread when the store blocks (or reads files).

        Cancellation: the read itself finishes in its thread; its result is dropped."""
        if self.blocking:
            return await anyio.to_thread.run_sync(self.get, key)
        return self.get(key)

    async def akeys(self, prefix: str) -> list[str]:
        if self.blocking:
            return await anyio.to_thread.run_sync(self.keys, prefix)
        return self.keys(prefix)


def _too_large(where: str, size: int) -> RecordTooLargeError:
    return RecordTooLargeError(f"record too large: {where} holds {size} bytes, more than any record "
                               f"({MAX_VALUE_BYTES} bytes at most); refusing to read it")


class FileStore(Store):
    """One file per key under a directory; atomic replace on write.

    The directory is created 0700 and records are written 0600. A directory that another user
    owns, or that is group- or world-writable, is refused: whoever can write it can plant
    records (and, without a token, redirect writes).

    Raises:
        StoreError: (constructor) the directory cannot be created, or is refused (the message
            says how to fix it).
    """

    # A key whose escaped file name would exceed NAME_MAX is stored under a digest of the key,
    # with the key itself in front of the value (so ``keys`` can list it).
    _NAME_MAX = 255
    _LONG = "="  # never produced by urllib.parse.quote(safe=""), so long names cannot collide with others

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.url = f"file://{self.dir}"
        self._open_dir(parents=True)

    # -- the directory ----------------------------------------------------------------------

    def _open_dir(self, *, parents: bool) -> None:
        """Creates the directory (0700; with its ``parents``) unless it exists, then checks who
        can write it."""
        try:
            if parents:
                self.dir.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(self.dir, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise StoreError(f"cannot create rendezvous directory {self.dir}: {exc}") from exc
        else:
            try:  # mkdir's mode is filtered by the umask; say exactly what we mean
                os.chmod(self.dir, 0o700)
            except OSError as exc:
                raise StoreError(f"cannot make rendezvous directory {self.dir} private: {exc}") from exc
        self._check_dir()

    def _check_dir(self) -> None:
        fix = (f"remove it, or `chmod 700` it as its owner, or pass store=file://ANOTHER_DIR "
               f"(or set ${DEFAULT_STORE_ENV})")
        try:
            link, st = os.lstat(self.dir), os.stat(self.dir)
        except OSError as exc:
            raise StoreError(f"cannot use rendezvous directory {self.dir}: {exc}") from exc
        me = os.geteuid()
        if not stat.S_ISDIR(st.st_mode):
            raise StoreError(f"rendezvous store {self.dir} is not a directory; pass store=file://ANOTHER_DIR")
        if stat.S_ISLNK(link.st_mode) and link.st_uid not in (me, 0):
            raise StoreError(f"rendezvous directory {self.dir} is a symbolic link owned by uid {link.st_uid}, not "
                             f"by this user (uid {me}): another user could redirect it; {fix}")
        if st.st_uid != me:
            raise StoreError(f"rendezvous directory {self.dir} is owned by uid {st.st_uid}, not by this user "
                             f"(uid {me}): its owner could forge peer records; {fix}")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise StoreError(f"rendezvous directory {self.dir} is writable by other users (mode "
                             f"{stat.S_IMODE(st.st_mode):o}): they could forge peer records; {fix}")

    # -- keys and files ---------------------------------------------------------------------

    def _name(self, key: str) -> str:
        name = urllib.parse.quote(key, safe="")
        if len(name) <= self._NAME_MAX:
            return name
        return self._LONG + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()

    def _path(self, key: str) -> Path:
        return self.dir / self._name(key)

    @staticmethod
    def _key_header(key: str) -> bytes:
        raw = key.encode("utf-8", "surrogatepass")
        return len(raw).to_bytes(4, "big") + raw

    def set(self, key: str, value: bytes) -> None:
        path = self._path(key)
        data = self._key_header(key) + value if path.name.startswith(self._LONG) else value
        try:
            self._write(path, data)
        except FileNotFoundError:  # the directory was deleted after it was opened: make it anew, once
            try:
                self._open_dir(parents=False)  # (not a vanished parent: that is a store gone away)
                log.warning("rendezvous directory %s was deleted; recreated it", self.dir)
                self._write(path, data)
            except (OSError, StoreError) as exc:
                raise StoreError(f"cannot write {path}: {exc}") from exc
        except OSError as exc:
            raise StoreError(f"cannot write {path}: {exc}") from exc

    def _write(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".tmp.{os.getpid()}.{secrets.token_hex(6)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _read(self, path: Path) -> bytes | None:
        """The file's bytes, or None when it does not exist; never reads more than the cap."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc}") from exc
        with os.fdopen(fd, "rb") as f:
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise StoreError(f"cannot read {path}: not a regular file")
                limit = MAX_VALUE_BYTES + 4 + 4 * self._NAME_MAX  # room for a long key's header
                if st.st_size > limit:
                    raise _too_large(str(path), st.st_size)
                data = f.read(limit + 1)
            except OSError as exc:
                raise StoreError(f"cannot read {path}: {exc}") from exc
        if len(data) > limit:
            raise _too_large(str(path), len(data))
        return data

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        data = self._read(path)
        if data is not None and path.name.startswith(self._LONG):
            header = self._key_header(key)
            if not data.startswith(header):
                return None  # another key with the same digest (or a damaged file): not ours
            data = data[len(header):]
        if data is not None and len(data) > MAX_VALUE_BYTES:
            raise _too_large(str(path), len(data))
        return data

    async def aget(self, key: str) -> bytes | None:
        return await anyio.to_thread.run_sync(self.get, key)  # a file may sit on a slow disk or NFS

    async def akeys(self, prefix: str) -> list[str]:
        return await anyio.to_thread.run_sync(self.keys, prefix)

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreError(f"cannot delete {self._path(key)}: {exc}") from exc

    def keys(self, prefix: str) -> list[str]:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StoreError(f"cannot list rendezvous directory {self.dir}: {exc}") from exc
        out = []
        for name in names:
            if name.startswith("."):
                continue
            key = self._long_key(name) if name.startswith(self._LONG) else urllib.parse.unquote(name)
            if key is not None and key.startswith(prefix):
                out.append(key)
        return sorted(out)

    def _long_key(self, name: str) -> str | None:
        """The key stored in front of a long-named file's value, or None if it is unreadable."""
        try:
            fd = os.open(self.dir / name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                head = os.read(fd, 4 + 4 * self._NAME_MAX) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
            finally:
                os.close(fd)
            n = int.from_bytes(head[:4], "big")
            key = head[4 : 4 + n].decode("utf-8", "surrogatepass")
        except (OSError, UnicodeDecodeError):
            return None
        return key if len(head) >= 4 + n and self._name(key) == name else None


_memory_spaces: dict[str, dict[str, bytes]] = {}
_memory_lock = threading.Lock()


class MemoryStore(Store):
    """A dict shared by the Transports of one process that name the same space."""

    def __init__(self, space: str = "") -> None:
        self.url = f"memory://{space}"
        with _memory_lock:
            self._data = _memory_spaces.setdefault(space, {})

    def set(self, key: str, value: bytes) -> None:
        with _memory_lock:
            self._data[key] = bytes(value)

    def get(self, key: str) -> bytes | None:
        with _memory_lock:
            return self._data.get(key)

    def delete(self, key: str) -> None:
        with _memory_lock:
            self._data.pop(key, None)

    def keys(self, prefix: str) -> list[str]:
        with _memory_lock:
            return sorted(k for k in self._data if k.startswith(prefix))


class TCPStore(Store):
    """``torch.distributed.TCPStore``; one process hosts (``?host=1``), the others join.

    TCPStore has no key listing, so every new key is also appended to an index
    (``__index/N``) that ``keys`` reads back.
    """

    blocking = True
    _INDEX_N = "__index_n"

    def __init__(self, host: str, port: int, *, is_host: bool, timeout: float, bind: str | None = None) -> None:
        """Hosts (``is_host``) or joins the store at ``host:port``. A host listens on ``bind``
        (default ``host``: the address in the URL, and only it; ``0.0.0.0`` for every IPv4
        interface).

        Raises:
            StoreError: the address cannot be listened on, or the store cannot be reached.
        """
        from torch.distributed import TCPStore as _TorchTCPStore

        self.url = f"tcp://{host}:{port}"
        role = "host" if is_host else "join"
        listen_fd, ino = None, 0
        if is_host:  # torch would listen on every interface; listen where the URL says, and hand it the socket
            listen_fd, port, ino = _listen(bind or host, port)
        try:
            self._store = _TorchTCPStore(
                host,
                port,
                is_master=is_host,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout),
                master_listen_fd=listen_fd,
                use_libuv=True,
            )
        except Exception as exc:  # torch raises RuntimeError / DistNetworkError / TimeoutError
            if listen_fd is not None:
                _close_if_still(listen_fd, ino)
            raise StoreError(f"cannot {role} the TCPStore at {host}:{port}: {exc}") from exc
        self.port = self._store.port
        self.url = f"tcp://{host}:{self.port}"  # the real port when 0 asked for a free one
        self._indexed: set[str] = set()
        self._names: set[str] = set()  # every key read from the index so far
        self._scanned = 0  # the index counter when it was last read
        self._pending: set[int] = set()  # index entries not read yet (holes, or not yet examined)
        self._index_lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:
        try:
            if key not in self._indexed and not self._store.check([key]):
                n = self._store.add(self._INDEX_N, 1)
                self._store.set(f"__index/{n}", key)
            self._indexed.add(key)
            self._store.set(key, value)  # type: ignore[arg-type]  # TCPStore.set takes bytes too (str in its stub)
        except Exception as exc:
            raise StoreError(f"TCPStore {self.url}: set {key!r} failed: {exc}") from exc

    def get(self, key: str) -> bytes | None:
        try:
            if not self._store.check([key]):
                return None
            value = self._store.get(key)
        except Exception as exc:
            raise StoreError(f"TCPStore {self.url}: get {key!r} failed: {exc}") from exc
        if len(value) > MAX_VALUE_BYTES:
            raise _too_large(f"{self.url} key {key!r}", len(value))
        return None if value == b"" else value  # delete is modelled as an empty value

    def delete(self, key: str) -> None:
        try:
            self._store.delete_key(key)
        except Exception as exc:
            raise StoreError(f"TCPStore {self.url}: delete {key!r} failed: {exc}") from exc

    def keys(self, prefix: str) -> list[str]:
        """The keys under ``prefix``, from the index.

        Anyone who can reach the store can write its index, and a writer killed between
        ``add`` and ``set`` leaves a hole: an index entry is read only once it exists (a hole
        is looked at again by later listings, never waited for), one that is not a UTF-8 key
        is skipped, and a listing examines at most ``_INDEX_SCAN_MAX`` new entries (the oldest
        and the newest half when the counter jumped further), so no entry can stall or fail it.
        """
        with self._index_lock:  # listings may run in several threads at once
            return self._keys(prefix)

    def _keys(self, prefix: str) -> list[str]:
        try:
            n = self._store.add(self._INDEX_N, 0)
            if n > self._scanned:
                fresh = n - self._scanned
                if fresh > _INDEX_SCAN_MAX:
                    half = _INDEX_SCAN_MAX // 2
                    log.warning("TCPStore %s: the index counter jumped by %d; entries %d to %d are skipped",
                                self.url, fresh, self._scanned + half + 1, n - half)
                    self._pending.update(range(self._scanned + 1, self._scanned + half + 1))
                    self._pending.update(range(n - half + 1, n + 1))
                else:
                    self._pending.update(range(self._scanned + 1, n + 1))
                self._scanned = n
                if len(self._pending) > _INDEX_SCAN_MAX:  # holes that never filled: keep the newest
                    self._pending = set(sorted(self._pending)[-_INDEX_SCAN_MAX:])
            for i in sorted(self._pending):
                entry = f"__index/{i}"
                if not self._store.check([entry]):
                    continue  # a hole (for now): never a blocking get
                self._pending.discard(i)
                raw = self._store.get(entry)
                try:
                    name = raw.decode()
                except UnicodeDecodeError:
                    name = ""
                if not 0 < len(name) <= _MAX_KEY_CHARS:
                    log.warning("TCPStore %s: index entry %d is not a key; skipped", self.url, i)
                    continue
                self._names.add(name)
            return sorted(k for k in self._names if k.startswith(prefix) and self._store.check([k]))
        except Exception as exc:
            raise StoreError(f"TCPStore {self.url}: listing {prefix!r} failed: {exc}") from exc


_INDEX_SCAN_MAX = 1 << 16  # index entries one TCPStore listing examines at most
_MAX_KEY_CHARS = 4096


def _listen(host: str, port: int) -> tuple[int, int, int]:
    """A socket listening on ``host:port`` (port 0: a free one), as (fd, port, inode); the
    caller owns the fd (torch's TCPStore closes it when it is done).

    Raises:
        StoreError: ``host`` does not resolve, or the address cannot be listened on.
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except OSError as exc:
        raise StoreError(f"cannot host a TCPStore at {host}:{port}: {host!r} does not resolve: {exc}") from exc
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except OSError as exc:
        sock.close()
        raise StoreError(f"cannot host a TCPStore at {host}:{port}: {exc}") from exc
    ino = os.fstat(sock.fileno()).st_ino
    return sock.detach(), port, ino


def _close_if_still(fd: int, ino: int) -> None:
    """Closes our listening ``fd`` after torch failed to take it, unless torch already closed it
    (and the number may since name another file: compare inodes)."""
    with contextlib.suppress(OSError):
        if os.fstat(fd).st_ino == ino:
            os.close(fd)


def open_store(url: str | None, *, timeout: float = 30.0) -> Store:
    """Opens the store named by ``url`` (see the module docstring); None means the default.

    Raises:
        StoreError: the URL is malformed or the store cannot be reached.
    """
    url = url or default_store_url()
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        directory = (parsed.netloc + parsed.path) if parsed.netloc else parsed.path
        if not directory:
            raise StoreError(f"file store URL {url!r} names no directory")
        return FileStore(directory)
    if parsed.scheme == "memory":
        return MemoryStore(parsed.netloc + parsed.path)
    if parsed.scheme == "tcp":
        if not parsed.hostname or parsed.port is None:
            raise StoreError(f"tcp store URL {url!r} needs tcp://HOST:PORT")
        query = urllib.parse.parse_qs(parsed.query)
        is_host = query.get("host", ["0"])[0].lower() in ("1", "true", "yes")
        return TCPStore(parsed.hostname, parsed.port, is_host=is_host, timeout=timeout)
    raise StoreError(f"unknown store URL {url!r}: use file://DIR, tcp://HOST:PORT or memory://NAME")


def serve_store(address: str = "127.0.0.1:0", *, timeout: float = 30.0) -> Store:
    """Hosts a ``tcp://`` rendezvous store in this process, for peers on any host to join.

    Pass the returned store's ``url`` as ``store=`` to every Transport (in this process or
    others). The store lives until ``close()`` (or the process exits); use it as a context
    manager to close it on exit.

    Args:
        address: ``HOST:PORT`` to listen on; port 0 picks a free one (``url`` tells which).
            Use ``0.0.0.0:PORT`` to be reachable from other hosts.
        timeout: seconds a store operation may take.

    Returns:
        The hosted store (``url``, ``close()``).

    Raises:
        StoreError: the address cannot be listened on.
        ValueError: a malformed address.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address must be HOST:PORT, got {address!r}")
    return open_store(f"tcp://{host}:{port}?host=1", timeout=timeout)
