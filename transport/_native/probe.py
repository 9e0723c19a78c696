"""Whether same-host ``ipc`` between two unrelated processes is permitted here (for ``python -m
transport doctor``): a short-lived child process tries cross-memory attach and a shared mapping
into this one.

The child loads only the torch-free native extension, by its file (a fast start), and reads from
its *parent*: a parent is not the child's descendant, so Yama ``ptrace_scope=1`` judges this pair
as it judges two unrelated peers. (A parent probing its own child would be allowed under Yama=1
and report a false "works".)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

from .._errors import TransportInternalError
from ._extension import extension_path
from .copy import probe_address, shared_buffer

_PAGE = 4096

# argv: extension file, parent pid, probe byte address, memfd number, memfd size.
_CHILD = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("transport._C", sys.argv[1])
ext = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ext)
pid, addr, fd, nbytes = (int(x) for x in sys.argv[2:6])
out = {"cma_errno": ext.cma_probe(pid, addr, 1)}
try:
    ext.PeerMapping(pid, fd, nbytes, True)
    out["mapping_error"] = None
except Exception as exc:
    out["mapping_error"] = str(exc)
print(json.dumps(out), flush=True)
"""


@dataclass(frozen=True)
class IpcProbe:
    """What an unrelated same-host process may do to this one: ``cma_errno`` is 0 when cross-memory
    attach works, else its errno (``EPERM``: refused); ``mapping_error`` is None when a shared
    mapping (``/proc/<pid>/fd``) works, else why not."""

    cma_errno: int
    mapping_error: str | None


def probe_ipc(timeout: float) -> IpcProbe:
    """Runs the probe in a child process; always joins it (killed past ``timeout`` seconds).

    Raises:
        TransportInternalError: the probe could not run: the extension does not load, or the
            child did not finish in time, failed, or printed something unexpected (says which).
    """
    buf = shared_buffer(_PAGE, "transport-doctor")  # a memfd, as Transport.empty() makes
    args = [extension_path(), os.getpid(), probe_address(), buf.fd, _PAGE]
    cmd = [sys.executable, "-c", _CHILD, *map(str, args)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=timeout)
        raise TransportInternalError(f"the probe process did not finish within {timeout:g}s") from None
    finally:
        del buf
    if proc.returncode != 0:
        detail = err.decode(errors="replace").strip()[-500:]
        raise TransportInternalError(f"the probe process failed (exit {proc.returncode}): {detail}")
    try:
        result = json.loads(out.decode().strip().splitlines()[-1])
        return IpcProbe(int(result["cma_errno"]), result["mapping_error"])
    except (ValueError, IndexError, KeyError, TypeError):
        raise TransportInternalError(f"unexpected probe output: {out[-200:]!r}") from None
