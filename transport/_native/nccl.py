"""libnccl, loaded at run time with ctypes: the only nccl code that touches ctypes.

Which library: ``$TRANSPORT_NCCL_LIB`` (a ``libnccl.so.2`` path, or its directory) when set, and
then nothing else; otherwise the ``libnccl.so.2`` this process has already loaded (torch's CUDA
builds load one: two copies of NCCL in one process must be avoided), else the one of an
``nvidia-nccl-cu*`` wheel (``pip install 'transport[nccl]'``), else the system loader's. Nothing
is loaded at import time; :func:`library` loads once per process.

Every communicator is created non-blocking (``ncclConfig_t.blocking = 0``). NCCL then never
blocks the calling thread: a call that has more to do returns ``ncclInProgress`` and
:meth:`Communicator.settle` polls ``ncclCommGetAsyncError`` until the communicator is ready or
failed. Callers bound that wait with their own deadline (cancellation), and a communicator whose
operation overran is aborted (:meth:`Communicator.abort`), which NCCL supports at any point
only for non-blocking communicators.

The config struct is NCCL's versioned, size-prefixed ``ncclConfig_t``: NCCL copies only the
``size`` bytes the caller declares and resets every field newer than the declared ``version``
to its default, so a prefix of the layout (copied from ``nccl.h``) is read correctly by every
NCCL from 2.14 on. The fields used here: ``blocking`` (2.14) and ``commName`` (2.27, used when
the loaded library has it, so NCCL's own logs name the communicator).

Errors: a failed call raises :class:`NcclError` carrying the ``ncclResult_t``
(:class:`NcclResult`); the backend maps it into the transport error tree.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import functools
import glob
import importlib.util
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import anyio

log = logging.getLogger(__name__)

LIB_ENV = "TRANSPORT_NCCL_LIB"
INSTALL_HINT = "pip install 'transport[nccl]'"
LIB_NAME = "libnccl.so.2"

UNIQUE_ID_BYTES = 128
NCCL_API_MAGIC = 0xCAFEBEEF
NCCL_CONFIG_UNDEF_INT = -(2**31)  # INT_MIN

# ncclCommInitRankConfig and the config struct appeared in 2.14.
MIN_VERSION = (2, 14, 0)
# ncclCommWindowRegister appeared in 2.27; ncclPutSignal / ncclWaitSignal (one-sided puts) in 2.29.
# Only their presence is probed (doctor, the endpoint descriptor): transfers use send/recv.
WINDOW_VERSION = (2, 29, 0)
WINDOW_SYMBOLS = ("ncclCommWindowRegister", "ncclCommWindowDeregister", "ncclPutSignal", "ncclWaitSignal",
                  "ncclMemAlloc", "ncclMemFree")
# Since 2.30 NCCL can put two ranks on one GPU when NCCL_MULTI_RANK_GPU_ENABLE=1 (experimental).
MULTI_RANK_GPU_VERSION = (2, 30, 0)
MULTI_RANK_GPU_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"
# NCCL lets this variable (or the same line in /etc/nccl.conf, ~/.nccl.conf) override the
# config's ``blocking = 0``; a blocking init would then wait, holding the event loop, for a
# peer that is only asked to join after it returns.
COMM_BLOCKING_ENV = "NCCL_COMM_BLOCKING"

_POLL_MIN_S, _POLL_MAX_S = 20e-6, 2e-3


def version_code(v: tuple[int, int, int]) -> int:
    """NCCL_VERSION(X, Y, Z) of nccl.h."""
    x, y, z = v
    return x * 1000 + y * 100 + z if (x <= 2 and y <= 8) else x * 10000 + y * 100 + z


def version_tuple(code: int) -> tuple[int, int, int]:
    """The inverse of :func:`version_code` (the value ncclGetVersion reports)."""
    if code < 2900:  # 2.0 .. 2.8 used the short encoding
        return code // 1000, code % 1000 // 100, code % 100
    return code // 10000, code % 10000 // 100, code % 100


class NcclResult(enum.IntEnum):
    """ncclResult_t."""

    SUCCESS = 0
    UNHANDLED_CUDA_ERROR = 1
    SYSTEM_ERROR = 2
    INTERNAL_ERROR = 3
    INVALID_ARGUMENT = 4
    INVALID_USAGE = 5
    REMOTE_ERROR = 6
    IN_PROGRESS = 7
    TIMEOUT = 8


class NcclDataType(enum.IntEnum):
    """The one ncclDataType_t used here: bytes move as uint8, whatever the tensor's dtype."""

    UINT8 = 1


