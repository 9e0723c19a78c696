"""Backends and the registry that names them.

Each built-in backend lives in its own module behind :class:`Backend`. Third-party backends
(for example one built on NIXL or Mooncake) plug in by name, in one of two ways:

* ``transport.register_backend("nixl", NixlBackend)`` at run time, or
* an entry point in the group ``transport.backends`` of an installed distribution, e.g. in its
  ``pyproject.toml``::

      [project.entry-points."transport.backends"]
      nixl = "my_package.nixl_backend:NixlBackend"

  Entry points are loaded lazily, the first time a name is looked up that no registered backend
  has (and by :func:`registered_backends` / :func:`availability`); a plugin that fails to load
  is logged as a warning naming it and skipped, so it never breaks ``import transport``.

A registered backend is used only where it is named (``Transport(backends=("nixl", "tcp"))``);
``Transport(backends=None)`` uses the built-in default set, :func:`default_backends`. Every
backend, built in or not, should pass :func:`transport.testing.check_backend`.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import re
import threading
from collections.abc import Mapping, Sequence

from .._errors import BackendUnavailableError
from .._tensors import MemoryKind
from .._wire import BACKEND_KINDS
from ._base import Backend, BackendContext, LocalBuffer, RemoteTarget, Runner, Runs
from .ipc import IpcBackend
from .nccl import NcclBackend
from .tcp import TcpBackend
from .ucx import UcxBackend

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "transport.backends"

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}")

# The built-in backends, in default preference order (per transfer, the first backend that both
# ends speak and that serves the memory kinds wins): the fastest same-host path first; then
# one-sided RMA to any host; then NCCL for GPU memory on any host (its target's agent posts the
# receive, so a truly one-sided path that serves the same memory is preferred); the
# dependency-free agent path last. nccl serves only CUDA memory and ucx/tcp only host memory
# today, so for now nccl is what carries GPU memory wherever ipc cannot.
_BUILTIN: dict[str, type[Backend]] = {
    "ipc": IpcBackend,
    "ucx": UcxBackend,
    "nccl": NcclBackend,
    "tcp": TcpBackend,
}

# The default set: the built-in names in preference order. ``register_backend(name, cls,
# replace=True)`` on a built-in name swaps the class here (keeping its place); third-party names
# never appear here. Read it; change it only through register_backend / unregister_backend.
REGISTRY: dict[str, type[Backend]] = dict(_BUILTIN)


class _Registry:
    """Third-party backends by name, and which entry points were already tried.

    One instance per process (``_registry``): a backend name must mean the same class
    everywhere in a process, as it does in the peer records that other processes read.
    """

    def __init__(self) -> None:
        self.plugins: dict[str, type[Backend]] = {}
        self._tried: set[tuple[str, str, str]] = set()  # (distribution, entry-point name, value)
        self._lock = threading.RLock()

    def lookup(self, name: str) -> type[Backend] | None:
        with self._lock:
            return REGISTRY.get(name) or self.plugins.get(name)

    def register(self, name: str, cls: type[Backend], replace: bool) -> None:
        _validate(name, cls)
        with self._lock:
            current = self.lookup(name)
            if current is not None and current is not cls and not replace:
                raise ValueError(
                    f"a backend named {name!r} is already registered ({_qualname(current)}); "
                    "pass replace=True to swap it"
                )
            if name in REGISTRY:
                REGISTRY[name] = cls
            else:
                self.plugins[name] = cls

    def unregister(self, name: str) -> None:
        with self._lock:
            if name in self.plugins:
                del self.plugins[name]
            elif name in _BUILTIN and REGISTRY[name] is not _BUILTIN[name]:
                REGISTRY[name] = _BUILTIN[name]
            elif name in _BUILTIN:
                raise ValueError(f"{name!r} is a built-in backend; it cannot be unregistered")
            else:
                raise ValueError(f"no backend named {name!r} is registered; known: {', '.join(self.names())}")

    def snapshot(self) -> dict[str, type[Backend]]:
        with self._lock:
            return {**REGISTRY, **self.plugins}

    def names(self) -> list[str]:
        with self._lock:
            return [*REGISTRY, *self.plugins]

    def load_entry_points(self) -> None:
        """Registers every entry point of the group not tried before; a broken one is logged
        (naming it) and skipped."""
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else "?"
            tag = (dist, ep.name, ep.value)
            with self._lock:
                if tag in self._tried:
                    continue
                self._tried.add(tag)
            where = f"entry point {ep.name} = {ep.value} (group {ENTRY_POINT_GROUP}, distribution {dist})"
            try:
                cls = ep.load()
                if not isinstance(cls, type) or not issubclass(cls, Backend):
                    raise TypeError(f"it loads {cls!r}, not a transport.backends.Backend subclass")
                with self._lock:
                    current = self.lookup(ep.name)
                    if current is not None and current is not cls:
                        raise ValueError(f"the name {ep.name!r} is taken by {_qualname(current)}")
                    self.register(ep.name, cls, replace=False)
            except Exception as exc:  # noqa: BLE001 - a plugin must never break the library: say which, go on
                log.warning("transport: skipping backend plugin %s: %s: %s", where, type(exc).__name__, exc)
                continue
            log.info("transport: loaded backend plugin %r from %s", ep.name, where)


_registry = _Registry()


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _validate(name: object, cls: object) -> None:
    """Raises unless ``cls`` may be registered as ``name`` (typed ``object``: user input)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"backend name must be 1-64 characters of letters, digits, '_', '.', '-' "
            f"starting with a letter or '_', got {name!r}"
        )
    if not isinstance(cls, type) or not issubclass(cls, Backend):
        raise TypeError(f"backend {name!r}: {cls!r} is not a subclass of transport.backends.Backend")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise TypeError(f"backend {name!r}: {_qualname(cls)} does not implement {missing}")
    declared = getattr(cls, "name", None)
    if declared != name:
        raise ValueError(f"backend {name!r}: {_qualname(cls)}.name is {declared!r}; it must be {name!r}")
    if not isinstance(getattr(cls, "one_sided", None), bool):
        raise TypeError(f"backend {name!r}: {_qualname(cls)}.one_sided must be a bool")
    kinds = getattr(cls, "memory_kinds", None)
    if not isinstance(kinds, frozenset) or not kinds or not all(isinstance(k, MemoryKind) for k in kinds):
        raise TypeError(f"backend {name!r}: {_qualname(cls)}.memory_kinds must be a non-empty frozenset of MemoryKind")
    frames: object = getattr(cls, "frames", frozenset())
    if not isinstance(frames, frozenset) or not frames <= BACKEND_KINDS:
        raise TypeError(f"backend {name!r}: {_qualname(cls)}.frames must be a frozenset of frame kinds from "
                        f"transport._wire.BACKEND_KINDS (not the agent's own), got {frames!r:.100}")


