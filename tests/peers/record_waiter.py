"""A process that waits for peers: ``python -m tests.peers.record_waiter '<json spec>'``.

It opens a Transport on ``store`` (with ``token``, if given) and, for each name in ``names``,
awaits ``t.peer(name, timeout=timeout)``. It prints one JSON line: per name, how that ended
("ok", or the error's type, message and ``__cause__``'s type) and how many seconds it took. An
error that is not a TransportError escapes (the test sees the exit status).
"""

from __future__ import annotations

import json
import sys
import time

import trio

import transport


async def main(spec: dict) -> None:
    out: dict[str, dict] = {}
    async with transport.Transport("waiter", store=spec["store"], backends=("tcp",), token=spec.get("token"),
                                   timeout=30) as t:
        for name in spec["names"]:
            start = time.monotonic()
            try:
                await t.peer(name, timeout=spec["timeout"])
                out[name] = {"outcome": "ok"}
            except transport.TransportError as exc:
                out[name] = {"outcome": type(exc).__name__, "message": str(exc)[:1000],
                             "cause": type(exc.__cause__).__name__ if exc.__cause__ is not None else None}
            out[name]["seconds"] = time.monotonic() - start
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    trio.run(main, json.loads(sys.argv[1]))
