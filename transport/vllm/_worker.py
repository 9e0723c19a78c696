"""The worker side: ``TransportWeightTransferEngine``, one per vLLM worker process.

Each worker (every TP rank of every engine) is one Transport endpoint and one rank of a
:class:`~transport.weights.MeshSubscriber` replica named after its engine. Trainer ranks write
versions into its slots one-sidedly while the engine keeps generating; nothing here runs then.
A version is loaded only inside vLLM's weight-update calls, which the engine runs between
forward passes:

* ``update_weights({"version": v})``: TP rank 0 commits the newest version every rank of the
  engine holds in full (waiting, bounded, until that is ``v``) and tells the other ranks which
  one over vLLM's TP group. If rank 0 cannot commit, every rank raises and none loads: the
  engine keeps serving its previous version (and vLLM ends the update cleanly).
* ``finish_weight_update``: every rank loads exactly the agreed version from its slot through
  the model's own loading path (``load_weights`` under vLLM's layerwise reload, so prepacked and
  quantized layers are rebuilt correctly), for the decoder layers in which a tensor changed
  since the version it loaded before (and the rest of the model, as one group), found by a
  checksum of each tensor in the slot: a layer is reloaded whole or not at all, as the
  layerwise reload needs. A version that came as deltas is applied into the slot first
  (checked; refused deltas are fetched whole from the trainer's snapshots).
* joining (``init_weight_transfer_engine``, or at start-up when ``TRANSPORT_VLLM_INIT`` is
  set): the same, after every rank pulled the trainer's current version from its snapshots.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from .._errors import (
    DeltaRefusedError,
    EngineSyncError,
    LayoutMismatchError,
    MeshLayoutError,
    TransferTimeoutError,
    TransportError,
)
from ..plan import GeneratorRank, TrainerLayout
from ..weights import MeshSubscriber, read_trainer_layout
from ..weights._codec.checksum import bytes_checksum
from ..weights._control import memory_barrier
from ._info import TransportInitInfo, TransportUpdateInfo, init_info_from_env
from ._layouts import checkpoint_names, full_shaped, tp_slices, whole_tensors
from ._loop import LoopThread

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

log = logging.getLogger(__name__)


_NOT_YET = object()  # no update_weights in this update yet
# Every worker rank's last load, in a read-only region of its Transport (what
# TransportTrainerEngine.load_stats reads): a seqlock generation (odd while written), then
# the version + 1, groups reloaded, trainer ranks whose deltas it applied, 2-byte units they
# wrote, microseconds agreeing and loading, and loads so far.
LOAD_KEY = "vllm.load"
LOAD_FIELDS = ("version", "groups", "delta_sources", "delta_units", "wait_us", "load_us", "loads")
LOAD_WORDS = 1 + len(LOAD_FIELDS)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def load_group(name: str) -> str:
    """The group a checkpoint tensor is reloaded with: its decoder layer (``layers.N``), or
    ``"rest"`` (embeddings, final norm, head: tied tensors stay together). Every vLLM layer
    module reads tensors of one group only, so loading a whole group never leaves a module
    half loaded."""
    m = _LAYER.search(name)
    return f"layers.{m.group(1)}" if m else "rest"


def tensor_sums(views: dict[str, torch.Tensor]) -> dict[str, int | None]:
    """A checksum of each view's bytes (None: an odd byte size, taken as changed always)."""
    return {name: bytes_checksum(v) for name, v in views.items()}