# Results that say the other side or the link failed rather than this call.
REMOTE_FAILURES = frozenset({NcclResult.REMOTE_ERROR, NcclResult.SYSTEM_ERROR})


class NcclError(Exception):
    """A failed NCCL call (the ``__cause__`` of the TransportError that reports it).

    Attributes:
        op: what was being done ("ncclSend of 4096 bytes to rank 1 on comm ...").
        code: the ncclResult_t.
    """

    def __init__(self, op: str, code: int, detail: str = "") -> None:
        try:
            name = NcclResult(code).name
        except ValueError:
            name = f"result {code}"
        super().__init__(f"{op}: {name}" + (f": {detail}" if detail else ""))
        self.op = op
        self.code = code

    @property
    def remote(self) -> bool:
        """True when NCCL blames the peer or the network (the peer is probably gone)."""
        return self.code in REMOTE_FAILURES


# -- ctypes layouts (from nccl.h) --------------------------------------------------------------


class UniqueId(ctypes.Structure):
    """``ncclUniqueId``."""

    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


class _ConfigV21400(ctypes.Structure):
    """``ncclConfig_t`` as of NCCL 2.14: the prefix every later version starts with."""

    VERSION: ClassVar[tuple[int, int, int]] = (2, 14, 0)
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
    ]


class _ConfigV22700(ctypes.Structure):
    """``ncclConfig_t`` up to ``commName`` (NCCL 2.27 and later start with these fields)."""

    VERSION: ClassVar[tuple[int, int, int]] = (2, 27, 0)
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
        ("splitShare", ctypes.c_int),
        ("trafficClass", ctypes.c_int),
        ("commName", ctypes.c_char_p),
    ]


def config_layout(version: tuple[int, int, int]) -> type[_ConfigV21400 | _ConfigV22700]:
    """The config prefix this library version reads (and that :func:`make_config` fills)."""
    return _ConfigV22700 if version >= _ConfigV22700.VERSION else _ConfigV21400


def make_config(version: tuple[int, int, int], name: bytes | None) -> ctypes.Structure:
    """A non-blocking config, as NCCL_CONFIG_INITIALIZER with ``blocking = 0``.

    NCCL keeps the ``commName`` pointer for the communicator's lifetime: keep the returned
    struct (it references ``name``) alive as long as the communicator.
    """
    layout = config_layout(version)
    cfg = layout()
    cfg.size = ctypes.sizeof(layout)
    cfg.magic = NCCL_API_MAGIC
    cfg.version = version_code(layout.VERSION)
    for field in layout._fields_[3:]:
        setattr(cfg, field[0], None if field[1] is ctypes.c_char_p else NCCL_CONFIG_UNDEF_INT)
    cfg.blocking = 0
    if layout is _ConfigV22700:
        cfg.commName = name
    return cfg


# -- the library -------------------------------------------------------------------------------

