"""Driving engines through vLLM's weight-sync clients: the offline ``LLM`` adapter, and one
update round per engine, each in a thread of its own and bounded, so that one slow or dead
engine never holds back the others."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    VLLMWeightSyncClient,
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)


class LLMClient:
    """A :class:`VLLMWeightSyncClient` over an offline ``vllm.LLM`` in this process (vLLM ships
    clients for its HTTP server and Ray actors, not for ``LLM`` itself).

    Its calls are vLLM's collective RPCs to every worker of the engine; they run on the calling
    thread. Use one client per ``LLM`` and no other thread on that ``LLM`` while a call runs.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


class EngineStatus(enum.Enum):
    """How one engine's update round ended."""

    LOADED = "loaded"  # the engine serves the version
    STRAGGLER = "straggler"  # not done within the timeout (or still busy with an earlier round)
    FAILED = "failed"  # an error (the engine died, refused the version, ...); see ``error``


@dataclass(frozen=True)
class EngineResult:
    """One engine in one ``send_weights``: its status, the seconds from the start of its round
    until it ended (or was given up), and the error."""

    engine: str
    version: int
    status: EngineStatus
    seconds: float
    error: str | None = None


class _Round(threading.Thread):
    def __init__(self, fn: Callable[[], None]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.error: BaseException | None = None
        self.done_at: float | None = None

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as exc:  # noqa: BLE001 - reported as the engine's result
            self.error = exc
        self.done_at = time.perf_counter()


class EngineDriver:
    """Runs each engine's update round on a thread of its own; an engine whose previous round
    is still running is skipped (a straggler) rather than called twice at once."""

    def __init__(self) -> None:
        self._busy: dict[str, _Round] = {}

    def busy(self, engine: str) -> bool:
        r = self._busy.get(engine)
        return r is not None and r.is_alive()

    def run(self, calls: dict[str, Callable[[], None]], version: int, timeout: float) -> dict[str, EngineResult]:
        """Starts ``calls`` (engine -> its round) at once; waits for each up to ``timeout``."""
        t0 = time.perf_counter()
        results: dict[str, EngineResult] = {}
        started: dict[str, _Round] = {}
        for engine, fn in calls.items():
            if self.busy(engine):
                results[engine] = EngineResult(engine, version, EngineStatus.STRAGGLER, 0.0,
                                               "still busy with an earlier round")
                continue
            started[engine] = self._busy[engine] = _Round(fn)
            started[engine].start()
        deadline = t0 + timeout
        for engine, r in started.items():
            r.join(max(deadline - time.perf_counter(), 0.0))
            if r.is_alive():
                results[engine] = EngineResult(engine, version, EngineStatus.STRAGGLER, time.perf_counter() - t0,
                                               f"not done within {timeout:g}s")
            elif r.error is not None:
                results[engine] = EngineResult(engine, version, EngineStatus.FAILED, (r.done_at or t0) - t0,
                                               f"{type(r.error).__name__}: {r.error}")
            else:
                results[engine] = EngineResult(engine, version, EngineStatus.LOADED, (r.done_at or t0) - t0)
        return {e: results[e] for e in calls}

    def forget(self, engine: str) -> None:
        self._busy.pop(engine, None)


def update_round(client: VLLMWeightSyncClient, version: int, timeout: float) -> Callable[[], None]:
    """One engine's round for ``version``: start, name the version, finish (the engine commits
    and loads it there) and set vLLM's ``weight_version`` to it. The engine waits at most half
    of ``timeout`` for the version to be complete at its ranks, so that a version that never
    completes (a trainer rank died mid-push) is refused by the engine itself, in time."""

    def go() -> None:
        client.start_weight_update()
        client.update_weights({"version": version, "timeout": timeout / 2})
        client.finish_weight_update(weight_version=str(version))

    return go
