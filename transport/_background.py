"""Background work nobody waits for, on daemon threads that end cleanly with the process.

Used where work may go on after the call that started it returned: the checksum passes of delta
sync (``transport.weights``) and the release of page-locked memory at close (``transport._cuda``).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def start_background(work: Callable[[], None], stop: Callable[[], None] | None = None) -> threading.Thread:
    """Starts ``work`` on a new daemon thread, what it raises logged: background work nobody
    waits for (e.g. a checksum pass another thread may finish, ``weights.SumPass``). It keeps the
    normal CPU priority: a thread of idle priority that holds the GIL when the OS stops
    running it stalls every other thread of the process, the event loop included, until a core
    is free (a publish's peer lookup took 214 ms so on this 2-core VM).

    At interpreter exit, work still running is stopped (``stop``, when given, makes ``work``
    return soon) and waited for, at most ``EXIT_WAIT_S`` in all: a daemon thread still in
    native code (torch's included) when the interpreter finalizes aborts the process
    ("terminate called without an active exception").

    Returns:
        The thread, started.
    """

    def run() -> None:
        try:
            work()
        except Exception:  # nobody waits for it: logged
            log.exception("background work %r failed", work)
        finally:
            with _running_lock:
                _running.pop(threading.current_thread(), None)

    t = threading.Thread(target=run, name="transport-background", daemon=True)
    with _running_lock:
        _running[t] = stop
    t.start()
    return t


EXIT_WAIT_S = 10.0  # the most interpreter exit waits for background work (see start_background)
_running: dict[threading.Thread, Callable[[], None] | None] = {}  # background work -> how to stop it
_running_lock = threading.Lock()


@atexit.register
def _end_background() -> None:
    """Stops the background work still running and waits for it (at most ``EXIT_WAIT_S``)."""
    with _running_lock:
        running = list(_running.items())
    for _, stop in running:
        if stop is not None:
            stop()
    deadline = time.monotonic() + EXIT_WAIT_S
    for t, _ in running:
        t.join(max(0.0, deadline - time.monotonic()))
