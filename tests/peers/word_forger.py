"""A third peer that forges one control word of another peer: ``python -m tests.peers.word_forger '<json spec>'``.

It opens a Transport ``name`` (``backends``) and, each time the signal ``forge`` is raised to
``n`` (1, 2, ...), writes the int64 ``word`` at byte ``offset`` of peer ``victim``'s region
``key`` (a subscriber's control block: writable by design, as the publisher writes it), as any
peer may, then raises the signal ``forged`` on the peer ``notify`` to ``n``. It runs until
killed.
"""

from __future__ import annotations

import json
import sys

import torch
import trio

import transport


async def main(spec: dict) -> None:
    word = torch.tensor([spec["word"]], dtype=torch.int64)
    async with transport.Transport(spec["name"], store=spec["store"], backends=spec.get("backends"), timeout=30) as t:
        n = 0
        while True:
            n = await t.wait_signal("forge", at_least=n + 1, timeout=3600)
            await t.put(word, spec["victim"], key=spec["key"], offset=spec["offset"])
            await t.signal(spec["notify"], "forged", n)


if __name__ == "__main__":
    trio.run(main, json.loads(sys.argv[1]))
