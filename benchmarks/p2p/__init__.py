"""``python -m benchmarks.p2p``: put/get bandwidth and small-transfer latency per backend between two
processes, next to a same-run ``memcpy``; ``--peers nixl,mooncake`` measures those libraries the same
way in the same run. ``python -m transport bench`` is a thin entry to it (it calls :func:`main`).

The harness is :mod:`._run`; the other underscored modules are its own parts.
"""

from ._run import add_arguments as add_arguments
from ._run import config_from as config_from
from ._run import main as main
from ._run import run as run
