"""The trainer side: ``TransportTrainerEngine``, vLLM's ``TrainerWeightTransferEngine`` for the
``transport`` backend.

Two ways to feed engines, chosen by the source given to ``trainer_init``:

* **Whole tensors** (any ``WeightSource``, e.g. vLLM's ``ModuleSource``): every trainer rank
  iterates the source as vLLM's contract says (an FSDP source gathers there); rank 0 publishes
  the tensors it yields.
* **Shards** (:class:`ShardSource` over an FSDP2/DTensor model): every trainer rank publishes
  its own shards; each engine rank pulls nothing and waits for nothing: the trainer ranks write
  their pieces straight into its slots (the mesh planner decides who sends what). No
  ``full_tensor()`` gather, no rank-0 bottleneck.

Either way each version goes to every engine one-sidedly and independently
(:class:`~transport.weights.MeshPublisher`); then rank 0 drives each engine's update round
(``start_weight_update`` / ``update_weights({"version": v})`` / ``finish_weight_update``)
through its client, every engine in a thread of its own and bounded by ``timeout``.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from .._errors import EngineSyncError
from ..plan import full_box, trainer_layout_from_state_dict
from ..weights import MeshPublisher, MeshPublishReport
from ..weights._polling import Pending, even, poll, seqlock_read
from ._clients import EngineDriver, EngineResult, EngineStatus, update_round
from ._info import BACKEND, TransportInitInfo
from ._loop import LoopThread
from ._sources import ShardSource, check_agrees, check_whole_source, full_tensors, param_metas
from ._worker import LOAD_FIELDS, LOAD_KEY, LOAD_WORDS, worker_name

log = logging.getLogger(__name__)


@dataclass
class TransportTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the ``transport`` backend.

    Args:
        rank: this trainer process's rank (keyword; rank 0 drives the engines).
        store: the rendezvous URL every trainer rank and engine uses.
        engines: one name per client given to ``trainer_init`` (default ``engine-0``, ...).
        stream: the stream name.
        backends: backend preference (None: every available one).
        dtype: the dtype on the wire (e.g. ``"bfloat16"``); None: the source's dtypes.
        timeout: seconds one engine's update round may take before it is reported a straggler
            (and the bound of every other wait).
        deadline: seconds a publish waits for any one engine rank's bytes.
        token: the shared token of the job's Transports, if any.
        first_version: the first version number (versions must increase across trainer restarts).
        receive: ``"whole"`` or ``"slices"`` (each engine rank receives only its TP slices), see
            :class:`TransportInitInfo`.
        auto_load: engines load every version as soon as it is complete, between forward
            passes (see :class:`TransportInitInfo`); pair with ``send_weights(load=False)``.
        delta: delta sync of the publisher (see ``MeshPublisher(delta=...)``): ``"auto"``
            sends the changed units only to engine ranks reached over a network backend,
            ``True`` to every rank that takes them, ``False`` never.
        delta_crossover: the publisher's (see ``MeshPublisher(delta_crossover=...)``): None
            chooses per version and engine rank from what it measured on that rank's path; a
            float is used as it is.
    """

    backend: ClassVar[str] = BACKEND

    store: str = ""
    engines: list[str] | None = None
    stream: str = "policy"
    backends: list[str] | None = None
    dtype: str | None = None
    timeout: float = 60.0
    deadline: float = 30.0
    token: str | None = None
    first_version: int = 1
    auto_load: bool = False
    receive: str = "whole"
    delta: bool | str = "auto"
    delta_crossover: float | None = None

    def __post_init__(self) -> None:
        if self.delta not in (True, False, "auto"):
            raise ValueError(f"TransportTrainerInitInfo: delta must be True, False or 'auto', not {self.delta!r}")
        if not self.store:
            raise ValueError("TransportTrainerInitInfo: store= (the rendezvous URL) is required")
        if not (0 < self.timeout < float("inf")) or not (0 < self.deadline < float("inf")):
            raise ValueError("TransportTrainerInitInfo: timeout and deadline must be positive numbers")
        if self.dtype is not None and not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"TransportTrainerInitInfo: unknown dtype {self.dtype!r}")


@dataclass(frozen=True)
class SyncReport:
    """What one ``send_weights`` did: the version, this rank's publish report, and (rank 0) how
    each engine's round ended."""

    version: int
    publish: MeshPublishReport | None
    engines: dict[str, EngineResult] = field(default_factory=dict)
    publish_s: float = 0.0
    total_s: float = 0.0

    @property
    def loaded(self) -> list[str]:
        return [e for e, r in self.engines.items() if r.status is EngineStatus.LOADED]


