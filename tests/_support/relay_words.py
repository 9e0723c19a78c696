"""Reading a relay member's words in the forgery tests: its acknowledgement of an order."""

from __future__ import annotations

import anyio
import torch

from transport.weights import _relay_block as rb


async def acked(words: torch.Tensor, epoch: int, within: float = 30.0) -> rb.Ack:
    """How the member whose block (or section) is ``words`` acknowledged order ``epoch``, once
    it has (within ``within`` seconds)."""
    with anyio.fail_after(within):
        while int(words[rb.M_ACK_EPOCH]) != epoch:
            await anyio.sleep(0.01)
    return rb.Ack(int(words[rb.M_ACK]))
