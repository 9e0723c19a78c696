"""A Transport on an event loop thread of its own, for code that is synchronous (vLLM's worker
and trainer engines are called on the engine's threads, never inside an event loop)."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from .._errors import TransferTimeoutError
from .._transport import Transport


class LoopThread:
    """Runs one open :class:`~transport.Transport` on a daemon event loop thread.

    ``call(fn, *args, timeout=)`` runs ``fn`` (sync or async) on that loop and returns its
    result on the calling thread; every call is bounded by ``timeout``.

    Args:
        name, store, backends, timeout: as for :class:`~transport.Transport`.
        token: the shared token that authenticates control connections and records.

    Raises:
        TransportError: the Transport cannot open (e.g. the store is unreachable).
    """

    def __init__(self, name: str, *, store: str, backends: list[str] | None, timeout: float,
                 token: str | None = None) -> None:
        self.timeout = timeout
        self._stack = contextlib.ExitStack()
        try:
            self.portal: BlockingPortal = self._stack.enter_context(start_blocking_portal("asyncio"))
            self.t: Transport = self._stack.enter_context(self.portal.wrap_async_context_manager(
                Transport(name, store=store, backends=backends, timeout=timeout, token=token)))
        except BaseException:
            self._stack.close()
            raise

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """``fn(*args)`` on the loop, within ``timeout`` (default: the Transport's).

        Raises:
            TransferTimeoutError: not done in time (the call is cancelled on the loop).
        """
        limit = self.timeout if timeout is None else timeout

        async def bounded() -> Any:
            with anyio.fail_after(limit):
                out = fn(*args)
                if isinstance(out, Awaitable):
                    return await out
                return out

        try:
            return self.portal.call(bounded)
        except TransferTimeoutError:
            raise
        except TimeoutError as exc:
            name = getattr(fn, "__qualname__", repr(fn))
            raise TransferTimeoutError(f"{self.t.name}: {name} not done within {limit:g}s") from exc

    def close(self) -> None:
        """Closes the Transport (its peers then see it gone) and stops the loop thread."""
        self._stack.close()
