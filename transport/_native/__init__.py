"""The only code that touches the native extension ``transport._C`` or ``ctypes``.

Everything else in the library calls the typed functions and classes here, which turn native
failures into the error tree (:mod:`transport._errors`). The extension loads lazily, on first use
(:mod:`._extension`; its stub is ``_C.pyi``). One module per native part:

* :mod:`.copy` -- the same-host copy engine (:class:`Copier`), shareable host buffers, peers'
  mappings, cross-memory attach, the memory fence;
* :mod:`.ucx` -- the UCX engine (:class:`UcxEngine`) and the libucp it loads;
* :mod:`.tcp` -- the tcp backend's direct lane (native server threads, the region mirror, the
  initiator's lane);
* :mod:`.cuda` -- the CUDA driver calls (the policy on top is :mod:`transport._cuda`);
* :mod:`.kernels` -- the ABI of the CUDA kernels (names, launch bounds, parameter layouts);
* :mod:`.nccl` -- libnccl (through ctypes) and its non-blocking communicators;
* :mod:`.probe` -- the doctor's same-host permission probe.

The engines report completions through an eventfd that a task waits on in the event loop
(``anyio.wait_readable``), so no thread polls and no Python runs on the native threads.
"""

from __future__ import annotations

from . import cuda, kernels
from ._extension import extension_path, load, unavailable_reason
from .copy import (
    INLINE_MAX_BYTES,
    Copier,
    CopyKind,
    CopyPlan,
    CopyResult,
    CopyStatus,
    PeerMapping,
    RemoteWord,
    SharedBuffer,
    cma_probe,
    copy_now,
    memory_fence,
    pack_segments,
    probe_address,
    shared_buffer,
    stream_copy,
)
from .probe import IpcProbe, probe_ipc
from .ucx import UcxEngine, UcxList, UcxPart, UcxResult

__all__ = [
    "INLINE_MAX_BYTES",
    "Copier",
    "CopyKind",
    "CopyPlan",
    "CopyResult",
    "CopyStatus",
    "IpcProbe",
    "PeerMapping",
    "RemoteWord",
    "SharedBuffer",
    "UcxEngine",
    "UcxList",
    "UcxPart",
    "UcxResult",
    "cma_probe",
    "copy_now",
    "pack_segments",
    "cuda",
    "extension_path",
    "kernels",
    "load",
    "memory_fence",
    "probe_address",
    "probe_ipc",
    "shared_buffer",
    "stream_copy",
    "unavailable_reason",
]
