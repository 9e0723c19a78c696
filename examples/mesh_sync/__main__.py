"""``python -m examples.mesh_sync``: see run.py."""

import sys

from .run import main

sys.exit(main())