_c_int_p = ctypes.POINTER(ctypes.c_int)
_vp = ctypes.c_void_p
# The calls this package makes; a library lacking one is not usable.
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "ncclGetVersion": (ctypes.c_int, [_c_int_p]),
    "ncclGetUniqueId": (ctypes.c_int, [ctypes.POINTER(UniqueId)]),
    "ncclCommInitRankConfig": (ctypes.c_int, [ctypes.POINTER(_vp), ctypes.c_int, UniqueId, ctypes.c_int, _vp]),
    "ncclCommGetAsyncError": (ctypes.c_int, [_vp, _c_int_p]),
    "ncclCommAbort": (ctypes.c_int, [_vp]),
    "ncclSend": (ctypes.c_int, [_vp, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _vp, _vp]),
    "ncclRecv": (ctypes.c_int, [_vp, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _vp, _vp]),
    "ncclGroupStart": (ctypes.c_int, []),
    "ncclGroupEnd": (ctypes.c_int, []),
    "ncclGetErrorString": (ctypes.c_char_p, [ctypes.c_int]),
    "ncclGetLastError": (ctypes.c_char_p, [_vp]),
}


@dataclass(frozen=True)
class Library:
    """A loaded libnccl.

    Attributes:
        path: the file it was loaded from.
        version: (major, minor, patch) as ncclGetVersion reports it.
        how: "already loaded", "wheel", "system" or "$TRANSPORT_NCCL_LIB".
        fns: the ctypes.CDLL, with argtypes/restype set for the calls in ``_SIGNATURES``.
    """

    path: str
    version: tuple[int, int, int]
    how: str
    fns: Any

    @property
    def version_string(self) -> str:
        return ".".join(str(x) for x in self.version)

    @property
    def has_windows(self) -> bool:
        """NCCL >= 2.29 with every window/one-sided symbol present (a symbol probe only)."""
        return self.version >= WINDOW_VERSION and all(hasattr(self.fns, s) for s in WINDOW_SYMBOLS)

    def error_string(self, code: int) -> str:
        s = self.fns.ncclGetErrorString(int(code))
        return s.decode(errors="replace") if s else f"ncclResult {code}"

    def last_error(self, comm: int | None = None) -> str:
        s = self.fns.ncclGetLastError(comm)
        return s.decode(errors="replace").strip() if s else ""

    def check(self, op: str, rc: int, comm: int | None = None) -> NcclResult:
        """SUCCESS or IN_PROGRESS.

        Raises:
            NcclError: any other result, with NCCL's last error message.
        """
        if rc in (NcclResult.SUCCESS, NcclResult.IN_PROGRESS):
            return NcclResult(rc)
        detail = self.last_error(comm) or self.error_string(rc)
        raise NcclError(op, rc, detail)

    def unique_id(self) -> bytes:
        """A fresh ncclUniqueId (128 bytes). Needs no GPU; starts NCCL's bootstrap root listener
        in this process, which the rank-0 communicator of this id then uses.

        Raises:
            NcclError: NCCL could not make one.
        """
        uid = UniqueId()
        self.check("ncclGetUniqueId", self.fns.ncclGetUniqueId(ctypes.byref(uid)))
        return bytes(uid)  # the raw 128 bytes (``uid.internal`` would stop at the first NUL)


def _bind(lib: ctypes.CDLL) -> None:
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)  # AttributeError: not an NCCL library
        fn.restype, fn.argtypes = restype, argtypes


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", _vp), ("dli_sname", ctypes.c_char_p), ("dli_saddr", _vp)]


def _path_of(lib: ctypes.CDLL, fallback: str) -> str:
    """The file a loaded library came from (dladdr on one of its symbols)."""
    try:
        info = _DlInfo()
        if ctypes.CDLL(None).dladdr(ctypes.cast(lib.ncclGetVersion, _vp), ctypes.byref(info)) and info.dli_fname:
            return str(os.path.realpath(info.dli_fname.decode()))
    except (OSError, AttributeError):
        pass
    return fallback