class TransportTrainerEngine(TrainerWeightTransferEngine[TransportTrainerInitInfo]):
    """Publishes versions of the trainer's weights to vLLM engines and has them loaded.

    Build it on every trainer rank with ``trainer_init`` (or vLLM's
    ``WeightTransferTrainerFactory.trainer_init``); call ``send_weights()`` after every
    optimizer step on every rank; ``shutdown()`` at the end.
    """

    init_info_cls = TransportTrainerInitInfo

    def __init__(self, *, client: Any, source: WeightSource | None, info: TransportTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=info.is_sender)
        self.rank = info.rank  # vLLM 0.33's base class keeps it (0 unless given); 0.32's has none
        if source is None:
            raise ValueError("the transport trainer engine needs a WeightSource")
        self.info = info
        self.sharded = isinstance(source, ShardSource)
        self.metas = param_metas(source)  # read here, once: a source's metadata must not change
        if not self.sharded:
            check_whole_source(source, self.metas, info.rank)
        clients = list(client) if isinstance(client, (list, tuple)) else ([client] if client is not None else [])
        names = info.engines or [f"engine-{i}" for i in range(len(clients))]
        if len(names) != len(clients):
            raise ValueError(f"{len(clients)} clients but engines={names}")
        self.clients: dict[str, VLLMWeightSyncClient] = dict(zip(names, clients, strict=True))
        self.version = info.first_version - 1
        self._driver = EngineDriver()
        self.loop: LoopThread | None = None
        self.publisher: MeshPublisher | None = None
        if self.sharded or self.is_sender:
            self._open(source)

    def _open(self, source: WeightSource) -> None:
        info = self.info
        if isinstance(source, ShardSource):
            state = source.state()
            check_agrees(self.metas, state)
            layout, rank = trainer_layout_from_state_dict(state), info.rank
        else:  # rank 0 alone holds every tensor whole; the real ones come with each publish
            state = {m.name: torch.empty(m.shape, dtype=m.dtype, device="meta") for m in self.metas}
            whole = {m.name: (tuple(m.shape), full_box(tuple(m.shape))) for m in self.metas}
            layout, rank = trainer_layout_from_state_dict(state, rank=0, boxes=whole), 0
        if info.dtype is not None:
            layout = layout.cast(info.dtype)
        self.loop = LoopThread(f"trainer-{info.rank}", store=info.store, backends=info.backends,
                               timeout=info.timeout, token=info.token)
        try:
            self.publisher = MeshPublisher(self.loop.t, info.stream, state, layout, rank=rank, deadline=info.deadline,
                                           delta=info.delta, delta_crossover=info.delta_crossover)
            self.loop.call(self.publisher.start)
        except BaseException:
            self.loop.close()
            raise

    @classmethod
    def trainer_init(cls, init_info: TransportTrainerInitInfo, *, client: Any,
                     source: WeightSource | None = None) -> TransportTrainerEngine:
        """Opens this rank's endpoint and (rank 0) has every engine join the stream.

        Args:
            init_info: see :class:`TransportTrainerInitInfo`.
            client: one ``VLLMWeightSyncClient`` (e.g. :class:`LLMClient`,
                ``HTTPVLLMWeightSyncClient``) or a list of them, one per engine.
            source: the weights: a ``WeightSource`` (whole tensors) or a :class:`ShardSource`.

        Raises:
            ValueError: no source; the engine names do not match the clients; trainer rank 0 does
                not own every tensor of a whole-tensor source; a ShardSource's metadata does not
                describe its module.
            TypeError: a whole-tensor source that yields no full tensors (vLLM 0.33: no
                ``iter_full``).
            TransportError: the endpoint cannot open.
            EngineSyncError: an engine failed to join (each engine's reason in the message, e.g. a
                stream whose tensor names its model cannot load).
        """
        engine = cls(client=client, source=source, info=init_info)
        if engine.is_sender:
            results = engine._driver.run(
                {name: engine._joiner(name, c) for name, c in engine.clients.items()}, -1, init_info.timeout)
            bad = {n: r.error for n, r in results.items() if r.status is not EngineStatus.LOADED}
            if bad:
                engine.shutdown()
                raise EngineSyncError(f"engines could not join stream {init_info.stream!r}: {bad}")
        return engine

    def worker_init_info(self, engine: str, *, pull_on_join: bool = True) -> TransportInitInfo:
        """The init info of engine ``engine``'s workers (``to_env()`` of it, as
        ``TRANSPORT_VLLM_INIT``, makes an engine started later join by itself)."""
        i = self.info
        return TransportInitInfo(store=i.store, engine=engine, stream=i.stream, backends=i.backends,
                                 timeout=i.timeout, token=i.token, pull_on_join=pull_on_join, auto_load=i.auto_load,
                                 receive=i.receive)

    def _joiner(self, name: str, client: VLLMWeightSyncClient) -> Any:
        init = self.worker_init_info(name, pull_on_join=self.version >= self.info.first_version).to_dict()
        return lambda: client.init_weight_transfer_engine(init)

    def add_engine(self, name: str, client: VLLMWeightSyncClient, *, join: bool = True) -> None:
        """Drives one more engine from the next ``send_weights`` on (rank 0). ``join``: have it
        join now (it then loads the current version); False for an engine that joined by itself
        (``TRANSPORT_VLLM_INIT``). A name already driven is replaced (a restarted engine)."""
        self._driver.forget(name)
        if join:
            self._joiner(name, client)()
        self.clients[name] = client

    def load_stats(self, engine: str, *, rank: int = 0, dp_rank: int | None = None) -> dict[str, int] | None:
        """What TP rank ``rank`` of ``engine`` did at its last load, read one-sidedly from its
        worker: ``version``, ``groups`` (decoder layers, plus the rest as one, that went
        through ``load_weights``), ``delta_sources`` and ``delta_units`` (trainer ranks whose
        deltas it applied, and the 2-byte units they wrote), ``wait_us``, ``load_us`` and
        ``loads`` (so far). None: it has loaded nothing yet.

        Raises:
            RuntimeError: this rank has no endpoint (not rank 0, nor sharded).
            TransportError: the worker cannot be reached or read in time.
        """
        if self.loop is None:
            raise RuntimeError("this trainer rank has no endpoint")
        t, peer = self.loop.t, worker_name(engine, rank, dp_rank)
        out = torch.empty(LOAD_WORDS, dtype=torch.int64)

        async def stamp() -> int:
            await t.get(out, peer, key=LOAD_KEY)
            return int(out[0])

        async def copy() -> torch.Tensor:
            return out.clone()

        async def read() -> torch.Tensor | Pending:  # PENDING: caught mid-write, look again
            return await seqlock_read(stamp, copy, stable=even)

        words = self.loop.call(functools.partial(poll, read, timeout=self.info.timeout,
                                                 what=f"{peer}: a whole load record"))
        stats = dict(zip(LOAD_FIELDS, (int(x) for x in words[1:]), strict=True))
        if stats["loads"] == 0:
            return None
        stats["version"] -= 1
        return stats

    def busy(self, name: str) -> bool:
        """Whether engine ``name``'s last round is still running (a straggler): leave that engine
        alone (e.g. do not generate on an offline ``LLM``) until it ends."""
        return self._driver.busy(name)

    def remove_engine(self, name: str) -> None:
        """Stops driving ``name`` (its workers stay in the stream until they leave)."""
        self.clients.pop(name, None)
        self._driver.forget(name)

    def warm(self) -> int:
        """Readies this rank's pushes into engine workers it has not fed or warmed yet
        (:meth:`transport.weights.MeshPublisher.warm`), so that their first
        :meth:`send_weights` costs what later ones do; moves no weights. Call it where the time
        is free, e.g. after :meth:`add_engine` while the trainer computes. A rank that does not
        publish (not the sender of an unsharded source) has nothing to warm.

        Returns:
            The transfers warmed (two per engine worker newly fed from this rank).

        Raises:
            ClosedError: shut down.
        """
        if self.publisher is None or self.loop is None:
            return 0
        return int(self.loop.call(self.publisher.warm))

    def send_weights(self, *, load: bool = True) -> SyncReport:  # type: ignore[override]  # vLLM's: None
        """Publishes the next version and (rank 0) has every engine load it.

        Args:
            load: False: only publish (engines joined with ``auto_load`` load it by themselves,
                between forward passes; others at their next update round).

        Returns:
            The report (per engine: loaded, straggler or failed). A straggler's round goes on
            in the background; it is skipped until it ends.

        Raises:
            TransportError: this rank's publish failed as a whole (e.g. the Transport closed).
        """
        t0 = time.perf_counter()
        self.version += 1
        v = self.version
        report: MeshPublishReport | None = None
        if self.sharded:
            assert isinstance(self.source, ShardSource) and self.loop is not None and self.publisher is not None
            report = self.loop.call(self.publisher.publish, v, self.source.state())
        else:
            assert self.source is not None
            whole = {n: t.detach() for n, t in full_tensors(self.source)}  # every rank (an FSDP source gathers)
            if self.is_sender:
                assert self.loop is not None and self.publisher is not None
                report = self.loop.call(self.publisher.publish, v, whole)
        t1 = time.perf_counter()
        engines: dict[str, EngineResult] = {}
        if self.is_sender and load:
            engines = self._driver.run({n: update_round(c, v, self.info.timeout) for n, c in self.clients.items()},
                                       v, self.info.timeout)
        t2 = time.perf_counter()
        for name, r in engines.items():
            if r.status is not EngineStatus.LOADED:
                log.warning("engine %s did not load version %d: %s (%s)", name, v, r.status.value, r.error)
        return SyncReport(v, report, engines, t1 - t0, t2 - t0)

    def shutdown(self) -> None:
        """Withdraws this rank from the stream and closes its endpoint (engines keep serving the
        version they loaded)."""
        if self.publisher is not None and self.loop is not None:
            try:
                self.loop.call(self.publisher.close)
            finally:
                self.publisher = None
        if self.loop is not None:
            loop, self.loop = self.loop, None
            loop.close()
