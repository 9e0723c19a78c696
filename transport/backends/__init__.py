"""Backends, in default preference order. Each lives in its own module behind ``Backend``."""

from __future__ import annotations

from ._base import Backend, BackendContext, LocalBuffer, RemoteTarget
from .ipc import IpcBackend
from .nccl import NcclBackend
from .tcp import TcpBackend
from .ucx import UcxBackend

# Preference order when the user does not choose (per transfer, the first backend that both ends
# speak and that serves the memory kinds wins): the fastest same-host path first; then one-sided
# RMA to any host; then NCCL for GPU memory on any host (its target's agent posts the receive, so
# a truly one-sided path that serves the same memory is preferred); the dependency-free agent
# path last. nccl serves only CUDA memory and ucx/tcp only host memory today, so for now nccl is
# what carries GPU memory wherever ipc cannot.
REGISTRY: dict[str, type[Backend]] = {
    "ipc": IpcBackend,
    "ucx": UcxBackend,
    "nccl": NcclBackend,
    "tcp": TcpBackend,
}

# Named in DESIGN.md and built by later work; asking for them says so instead of "unknown".
PLANNED: dict[str, str] = {}


def availability() -> dict[str, str | None]:
    """Backend name -> None when usable here, else the reason it is not."""
    out: dict[str, str | None] = {name: cls.unavailable_reason() for name, cls in REGISTRY.items()}
    out.update(PLANNED)
    return out


__all__ = ["Backend", "BackendContext", "LocalBuffer", "RemoteTarget", "REGISTRY", "availability"]
