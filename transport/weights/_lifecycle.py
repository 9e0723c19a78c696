"""The one lifecycle of the weights classes (``Publisher``, ``Subscriber``, ``MeshPublisher``,
``MeshSubscriber``): ``await start()``, ``await aclose()``, and ``async with`` for both."""

from __future__ import annotations

import abc
from typing import TypeVar

_L = TypeVar("_L", bound="Lifecycle")


class Lifecycle(abc.ABC):
    """``async with obj:`` starts it (``await obj.start()``) and closes it on the way out
    (``await obj.aclose()``), also when the block raises or is cancelled."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Registers what the object publishes and readies it (see each class)."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Withdraws what :meth:`start` registered (see each class). Idempotent."""

    async def __aenter__(self: _L) -> _L:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