class _QuietUnloaded(logging.Filter):
    """Drops vLLM's warning for a layer left out of a reload on purpose (its tensors are put
    back as they were, which is what an unchanged layer needs)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()


def worker_name(engine: str, rank: int, dp_rank: int | None) -> str:
    """The store name of TP rank ``rank`` of ``engine`` (data-parallel rank ``dp_rank``)."""
    return f"{engine}-tp{rank}" if dp_rank is None else f"{engine}-dp{dp_rank}-tp{rank}"


def replica_name(engine: str, dp_rank: int | None) -> str:
    return engine if dp_rank is None else f"{engine}-dp{dp_rank}"


class _Session:
    """One worker's membership of a stream: its Transport (on a loop thread) and subscriber."""

    def __init__(self, info: TransportInitInfo, *, rank: int, size: int, dp_rank: int | None,
                 hf_config: Any = None) -> None:
        self.info, self.rank, self.size = info, rank, size
        self.name = worker_name(info.engine, rank, dp_rank)
        self.replica = replica_name(info.engine, dp_rank)
        self.loop = LoopThread(self.name, store=info.store, backends=info.backends, timeout=info.timeout,
                               token=info.token)
        try:
            read = functools.partial(read_trainer_layout, self.loop.t, info.stream, timeout=info.timeout)
            trainer: TrainerLayout = self.loop.call(read, timeout=info.timeout + 1)
            self.trainer = trainer
            self.layout = whole_tensors(trainer)
            if info.receive == "slices" and size > 1:
                try:
                    self.layout = tp_slices(trainer, hf_config, tp=size, rank=rank)
                except MeshLayoutError as exc:
                    log.warning("%s: receiving whole tensors: %s", self.name, exc)
            self.sub = MeshSubscriber(self.loop.t, info.stream, replica=self.replica, rank=rank, size=size,
                                      layout=self.layout, timeout=info.timeout, allocate=False, delta=info.delta)
            self.loop.call(self.sub.start)
            make = functools.partial(self.loop.t.empty, LOAD_KEY, LOAD_WORDS, torch.int64, writable=False)
            self.stats: torch.Tensor = self.loop.call(make)
        except BaseException:
            self.loop.close()
            raise
        self.nbytes = sum(t.nbytes for t in self.layout.tensors)
        self.loaded_sums: dict[str, int | None] = {}  # tensor -> checksum of what the model loaded last
        self._stopping = threading.Event()
        self._tasks: list[Any] = []

    def background(self, step: Any, *args: Any, every: float = 0.02) -> None:
        """Runs ``await step(*args)`` on the loop every ``every`` seconds until ``close`` (errors
        are logged once per kind and retried: a rank or the trainer may be away for a while)."""

        async def loop() -> None:
            import anyio

            seen: set[str] = set()
            while not self._stopping.is_set():
                try:
                    await step(*args)
                except TransportError as exc:
                    if type(exc).__name__ not in seen:
                        seen.add(type(exc).__name__)
                        log.info("%s: background %s: %s", self.name, getattr(step, "__name__", step), exc)
                await anyio.sleep(every)

        self._tasks.append(self.loop.portal.start_task_soon(loop))

    def close(self) -> None:
        self._stopping.set()
        for f in self._tasks:
            try:
                f.result(timeout=self.info.timeout)
            except Exception:  # closing: a task that failed has nothing left to do
                log.debug("%s: background task ended with an error", self.name, exc_info=True)
        try:
            self.loop.call(self.sub.close)
        finally:
            self.loop.close()


