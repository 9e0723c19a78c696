"""Facts about this host and its processes: host identity, process start times."""

from __future__ import annotations

import collections
import errno
import functools
import os
import select
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


class ProcessWatch:
    """Liveness of other processes on this host without reading ``/proc`` at every check: one
    pidfd per process, matched to its start time once, then a zero-timeout poll per check
    (readable = exited, zombies included). At most ``limit`` pidfds are kept (oldest closed);
    where pidfds are unavailable (old kernels, out of descriptors) it reads ``/proc``."""

    def __init__(self, limit: int = 1024) -> None:
        self._limit = limit
        self._fds: collections.OrderedDict[tuple[int, int], int] = collections.OrderedDict()
        self._polls: dict[int, select.poll] = {}  # fd -> a poll object watching it (made once)

    def alive(self, pid: int, start: int) -> bool:
        """Whether the process ``pid`` that started at ``start`` is still running."""
        fd = self._fds.get((pid, start))
        if fd is None:
            try:
                fd = os.pidfd_open(pid)
            except (AttributeError, OSError) as exc:
                if isinstance(exc, OSError) and exc.errno == errno.ESRCH:
                    return False
                return process_alive(pid, start)
            if pid_start(pid) != start:  # the pid was reused (or the process is a zombie)
                os.close(fd)
                return False
            self._fds[(pid, start)] = fd
            self._polls[fd] = select.poll()
            self._polls[fd].register(fd, select.POLLIN)
            while len(self._fds) > self._limit:
                self._close(self._fds.popitem(last=False)[1])
        if self._polls[fd].poll(0):
            self._close(self._fds.pop((pid, start)))
            return False
        return True

    def _close(self, fd: int) -> None:
        del self._polls[fd]
        os.close(fd)

    def close(self) -> None:
        while self._fds:
            self._close(self._fds.popitem()[1])