def wheel_paths() -> list[str]:
    """``libnccl.so.2`` of installed ``nvidia-nccl-cu*`` wheels (``nvidia/*/lib``), found without
    importing anything."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    out: list[str] = []
    for root in roots:
        found = sorted(glob.glob(os.path.join(root, "*", "lib", LIB_NAME)))
        found.sort(key=lambda p: os.path.basename(os.path.dirname(os.path.dirname(p))) != "nccl")  # nvidia/nccl first
        out += [p for p in found if p not in out]
    return out


def _candidates() -> list[tuple[str, str]]:
    explicit = os.environ.get(LIB_ENV)
    if explicit:  # an explicit choice is not second-guessed: no silent fallback
        return [(os.path.join(explicit, LIB_NAME) if os.path.isdir(explicit) else explicit, f"${LIB_ENV}")]
    return [(p, "wheel") for p in wheel_paths()] + [(LIB_NAME, "system")]


def _open(path: str, how: str) -> Library:
    lib = ctypes.CDLL(path)
    try:
        _bind(lib)
    except AttributeError as exc:
        raise OSError(f"{path} is not a usable NCCL library: {exc}") from None
    v = ctypes.c_int()
    rc = lib.ncclGetVersion(ctypes.byref(v))
    if rc != NcclResult.SUCCESS:
        raise OSError(f"ncclGetVersion failed in {path} (result {rc})")
    return Library(_path_of(lib, path), version_tuple(v.value), how, lib)


@functools.cache
def library() -> tuple[Library | None, str | None]:
    """``(Library, None)``, or ``(None, why not)``. Loads once per process."""
    errors: list[str] = []
    if not os.environ.get(LIB_ENV):
        try:
            resident = ctypes.CDLL(LIB_NAME, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        except OSError:
            resident = None
        if resident is not None:
            try:
                lib = _open(_path_of(resident, LIB_NAME), "already loaded")
            except OSError as exc:
                errors.append(str(exc))
            else:
                return _checked(lib)
    for path, how in _candidates():
        try:
            lib = _open(path, how)
        except OSError as exc:
            errors.append(str(exc))
            continue
        return _checked(lib)
    hint = f"{INSTALL_HINT}, or set ${LIB_ENV} to a {LIB_NAME}"
    return None, f"{LIB_NAME} could not be loaded ({'; '.join(errors) or 'no candidate'}); {hint}"


def _checked(lib: Library) -> tuple[Library | None, str | None]:
    if lib.version < MIN_VERSION:
        need = ".".join(map(str, MIN_VERSION))
        return None, (f"NCCL {lib.version_string} at {lib.path} is older than {need} (no non-blocking communicators); "
                      f"{INSTALL_HINT}")
    log.debug("nccl: using NCCL %s from %s (%s)", lib.version_string, lib.path, lib.how)
    return lib, None


def multi_rank_gpu(lib: Library) -> bool:
    """True when this process lets NCCL place two ranks on one GPU (NCCL >= 2.30 with
    ``NCCL_MULTI_RANK_GPU_ENABLE=1`` in the environment; the peer needs it too)."""
    return lib.version >= MULTI_RANK_GPU_VERSION and os.environ.get(MULTI_RANK_GPU_ENV, "").strip() == "1"


def cuda_driver_error() -> str | None:
    """None when ``libcuda.so.1`` loads in this process, else the loader's message."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return str(exc)
    return None


def forced_blocking() -> bool:
    """True when NCCL will make communicators blocking whatever their config says. Read from the
    C environment, where NCCL also puts the settings of its configuration files once it ran."""
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    libc.getenv.argtypes = [ctypes.c_char_p]
    value = libc.getenv(COMM_BLOCKING_ENV.encode())
    try:
        return value is not None and int(value.decode(errors="replace").strip()) == 1
    except ValueError:
        return False


def on_device(device: int) -> contextlib.AbstractContextManager[Any]:
    """Makes ``device`` current for NCCL calls that use the current device (init, groups). A torch
    without CUDA cannot select one; NCCL then reports for itself that there is no GPU."""
    import torch

    return torch.cuda.device(device) if torch.cuda.is_available() else contextlib.nullcontext()


