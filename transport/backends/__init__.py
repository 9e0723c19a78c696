"""Backends, in default preference order. Each lives in its own module behind ``Backend``."""

from __future__ import annotations

from ._base import Backend, BackendContext, LocalBuffer, RemoteTarget
from .ipc import IpcBackend
from .tcp import TcpBackend
from .ucx import UcxBackend

# Preference order when the user does not choose: fastest same-host path first, then one-sided
# RMA to any host, then the dependency-free agent path.
REGISTRY: dict[str, type[Backend]] = {
    "ipc": IpcBackend,
    "ucx": UcxBackend,
    "tcp": TcpBackend,
}

# Named in DESIGN.md and built by later work; asking for them says so instead of "unknown".
PLANNED = {
    "nccl": "the nccl backend is not built yet (pip install 'transport[nccl]' once it lands)",
}


def availability() -> dict[str, str | None]:
    """Backend name -> None when usable here, else the reason it is not."""
    out: dict[str, str | None] = {name: cls.unavailable_reason() for name, cls in REGISTRY.items()}
    out.update(PLANNED)
    return out


__all__ = ["Backend", "BackendContext", "LocalBuffer", "RemoteTarget", "REGISTRY", "availability"]