def register_backend(name: str, cls: type[Backend], *, replace: bool = False) -> None:
    """Makes ``cls`` available as backend ``name`` in this process.

    A registered backend runs only where it is named, e.g. ``Transport(backends=(name, "tcp"))``;
    ``Transport(backends=None)`` keeps using :func:`default_backends`. Both ends of a transfer
    must speak the same name (a peer finds it in the other's record). Register before opening
    the Transports that name it.

    Args:
        name: the backend's name: 1-64 letters, digits, ``_``, ``.`` or ``-``, starting with a
            letter or ``_``; it must equal ``cls.name``.
        cls: a concrete :class:`Backend` subclass with the class attributes ``name``,
            ``one_sided`` (bool) and ``memory_kinds`` (non-empty frozenset of memory kinds).
        replace: swap the class behind a name that is already registered (a built-in name keeps
            its place in the default order). Without it, re-registering a name with another
            class raises; registering the same class again is a no-op.

    Raises:
        ValueError: a malformed name, ``cls.name`` differs from it, or the name is taken and
            ``replace`` is False.
        TypeError: ``cls`` is not a concrete Backend subclass with the required attributes.
    """
    _registry.register(name, cls, replace)


def unregister_backend(name: str) -> None:
    """Forgets the backend ``name`` registered in this process (mostly for tests); a built-in
    name whose class was replaced gets its built-in class back. Transports already open keep the
    instances they made.

    Raises:
        ValueError: no backend of that name is registered, or it is an unreplaced built-in.
    """
    _registry.unregister(name)


def backend_class(name: str) -> type[Backend]:
    """The class registered as ``name``, loading entry-point plugins if no registered backend
    has that name yet.

    Raises:
        ValueError: no backend of that name (the message lists the known ones).
    """
    cls = _registry.lookup(name)
    if cls is None:
        _registry.load_entry_points()
        cls = _registry.lookup(name)
    if cls is None:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(_registry.names())}")
    return cls


def default_backends() -> tuple[str, ...]:
    """The names ``Transport(backends=None)`` tries, in preference order (built-ins only; the
    Transport skips those unavailable here)."""
    return tuple(REGISTRY)


def select_backends(requested: Sequence[str] | None) -> list[type[Backend]]:
    """The backend classes a Transport runs: ``requested`` in that order (each must be
    available here), or every available one in the default order when None.

    Raises:
        ValueError: ``requested`` is empty, or names an unknown backend.
        BackendUnavailableError: a requested backend cannot run here (the message says why).
    """
    names = requested if requested is not None else default_backends()
    if not names:
        raise ValueError("backends=() leaves nothing to move bytes with")
    chosen = []
    for cls in [backend_class(n) for n in names]:
        if (reason := cls.unavailable_reason()) is None:
            chosen.append(cls)
        elif requested is not None:
            raise BackendUnavailableError(f"backend {cls.name!r} is unavailable: {reason}")
        else:
            log.info("backend %s unavailable: %s", cls.name, reason)
    return chosen


def registered_backends() -> Mapping[str, type[Backend]]:
    """Every backend known in this process, name -> class (a copy): the built-ins in default
    order, then registered and entry-point plugins in the order they arrived."""
    _registry.load_entry_points()
    return _registry.snapshot()


def availability() -> dict[str, str | None]:
    """Backend name -> None when usable here, else the reason it is not (every registered
    backend, as :func:`registered_backends`)."""
    out: dict[str, str | None] = {}
    for name, cls in registered_backends().items():
        try:
            out[name] = cls.unavailable_reason()
        except Exception as exc:  # noqa: BLE001 - a plugin's probe must not break `doctor`
            out[name] = f"{name}.unavailable_reason() failed: {type(exc).__name__}: {exc}"
    return out


__all__ = [
    "ENTRY_POINT_GROUP",
    "REGISTRY",
    "Backend",
    "BackendContext",
    "LocalBuffer",
    "RemoteTarget",
    "Runner",
    "Runs",
    "availability",
    "backend_class",
    "default_backends",
    "register_backend",
    "registered_backends",
    "unregister_backend",
]