# -- communicators -----------------------------------------------------------------------------


class Communicator:
    """One non-blocking NCCL communicator of ``nranks`` ranks on CUDA device ``device``.

    Every method is called from one thread (the event loop's): NCCL requires that no other
    thread uses a communicator while it is aborted. Enqueueing methods return SUCCESS or
    IN_PROGRESS; after IN_PROGRESS, :meth:`settle` (or :meth:`settled`) before recording
    events or issuing dependent work on the stream.
    """

    def __init__(self, lib: Library, handle: int, nranks: int, rank: int, device: int, name: str,
                 config: Any = None) -> None:
        self.lib = lib
        self._config = config  # NCCL keeps pointers into it (commName) while the comm lives
        self._handle: int | None = handle
        self.nranks = nranks
        self.rank = rank
        self.device = device
        self.name = name
        self._aborted = False

    @classmethod
    def start(cls, lib: Library, uid: bytes, nranks: int, rank: int, device: int, name: str) -> Communicator:
        """Starts ``ncclCommInitRankConfig`` (non-blocking) on ``device``; :meth:`settle` finishes it.

        Raises:
            NcclError: NCCL refused at once (e.g. no usable GPU or driver), the unique id is not
                128 bytes, or ``NCCL_COMM_BLOCKING=1`` would make the communicator blocking.
        """
        op = f"ncclCommInitRankConfig of comm {name}"
        if len(uid) != UNIQUE_ID_BYTES:
            raise NcclError(op, NcclResult.INVALID_ARGUMENT, f"unique id of {len(uid)} bytes, not {UNIQUE_ID_BYTES}")
        if forced_blocking():
            raise NcclError(op, NcclResult.INVALID_USAGE, f"{COMM_BLOCKING_ENV}=1 makes every communicator blocking; "
                                                          "transport needs non-blocking ones (unset it)")
        uid_s = UniqueId()
        ctypes.memmove(ctypes.byref(uid_s), uid, UNIQUE_ID_BYTES)
        cfg = make_config(lib.version, name.encode()[:255])
        handle = _vp()
        op = f"ncclCommInitRankConfig(rank {rank} of {nranks}, cuda:{device}) of comm {name}"
        with on_device(device):
            rc = lib.fns.ncclCommInitRankConfig(ctypes.byref(handle), nranks, uid_s, rank, ctypes.byref(cfg))
        if rc not in (NcclResult.SUCCESS, NcclResult.IN_PROGRESS):
            detail = lib.last_error(handle.value) or lib.error_string(rc)
            if handle.value:
                lib.fns.ncclCommAbort(handle.value)
            raise NcclError(op, rc, detail)
        if not handle.value:
            raise NcclError(op, NcclResult.INTERNAL_ERROR, "NCCL returned no communicator")
        return cls(lib, handle.value, nranks, rank, device, name, cfg)

    @property
    def aborted(self) -> bool:
        return self._aborted

    @property
    def handle(self) -> int:
        """The ncclComm_t.

        Raises:
            NcclError: the communicator was aborted.
        """
        if self._handle is None:
            raise NcclError(f"comm {self.name}", NcclResult.INVALID_USAGE, "the communicator was aborted")
        return self._handle

    def _what(self, op: str) -> str:
        return f"{op} on comm {self.name} (rank {self.rank} of {self.nranks}, cuda:{self.device})"

    def state(self) -> NcclResult:
        """SUCCESS (ready) or IN_PROGRESS (busy).

        Raises:
            NcclError: the communicator failed or was aborted.
        """
        s = ctypes.c_int()
        rc = self.lib.fns.ncclCommGetAsyncError(self.handle, ctypes.byref(s))
        self.lib.check(self._what("ncclCommGetAsyncError"), rc, self._handle)
        if s.value in (NcclResult.SUCCESS, NcclResult.IN_PROGRESS):
            return NcclResult(s.value)
        detail = self.lib.last_error(self._handle) or self.lib.error_string(s.value)
        raise NcclError(self._what("communicator failed"), s.value, detail)

    async def settle(self, op: str) -> None:
        """Waits (polling, with backoff) until the communicator is no longer in progress.

        Raises:
            NcclError: the communicator failed (or was aborted meanwhile).

        Cancellation: only stops waiting; abort the communicator if it must not finish.
        """
        delay = 0.0
        while True:
            if self._aborted:
                raise NcclError(self._what(op), NcclResult.INVALID_USAGE, "the communicator was aborted")
            try:
                if self.state() == NcclResult.SUCCESS:
                    return
            except NcclError as exc:
                raise NcclError(self._what(op), exc.code, str(exc)) from exc
            await anyio.sleep(delay)
            delay = min(max(2 * delay, _POLL_MIN_S), _POLL_MAX_S)

    async def settled(self, result: NcclResult, op: str) -> None:
        """Returns once an enqueue that answered ``result`` is done (:meth:`settle` after
        IN_PROGRESS, e.g. NCCL connecting a channel at first use).

        Raises:
            NcclError: as :meth:`settle`. Cancellation: as :meth:`settle`.
        """
        if result == NcclResult.IN_PROGRESS:
            await self.settle(op)

    def _enqueue(self, op: str, call: Callable[[], int]) -> NcclResult:
        with on_device(self.device):
            return self.lib.check(self._what(op), call(), self._handle)

    def send(self, ptr: int, nbytes: int, peer: int, stream: int) -> NcclResult:
        """Enqueues ``ncclSend`` of ``nbytes`` at device address ``ptr`` to rank ``peer`` on
        ``stream`` (a CUstream handle).

        Raises:
            NcclError: NCCL refused, or the communicator was aborted.
        """
        return self._enqueue(f"ncclSend of {nbytes} bytes to rank {peer}",
                             lambda: self.lib.fns.ncclSend(ptr, nbytes, NcclDataType.UINT8, peer, self.handle, stream))

    def recv(self, ptr: int, nbytes: int, peer: int, stream: int) -> NcclResult:
        """Enqueues ``ncclRecv`` of ``nbytes`` into device address ``ptr`` from rank ``peer``.

        Raises:
            NcclError: NCCL refused, or the communicator was aborted.
        """
        return self._enqueue(f"ncclRecv of {nbytes} bytes from rank {peer}",
                             lambda: self.lib.fns.ncclRecv(ptr, nbytes, NcclDataType.UINT8, peer, self.handle, stream))

    def grouped(self, what: str, calls: Sequence[Callable[[], NcclResult]]) -> NcclResult:
        """Runs ``calls`` (enqueueing methods of this communicator) between ncclGroupStart and
        ncclGroupEnd, so that they progress together (e.g. a send to self and its receive).

        Raises:
            NcclError: a call or the group failed (the group is closed either way).
        """
        fns = self.lib.fns
        with on_device(self.device):
            self._enqueue(f"ncclGroupStart for {what}", fns.ncclGroupStart)
            try:
                for call in calls:
                    call()
            except BaseException:
                fns.ncclGroupEnd()  # closes the group; its error is the one already raised
                raise
            return self._enqueue(f"ncclGroupEnd for {what}", fns.ncclGroupEnd)

    def abort(self) -> None:
        """``ncclCommAbort``: stops every operation of this communicator on the device, frees it.
        Idempotent. Blocks until NCCL has let go of the buffers its operations used."""
        if self._aborted:
            return
        self._aborted = True
        handle, self._handle = self._handle, None
        if handle:
            rc = self.lib.fns.ncclCommAbort(handle)
            if rc != NcclResult.SUCCESS:
                log.warning("nccl: ncclCommAbort of comm %s returned %s", self.name, self.lib.error_string(rc))
