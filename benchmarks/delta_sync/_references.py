"""The same-run physical references of a delta: what this machine's memory allows the diff and the
apply at best, measured with plain torch on buffers of the version's size, one process alone.

- *read both*: one read of two versions (the least memory traffic of any diff, which must
  compare every element of the new version with the old);
- *copy*: a memcpy of the version (what a dense apply is);
- *scatter(f)*: storing new values at a fraction ``f`` of the version's bf16 elements, at
  random sorted positions, with no check (``index_put_``): the least an apply of a delta of
  that density costs. A store to one element moves its whole cache line (32 bf16 elements) in
  and out of memory, so at the 1.5-3% of real AdamW steps at lr 1e-6 it touches 40-65% of the
  lines, and the hardware prefetchers stream nearly all of them: close to a full read of the
  version.

``floor(f) = read both + scatter(f)`` is the least time, on this machine, from a new version to
one subscriber holding it as a delta over a link of no cost (ipc): diff, then apply. It leaves
out the network and every fixed cost, so a measured version cannot come below it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..common.stats import best_s

REPEATS = 3


def _best(fn: Callable[[], object]) -> float:
    return best_s(fn, REPEATS)


def references(nbytes: int, densities: Iterable[float]) -> dict[str, Any]:
    """The references for a version of ``nbytes`` of bf16, on all cores (the diff and the apply
    use them all), for each density in ``densities``.

    Returns:
        ``{"read_both_s", "copy_s", "scatter_s": {density (str, 6 digits): seconds}}``.
    """
    threads_before = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        n = nbytes // 2
        a = torch.ones(n, dtype=torch.bfloat16)
        b = torch.ones(n, dtype=torch.bfloat16)
        words = n // 4  # the same bytes as int64 words: a sum reads each once, at memory speed
        read_both = _best(lambda: (a.view(torch.int64)[:words].sum(), b.view(torch.int64)[:words].sum()))
        copy = _best(lambda: b.copy_(a))
        draw = torch.rand(n, generator=torch.Generator().manual_seed(0))
        scatter: dict[str, float] = {}
        for f in sorted(set(densities)):
            idx = torch.nonzero(draw < f).flatten()  # sorted, like a payload's positions
            vals = torch.full((idx.numel(),), 2.0, dtype=torch.bfloat16)
            scatter[f"{f:.6f}"] = _best(functools.partial(b.index_put_, (idx,), vals))
        return {"read_both_s": read_both, "copy_s": copy, "scatter_s": scatter}
    finally:
        torch.set_num_threads(threads_before)


def floor_s(refs: dict[str, Any], density: float) -> float:
    """``read both + scatter(density)`` (see the module docstring)."""
    return float(refs["read_both_s"] + refs["scatter_s"][f"{density:.6f}"])
