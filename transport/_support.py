"""What this machine supports, as the public API tells it (``python -m transport doctor`` says more)."""

from __future__ import annotations

from . import _cuda
from .backends import availability


def available_backends() -> dict[str, str | None]:
    """Every backend this process knows, in preference order (built-ins, then registered ones).

    Returns:
        Backend name -> None when it can run here, else why not (and what to install).
    """
    return availability()


def cuda_unavailable_reason() -> str | None:
    """Whether CUDA tensors can be registered and moved here.

    Returns:
        None when a CUDA driver with at least one device is usable (and this build embeds the
        kernels it needs), else why not.
    """
    return _cuda.unavailable_reason()
