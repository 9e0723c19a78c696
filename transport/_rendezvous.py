"""Rendezvous stores: where peers publish their records and find each other.

A store is a small key -> bytes map with three implementations chosen by URL:

* ``file://DIR`` (default): one file per key in DIR, written atomically (write + rename). One host,
  any number of processes, nothing to start.
* ``tcp://HOST:PORT``: a ``torch.distributed.TCPStore``. One process hosts it, with
  ``tcp://HOST:PORT?host=1`` (or ``python -m transport store --port PORT``); every other process
  joins with plain ``tcp://HOST:PORT``. Many hosts.
* ``memory://NAME``: a dict inside this process, shared by every Transport of the process that
  names the same NAME. For tests and single-process use.

Store calls are synchronous and short; the async helpers here run the blocking ones in a worker
thread and bound every wait by a timeout.
"""

from __future__ import annotations

import abc
import logging
import os
import tempfile
import threading
import urllib.parse
from datetime import timedelta
from pathlib import Path

import anyio

from ._errors import TransportError

log = logging.getLogger(__name__)

DEFAULT_STORE_ENV = "TRANSPORT_STORE"


def default_store_url() -> str:
    """``$TRANSPORT_STORE``, else ``file://<tmp>/transport-<uid>``."""
    env = os.environ.get(DEFAULT_STORE_ENV)
    if env:
        return env
    return f"file://{Path(tempfile.gettempdir()) / f'transport-{os.getuid()}'}"


class StoreError(TransportError):
    """The rendezvous store could not be reached or used."""


class Store(abc.ABC):
    """A key -> bytes map shared by the peers of one namespace."""

    url: str
    blocking: bool = False  # True when calls may block on the network (run them in a thread)

    @abc.abstractmethod
    def set(self, key: str, value: bytes) -> None: ...

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value, or None when the key does not exist. Never waits for the key."""

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
        if self.blocking:
            return await anyio.to_thread.run_sync(self.get, key)
        return self.get(key)

    async def akeys(self, prefix: str) -> list[str]:
        if self.blocking:
            return await anyio.to_thread.run_sync(self.keys, prefix)
        return self.keys(prefix)


class FileStore(Store):
    """One file per key under a directory; atomic replace on write."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.url = f"file://{self.dir}"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create rendezvous directory {self.dir}: {exc}") from exc

    def _path(self, key: str) -> Path:
        return self.dir / urllib.parse.quote(key, safe="")

    def set(self, key: str, value: bytes) -> None:
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_bytes(value)
            os.replace(tmp, path)
        except OSError as exc:
            raise StoreError(f"cannot write {path}: {exc}") from exc

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot read {self._path(key)}: {exc}") from exc

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass

    def keys(self, prefix: str) -> list[str]:
        out = []
        for name in os.listdir(self.dir):
            if name.startswith("."):
                continue
            key = urllib.parse.unquote(name)
            if key.startswith(prefix):
                out.append(key)
        return sorted(out)


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

    def __init__(self, host: str, port: int, *, is_host: bool, timeout: float) -> None:
        from torch.distributed import TCPStore as _TorchTCPStore

        self.url = f"tcp://{host}:{port}"
        try:
            self._store = _TorchTCPStore(
                host,
                port,
                is_master=is_host,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout),
                use_libuv=True,
            )
        except Exception as exc:  # torch raises RuntimeError / DistNetworkError / TimeoutError
            role = "host" if is_host else "join"
            raise StoreError(f"cannot {role} the TCPStore at {host}:{port}: {exc}") from exc
        self.port = self._store.port
        self.url = f"tcp://{host}:{self.port}"  # the real port when 0 asked for a free one
        self._indexed: set[str] = set()

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
        return None if value == b"" else value  # delete is modelled as an empty value

    def delete(self, key: str) -> None:
        try:
            self._store.delete_key(key)
        except Exception as exc:
            raise StoreError(f"TCPStore {self.url}: delete {key!r} failed: {exc}") from exc

    def keys(self, prefix: str) -> list[str]:
        try:
            n = self._store.add(self._INDEX_N, 0)
            names = {self._store.get(f"__index/{i}").decode() for i in range(1, n + 1)}
            return sorted(k for k in names if k.startswith(prefix) and self._store.check([k]))
        except Exception as exc:
            raise StoreError(f"TCPStore {self.url}: listing {prefix!r} failed: {exc}") from exc


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
