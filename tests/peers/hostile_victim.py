"""An initiator that talks to forged peers: ``python -m tests.peers.hostile_victim '<json spec>'``.

It opens a Transport (``backends``) and, for each peer in ``peers``, tries ``lookup``, a put
into ``w`` and a get from ``ro``, each under ``timeout`` seconds, twice (the second round goes
through whatever the first one cached). Prints one JSON line: per peer, per operation, "ok"
or the error's type name and message. Anything that is not a TransportError escapes (the test
sees the exit status), and so does a crash or a hang (the test's own timeout).
"""

from __future__ import annotations

import json
import sys

import torch
import trio

import transport


async def _try(what: str, outcomes: dict[str, str], fn) -> None:
    try:
        with trio.fail_after(30):  # a hang past the operation's own timeout is a failure too
            await fn()
        outcomes.setdefault(what, "ok")
    except transport.TransportError as exc:
        outcomes[what] = f"{type(exc).__name__}: {str(exc)[:300]}"


async def main(spec: dict) -> None:
    timeout = spec.get("timeout", 2.0)
    out: dict[str, dict[str, str]] = {}
    async with transport.Transport("victim", store=spec["store"], backends=tuple(spec["backends"]), timeout=10) as t:
        src = torch.arange(64, dtype=torch.uint8)
        dst = torch.zeros(64, dtype=torch.uint8)
        for _round in range(2):
            for name in spec["peers"]:
                o = out.setdefault(name, {})

                async def lookup(name: str = name) -> None:
                    if await t.lookup(name) is None:
                        raise transport.PeerNotFoundError(f"lookup({name!r}) found nothing")

                await _try("lookup", o, lookup)
                await _try("put", o, lambda name=name: t.put(src, name, key="w", timeout=timeout))
                await _try("get", o, lambda name=name: t.get(dst, name, key="ro", timeout=timeout))
    print(json.dumps(out))


if __name__ == "__main__":
    trio.run(main, json.loads(sys.argv[1]))
