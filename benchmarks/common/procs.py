"""Helper processes of the benchmarks: a benchmark module run as a child, its output in a log file;
and a group of worker processes reporting through one queue.

A benchmark's target process is a real separate process (``python -m benchmarks.<name>.<module> ...``).
:class:`LoggedProcess` starts it with this checkout importable, sends its output to a log file
(quoted when it fails) and always leaves it joined. :func:`supervise` runs a group of
``multiprocessing`` workers that put plain-dict messages on a queue, and always leaves them joined;
:func:`leave_process_group` is what such a worker runs last. A worker that calls :func:`output_to`
first writes its output to a log file, which the parent quotes with :func:`log_tail` when it fails.
"""

from __future__ import annotations

import logging
import os
import queue as queue_mod
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from .errors import BenchError

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_EXIT_TIMEOUT_S = 20.0

CHECKOUT = Path(__file__).resolve().parents[2]
"""The source checkout this ``benchmarks`` package lives in."""


def module_command(module: str, *args: str) -> list[str]:
    """The command line that runs ``python -m MODULE ARGS`` with this interpreter.

    Args:
        module: a module of the benchmarks, dotted in full, e.g. ``"benchmarks.p2p._target"``.
        args: its arguments.

    Returns:
        The argv, for :class:`LoggedProcess`.
    """
    return [sys.executable, "-m", module, *args]


def checkout_env() -> dict[str, str]:
    """This process's environment with the checkout first on ``PYTHONPATH``, so that a child can
    import ``benchmarks`` from any working directory."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": str(CHECKOUT) + (os.pathsep + path if path else "")}


class LoggedProcess:
    """A benchmark's helper process whose output goes to a log file, quoted when it fails.

    :meth:`stop` always leaves it joined: it waits a bounded time for a clean exit, then kills it.

    Args:
        cmd: the command line (see :func:`module_command`).
        log_path: file that receives the process's stdout and stderr.
        env: its environment (default: this process's; :func:`checkout_env` for a benchmark module).
        cwd: its working directory (default: this process's).

    Raises:
        OSError: the process could not be started (the log file is closed again).
    """

    def __init__(
        self, cmd: Sequence[str], log_path: Path, *, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # closed in stop()
        try:
            self.proc = subprocess.Popen(
                list(cmd), cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
            )
        except BaseException:
            self._log.close()
            raise
        log.info("bench helper process started: pid %d", self.proc.pid)

    def failure(self) -> str | None:
        """None while it runs, else how it ended and the tail of its output."""
        rc = self.proc.poll()
        if rc is None:
            return None
        return f"the target process exited with code {rc}; its output ends with:\n{self.output_tail()}"

    def output_tail(self, limit: int = 3000) -> str:
        """The last ``limit`` bytes of its output, decoded (or why the log cannot be read)."""
        try:
            return self.log_path.read_bytes()[-limit:].decode(errors="replace")
        except OSError as exc:
            return f"(cannot read {self.log_path}: {exc})"

    def stop(self, timeout: float = _EXIT_TIMEOUT_S) -> int:
        """Joins the process (killing it after ``timeout`` s); returns its exit code."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("bench helper process (pid %d) did not exit within %gs; killing it", self.proc.pid, timeout)
            self.proc.kill()
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        """Kills the process (if still running) and joins it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.stop()

    def supervise(self, call: Callable[[], _T], error: type[Exception] = BenchError) -> _T:
        """Runs ``call`` while the process serves it, then joins the process.

        Args:
            call: the benchmark run against this process (blocking).
            error: the exception raised when the process ends badly.

        Returns:
            What ``call`` returned.

        Raises:
            error: ``call`` succeeded but the process exited with a code other than 0 (the message
                quotes the tail of its output).
            BaseException: whatever ``call`` raised (KeyboardInterrupt included); the process is
                killed and joined first.
        """
        try:
            result = call()
        except BaseException:
            self.kill()
            raise
        rc = self.stop()
        if rc != 0:
            raise error(f"the target process exited with code {rc}; its output ends with:\n{self.output_tail()}")
        return result


_POLL_S = 0.5
_ERROR_GRACE_S = 2.0  # after a process exited with an error, how long its message may take to arrive


def supervise(procs: Sequence[Any], q: Any, timeout: float, on_message: Callable[[dict[str, Any]], None],
              join_s: float) -> tuple[list[dict[str, Any]], list[str]]:
    """Starts ``procs`` and collects the messages they put on ``q`` until every process has
    exited, one reported an error (``{"kind": "error", "who", "error", "traceback"}``), one
    exited with a non-zero code, or ``timeout`` seconds passed. Whatever is still running then
    is killed; every process is joined and the queue closed before this returns.

    Args:
        procs: ``multiprocessing`` processes, not started; their names appear in errors.
        q: the queue they report on.
        timeout: seconds for the whole group.
        on_message: called with each message as it arrives (progress lines, ...).
        join_s: seconds each process gets to exit by itself after a clean run.

    Returns:
        The messages in arrival order, and the errors (empty: the group succeeded).
    """
    messages: list[dict[str, Any]] = []
    errors: list[str] = []

    def take(msg: dict[str, Any]) -> None:
        messages.append(msg)
        if msg["kind"] == "error":
            errors.append(f"{msg['who']}: {msg['error']}\n{msg['traceback']}")
        on_message(msg)

    def exit_errors(which: Sequence[Any]) -> str:
        return ", ".join(f"{p.name} exited with code {p.exitcode}" for p in which)

    t0 = time.monotonic()
    for p in procs:
        p.start()
    try:
        while True:
            if time.monotonic() - t0 > timeout:
                errors.append(f"not finished within {timeout:g} s")
                break
            try:
                take(q.get(timeout=_POLL_S))
                continue
            except queue_mod.Empty:
                pass
            if errors or all(not p.is_alive() for p in procs):
                break
            failed = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
            if failed:
                deadline = time.monotonic() + _ERROR_GRACE_S  # let its error message arrive
                while time.monotonic() < deadline:
                    try:
                        take(q.get(timeout=_POLL_S))
                    except queue_mod.Empty:
                        break
                if not errors:
                    errors.append(exit_errors(failed))
                break
        while True:  # what is left in the queue (processes put before they exit)
            try:
                take(q.get_nowait())
            except queue_mod.Empty:
                break
        for p in procs:
            p.join(join_s if not errors else 0.1)
        if not errors and (failed := [p for p in procs if p.exitcode != 0]):
            errors.append(exit_errors(failed))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(join_s)
        q.close()
        q.join_thread()
    return messages, errors


def leave_process_group() -> None:
    """A worker's last step when it joined a ``torch.distributed`` group: destroys it, best
    effort (its results are already out; a failure is only logged)."""
    import torch.distributed as dist

    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - best effort at exit
        log.info("destroy_process_group: %s", exc)


def output_to(log_path: Path) -> None:
    """A worker's first step: sends its standard output and error to ``log_path`` at the file
    descriptor level, so that what native code writes (a CUDA or NCCL error, an abort message)
    lands there too, not only Python's prints. Pair it with :func:`log_tail` in the parent to
    quote the log when the worker fails.

    Raises:
        OSError: the log file cannot be opened.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)


def log_tail(log_path: Path, limit: int = 3000) -> str:
    """The last ``limit`` bytes of a worker's log (see :func:`output_to`), decoded, or why it
    cannot be read."""
    try:
        return log_path.read_bytes()[-limit:].decode(errors="replace")
    except OSError as exc:
        return f"(cannot read {log_path}: {exc})"
