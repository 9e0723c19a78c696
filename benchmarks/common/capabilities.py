"""What the benchmarks ask ``transport`` about this machine: which backends run, which of them
are one-sided, whether its CUDA support is usable. Public API only."""

from __future__ import annotations

import transport
import transport.backends


def available_backends() -> dict[str, str | None]:
    """Every backend ``transport`` knows, in preference order: name -> None when it can run here,
    else the reason it cannot."""
    return dict(transport.available_backends())


def is_one_sided(name: str) -> bool:
    """Whether backend ``name`` moves bytes without the target's agent (else the agent serves it).

    Raises:
        KeyError: ``transport`` has no backend of that name.
    """
    return bool(transport.backends.registered_backends()[name].one_sided)


def cuda_unavailable_reason() -> str | None:
    """None when ``transport`` can use a CUDA driver with a device here, else why not."""
    return transport.cuda_unavailable_reason()
