"""A progress bar on stderr: ``tqdm`` when it is installed, else a small one of our own."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    """Counts finished units of work and shows how far along the run is.

    Args:
        total: units in the whole run.
        stream: where to draw (stderr by default). On a terminal the bar redraws in place;
            otherwise a line is written at most every ``every_s`` seconds.
        enabled: False draws nothing.
    """

    def __init__(
        self, total: int, *, stream: TextIO | None = None, enabled: bool = True, every_s: float = 10.0
    ) -> None:
        self.total = max(1, total)
        self.n = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.every_s = every_s
        self._desc = ""
        self._t0 = time.monotonic()
        self._last = 0.0
        self._tqdm: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._tqdm = tqdm(total=self.total, file=self.stream, unit="version", dynamic_ncols=True)

    def describe(self, text: str) -> None:
        """Sets the label shown next to the bar (e.g. the configuration being measured)."""
        self._desc = text
        if self._tqdm is not None:
            self._tqdm.set_description_str(text)
        else:
            self._draw(force=self.stream.isatty())

    def update(self, n: int = 1) -> None:
        self.n = min(self.total, self.n + n)
        if self._tqdm is not None:
            self._tqdm.update(n)
        else:
            self._draw()

    def write(self, line: str) -> None:
        """Prints a line (to stderr) without breaking the bar."""
        if self._tqdm is not None:
            self._tqdm.write(line, file=self.stream)
            return
        if self.enabled and self.stream.isatty():
            self.stream.write("\r\033[K")
        self.stream.write(line + "\n")
        self._draw(force=self.stream.isatty())

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        tty = self.stream.isatty()
        if not tty and not force and now - self._last < self.every_s and self.n < self.total:
            return
        self._last = now
        width = 30
        filled = int(width * self.n / self.total)
        bar = "#" * filled + "." * (width - filled)
        elapsed = now - self._t0
        line = f"[{bar}] {self.n}/{self.total} versions  {elapsed:5.0f}s  {self._desc}"
        if tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        elif self.enabled and self.stream.isatty():
            self.stream.write("\n")
            self.stream.flush()
