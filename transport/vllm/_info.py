"""What travels through vLLM's control plane for the ``transport`` backend: the worker's init
info and the per-update info (plain dicts on the wire, dataclasses here), and the environment
variable that lets an engine join on its own."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

BACKEND = "transport"
INIT_ENV = "TRANSPORT_VLLM_INIT"  # JSON of TransportInitInfo: an engine started with it joins by itself


@dataclass
class TransportInitInfo(WeightTransferInitInfo):
    """How a vLLM engine's workers join a weight stream.

    Args:
        store: the rendezvous URL the trainer uses (``tcp://HOST:PORT`` across hosts,
            ``file://DIR`` on one host).
        engine: this engine's name, unique among the engines of the job (its workers are
            ``{engine}-tp{rank}`` in the store; with data parallelism ``{engine}-dp{d}-tp{rank}``).
        stream: the stream name the trainer publishes.
        backends: backend preference (None: every available one).
        timeout: seconds any one step of a sync may take (joining, committing, loading).
        token: the shared token of the job's Transports, if it uses one.
        pull_on_join: fetch and load the trainer's current version when joining (a restarted or
            late engine then serves it at once, without the trainer doing anything).
        receive: ``"whole"``: every TP rank receives every tensor whole (any model);
            ``"slices"``: each rank receives only the slices of each tensor its TP rank reads
            (``transport.plan``'s vLLM layouts: about 1/TP of the bytes and slot memory per rank;
            architectures ``transport.plan`` knows; others fall back to whole tensors).
        auto_load: also load every version as soon as it is complete at every rank, between
            forward passes, with no update call (TP rank 0 commits in the background; before
            each forward pass the ranks agree on the committed version with one all-reduce of
            two words over vLLM's TP group: that is the cost). Eager mode only: a captured CUDA
            graph runs no Python hooks.
        delta: take versions as deltas (trainer ranks whose publisher sends them write only
            the changed 2-byte units, checked and applied into the slot at load; see
            ``MeshSubscriber(delta=...)``). Either way a load goes through ``load_weights``
            only for the decoder layers (and the rest of the model, as one group) in which a
            tensor changed since the version loaded before.
    """

    store: str = ""
    engine: str = ""
    stream: str = "policy"
    backends: list[str] | None = None
    timeout: float = 60.0
    token: str | None = None
    pull_on_join: bool = True
    auto_load: bool = False
    receive: str = "whole"
    delta: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.store, str) or not self.store:
            raise ValueError("transport init info: store= (the rendezvous URL) is required")
        if not isinstance(self.engine, str) or not self.engine or "/" in self.engine:
            raise ValueError(f"transport init info: engine= must be a non-empty name without '/', not {self.engine!r}")
        if not isinstance(self.stream, str) or not self.stream:
            raise ValueError("transport init info: stream= must be a non-empty name")
        if not (isinstance(self.timeout, (int, float)) and 0 < self.timeout < float("inf")):
            raise ValueError(f"transport init info: timeout= must be a positive number, not {self.timeout!r}")
        if self.receive not in ("whole", "slices"):
            raise ValueError(f"transport init info: receive= must be 'whole' or 'slices', not {self.receive!r}")
        if self.backends is not None and not (isinstance(self.backends, list)
                                              and all(isinstance(b, str) for b in self.backends)):
            raise ValueError(f"transport init info: backends= must be a list of names, not {self.backends!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_env(self) -> str:
        """The value of ``TRANSPORT_VLLM_INIT`` that makes an engine join by itself."""
        return json.dumps(self.to_dict())


def init_info_from_env() -> TransportInitInfo | None:
    """The init info in ``TRANSPORT_VLLM_INIT``, if set.

    Raises:
        ValueError: the variable is not a JSON object of init info fields.
    """
    raw = os.environ.get(INIT_ENV)
    if not raw:
        return None
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{INIT_ENV} is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"{INIT_ENV} must be a JSON object of init info fields")
    try:
        return TransportInitInfo(**doc)
    except TypeError as exc:
        raise ValueError(f"{INIT_ENV}: {exc}") from exc


@dataclass
class TransportUpdateInfo(WeightTransferUpdateInfo):
    """One update: which version to load (None: the newest the engine holds) and how long to
    wait for it to be complete at every rank (None: the init info's timeout)."""

    version: int | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        if self.version is not None and (not isinstance(self.version, int) or self.version < 0):
            raise ValueError(f"transport update info: version must be an int >= 0, not {self.version!r}")
        if self.timeout is not None and not (isinstance(self.timeout, (int, float))
                                             and 0 < self.timeout < float("inf")):
            raise ValueError(f"transport update info: timeout must be a positive number, not {self.timeout!r}")