class TransportWeightTransferEngine(WeightTransferEngine[TransportInitInfo, TransportUpdateInfo]):
    """vLLM's worker-side engine for ``WeightTransferConfig(backend="transport")``.

    vLLM builds one in every worker process after the model is loaded. With
    ``TRANSPORT_VLLM_INIT`` in the environment (JSON of :class:`TransportInitInfo`) it joins the
    stream at once and loads the trainer's current version; else it joins at
    ``init_weight_transfer_engine``. Every call is bounded by the init info's ``timeout``.

    Loaded versions: ``self.loaded`` (None before the first), vLLM's ``weight_version`` (set by
    the trainer's ``finish_weight_update``), and a ``vllm.load`` event in the flight record.

    Raises (from vLLM's weight-update calls, on every rank alike):
        EngineSyncError: a version could not be loaded (the previous one stays).
        TransferTimeoutError: joining (the trainer layout) or committing took too long.
        RuntimeError: an update call before the engine joined a stream.
    """

    init_info_cls = TransportInitInfo
    update_info_cls = TransportUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        if self.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("the transport weight-transfer backend does not support pipeline parallelism yet")
        from vllm.distributed import get_tensor_model_parallel_rank

        self.rank = get_tensor_model_parallel_rank()
        self.size = self.parallel_config.tensor_parallel_size
        dp = self.parallel_config.data_parallel_size
        self.dp_rank = self.parallel_config.data_parallel_rank if dp > 1 else None
        self.session: _Session | None = None
        self.loaded: int | None = None
        self.history: list[dict[str, Any]] = []  # one entry per load: version, wait_s, load_s, at
        self._agreed: int | object | None = _NOT_YET  # what update_weights agreed on (None: nothing new)
        self._hook: Any = None  # auto_load's forward pre-hook
        self._wait_s = 0.0
        info = init_info_from_env()
        if info is not None:
            self.init_transfer_engine(info)

    # -- vLLM's calls ----------------------------------------------------------------------

    def init_transfer_engine(self, init_info: TransportInitInfo) -> None:
        """Joins the stream (idempotent for the same init info; another one rejoins)."""
        if self.session is not None:
            if self.session.info == init_info:
                return
            self.shutdown()
        session = _Session(init_info, rank=self.rank, size=self.size, dp_rank=self.dp_rank,
                           hf_config=self.model_config.hf_config)
        try:
            self._check_names(session)
        except BaseException:
            session.close()
            raise
        self.session = session
        if init_info.auto_load:
            self._start_auto_load(session)
        log.info("%s: joined stream %r of %s (%d tensors, %.1f MB per slot)", self.session.name,
                 init_info.stream, init_info.store, len(self.session.layout.tensors), self.session.nbytes / 1e6)
        if init_info.pull_on_join:
            self._join_current()

    def _check_names(self, s: _Session) -> None:
        """Refuses a stream whose tensors the model cannot load, before any version is loaded
        (a load that failed midway would leave layers half rebuilt)."""
        want = checkpoint_names(self.model)
        if want is None:
            log.warning("%s: %s declares no packed_modules_mapping: tensor names are not checked before loading",
                        s.name, type(self.model).__name__)
            return
        got = {t.name for t in s.trainer.tensors if t.scale_of is None}
        unknown, missing = sorted(got - want), sorted(want - got)
        if unknown or missing:
            raise LayoutMismatchError(
                f"{s.name}: stream {s.info.stream!r} does not match {type(self.model).__name__}: "
                f"{len(unknown)} tensors the model does not have {unknown[:5]}, {len(missing)} it needs that are "
                f"not sent {missing[:5]}")

    def start_weight_update(self) -> None:
        self._need()
        self._agreed = _NOT_YET

    def receive_weights(self, update_info: TransportUpdateInfo) -> None:
        """Agrees on the version to load: TP rank 0 commits it (waiting, bounded, until the
        requested version is complete at every rank) and tells the others. No bytes move here
        (they are in the slots already). Raising here (not in ``finish_weight_update``) lets
        vLLM end the update cleanly: the engine keeps its version and takes the next update."""
        s = self._need()
        wait = s.info.timeout if update_info.timeout is None else update_info.timeout
        self._agreed = self._agree_version(s, update_info.version, wait)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))

    def finish_weight_update(self) -> None:
        """Loads the agreed version (after ``update_weights``) at every rank; without an
        ``update_weights`` first, agrees on the newest committed one first."""
        s = self._need()
        v, self._agreed = self._agreed, _NOT_YET
        if v is _NOT_YET:
            v = self._agree_version(s, None, s.info.timeout)
        if isinstance(v, int):
            self._load_version(s, v)

    def shutdown(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.session is not None:
            s, self.session = self.session, None
            s.close()

    # -- auto_load -------------------------------------------------------------------------

    def _start_auto_load(self, s: _Session) -> None:
        if self.rank == 0:
            s.background(self._keep_committing, s)
        else:
            s.background(self._keep_catching_up, s)
        self._hook = self.model.register_forward_pre_hook(self._before_forward)

    @staticmethod
    async def _keep_committing(s: _Session) -> None:
        await s.sub.catch_up(after=1.0)
        await s.sub.commit()

    @staticmethod
    async def _keep_catching_up(s: _Session) -> None:
        await s.sub.catch_up(after=1.0)

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        """Before every forward pass: load the committed version if every rank sees the same
        one and it is new (else nothing: the ranks agree at a later pass)."""
        s = self.session
        if s is None:
            return
        c = s.sub.committed()
        v = -1 if c is None or c == self.loaded else c
        low, neg_high = self._tp_min(v, -v)
        if low != -neg_high:
            return
        if v >= 0:
            self._wait_s = 0.0
            self._load_version(s, v)

    # -- loading ---------------------------------------------------------------------------

    def _need(self) -> _Session:
        if self.session is None:
            raise RuntimeError("the transport weight-transfer engine has not joined a stream: call "
                               "init_weight_transfer_engine first (or set TRANSPORT_VLLM_INIT)")
        return self.session

    def _join_current(self) -> None:
        s = self._need()
        err: str | None = None
        try:
            s.loop.call(s.sub.pull, timeout=s.info.timeout + 1)
        except Exception as exc:  # noqa: BLE001 - every TP rank must reach the agreement below
            err = f"{type(exc).__name__}: {exc}"  # e.g. no version yet, or the trainer is gone
        if self._agree(err is None) and err is None:
            v = self._agree_version(s, None, s.info.timeout)
            if v is not None:
                self._load_version(s, v)
        else:
            log.info("%s: nothing to load at join: %s", s.name, err or "another rank pulled nothing")

    def _tp_min(self, *values: int) -> list[int]:
        """The minimum of each of ``values`` over the engine's TP ranks (one all-reduce over
        vLLM's TP group; every rank must call it)."""
        if self.size == 1:
            return list(values)
        from vllm.distributed import get_tp_group

        t = torch.tensor(values, dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=get_tp_group().cpu_group)
        return [int(x) for x in t]

    def _agree(self, ok: bool) -> bool:
        """Whether every TP rank says ``ok``."""
        return self._tp_min(int(ok))[0] == 1

    def _decide(self, s: _Session, wanted: int | None, wait: float) -> tuple[int | None, str | None]:
        """TP rank 0: commit (waiting for ``wanted`` when given); then every rank learns the
        outcome from rank 0: ``(version, None)`` or ``(None, why)``."""
        outcome: tuple[int | None, str | None]
        if self.rank == 0:
            try:
                outcome = (s.loop.call(self._commit, s, wanted, wait, timeout=wait + 1), None)
            except Exception as exc:  # noqa: BLE001 - the other ranks wait for rank 0's outcome: always send one
                outcome = (None, f"{type(exc).__name__}: {exc}")
        else:
            outcome = (None, None)
        if self.size > 1:
            from vllm.distributed import get_tp_group

            outcome = get_tp_group().broadcast_object(outcome if self.rank == 0 else None, src=0)
        return outcome

    @staticmethod
    async def _commit(s: _Session, wanted: int | None, wait: float) -> int | None:
        import anyio

        deadline = time.monotonic() + wait
        v: int | None = None

        def late(why: str) -> EngineSyncError:
            # The caller's wait is what ran out, whichever step the deadline caught.
            return EngineSyncError(f"replica {s.replica}: version {wanted} is not complete at every rank within "
                                   f"{wait:g}s (committed: {v}{why})")

        while True:
            try:
                v = await s.sub.commit(timeout=max(deadline - time.monotonic(), 0.001))
            except TransferTimeoutError as exc:
                if wanted is None:
                    raise
                raise late(f"; {exc}") from exc
            if wanted is None or (v is not None and v >= wanted):
                return v
            if time.monotonic() >= deadline:
                raise late("")
            try:
                await s.sub.catch_up(after=1.0, timeout=max(deadline - time.monotonic(), 0.001))
            except TransferTimeoutError as exc:
                raise late(f"; {exc}") from exc
            await anyio.sleep(0.002)

    def _agree_version(self, s: _Session, wanted: int | None, wait: float) -> int | None:
        """The version every rank of this engine loads next (None: nothing new), committed at
        every rank; raises EngineSyncError on every rank alike when there is none in time."""
        t0 = time.perf_counter()
        v, why = self._decide(s, wanted, wait)
        if why is not None:
            raise EngineSyncError(f"{s.name}: no version loaded ({why}); serving version {self.loaded}")
        if v is None or v == self.loaded:
            return None
        if self.rank != 0:
            s.loop.call(s.sub.wait_committed, v, timeout=wait)
        self._wait_s = time.perf_counter() - t0
        return v

    def _load_version(self, s: _Session, v: int) -> None:
        t1 = time.perf_counter()
        try:
            groups = self._load_from_slot(s, v)
        except DeltaRefusedError as exc:  # nothing was written: fetch the version whole, then load it
            log.warning("%s: %s; pulling version %d whole", s.name, exc, v)
            s.loop.call(functools.partial(s.sub.pull, version=v), timeout=s.info.timeout + 1)
            groups = self._load_from_slot(s, v)
        t2 = time.perf_counter()
        self.loaded = v
        sources, units = s.sub.last_delta
        self.history.append({"version": v, "wait_s": self._wait_s, "load_s": t2 - t1, "at": time.time(),
                             "pid": os.getpid(), "groups": groups, "delta_sources": sources, "delta_units": units})
        st = s.stats
        st[0] += 1  # odd: being written
        memory_barrier()
        st[1:] = torch.tensor([v + 1, groups, sources, units, int(self._wait_s * 1e6), int((t2 - t1) * 1e6),
                               int(st[LOAD_WORDS - 1]) + 1])
        memory_barrier()
        st[0] += 1
        s.loop.t._flight.event("vllm.load", s.replica, f"version {v} loaded in {t2 - t1:.3f}s ({groups} groups)")
        log.info("%s: loaded version %d (agreed in %.3fs, loaded in %.3fs; %d groups)", s.name, v, self._wait_s,
                 t2 - t1, groups)

    def _load_from_slot(self, s: _Session, v: int) -> int:
        """Loads the groups of version ``v`` that changed since the last load; returns how many."""
        with s.sub.reading(v, again=True) as got:
            if got is None or got[1] is None:  # cannot happen: v is committed here
                raise EngineSyncError(f"{s.name}: version {v} is not readable from its slot")
            views = got[1]
            sums = tensor_sums(views)
            changed = {load_group(n) for n, c in sums.items() if c is None or s.loaded_sums.get(n) != c}
            if changed:
                keep = GeneratorRank.of([lt for lt in s.layout.tensors if load_group(lt.name) in changed])
                try:
                    self._load(full_shaped(s.trainer, keep, views))
                except BaseException:
                    s.loaded_sums = {}  # the model is in no known state: the next load reloads every group
                    raise
        s.loaded_sums = sums  # only once the load went through
        return len(changed)



    def _load(self, tensors: Any) -> None:
        """Loads Hugging Face tensors through the model's own path (vLLM's layerwise reload:
        prepacked CPU layers and quantized layers are rebuilt from them)."""
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        with torch.no_grad(), disable_mtp_completeness_check():
            self.model.load_weights(tensors)  # type: ignore[operator]
        quiet = _QuietUnloaded()
        reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        reload_log.addFilter(quiet)
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        finally:
            reload_log.removeFilter(quiet)
