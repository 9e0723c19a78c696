"""``python -m benchmarks.fanout``: runs the harness (:func:`._run.main`) with the command line."""

from __future__ import annotations

import sys

from ._run import main

if __name__ == "__main__":
    sys.exit(main())
