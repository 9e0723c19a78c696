"""Facts about this host and its processes: host identity, process start times."""

from __future__ import annotations

import functools
import os
import socket

from ._wire import HostId


@functools.cache
def host_id() -> HostId:
    """This host and PID namespace. Two processes with equal HostIds can use same-host IPC."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    try:
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pid_ns = 0
    return HostId(socket.gethostname(), boot_id, pid_ns)


def pid_start(pid: int) -> int:
    """The start time (clock ticks since boot) of ``pid``, or -1 if it does not exist or has
    already exited (a zombie waiting to be reaped counts as exited).

    A pid and its start time name one process: pids are reused, start times make them unique.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return -1
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = data[data.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):  # killed but not yet reaped by its parent
        return -1
    return int(fields[19])


def process_alive(pid: int, start: int) -> bool:
    return pid_start(pid) == start
