"""``python -m benchmarks.p2p``: runs the harness (:func:`._run.main`) with the command line."""

from __future__ import annotations

import logging
import sys

from ._run import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main())
