"""The ``tcp`` backend: both sides of transfers over the agents' TCP connections, with no
dependency beyond the standard library and the native extension.

* ``_backend.py``: the backend and its initiator side (frames, the direct lane to a peer's native
  server for ranges of at most 16 MiB, prepared run tables);
* ``_run_frames.py``: a prepared transfer's runs cut into PUTR / GETR frames;
* ``_stripe.py``: striping over NICs, large transfers to a peer that listens on several
  addresses spread over one lane (connection) per address, with failover between lanes;
* ``_serve.py``: the target side (``serve_frame``: one range, run tables, staged replies);
* ``_frames.py``: its frame kinds in the agent's protocol and the requests they carry.
"""

from ._backend import TcpBackend as TcpBackend

__all__ = ["TcpBackend"]
