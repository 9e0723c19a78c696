"""``python -m benchmarks.delta_kernel [--mb 200] [--densities 0.03 0.11] [--isas avx2 avx512] [--json F]``

The publisher's diff kernel (``transport._native.delta.encode``) alone, as the delta sync
pipeline runs it on a model's tensors but with no Python between them: ``--mb`` of bf16 split
into one tensor per thread, one-ULP changes at random positions at each density, on one thread
and on all the cores this process may use. Beside it, measured in the same run on the same
buffers: a 2-thread memcpy of the fresh version (the delta_sync benchmark's baseline: its target
is a diff at >= 0.5x of it) and a plain read of both versions (torch's sum, all threads: the
least any diff reads). Prints the best of ``--repeats`` for each, in ms and as a ratio to the
memcpy; ``--json`` writes them.

Where the full benchmark's diff misses its target, this says whether the kernel itself does
(two threads on the 2-core VM scale 1.4x: its loop is bound by its work per 64-byte step).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.stats import best_s
from transport._native import delta as native
from transport.weights import delta_isa


def on_threads(works: list[Callable[[], None]]) -> None:
    """Runs each of ``works`` on its own thread (the first on this one) and waits for all."""
    helpers = [threading.Thread(target=w) for w in works[1:]]
    for h in helpers:
        h.start()
    works[0]()
    for h in helpers:
        h.join()


def versions(n: int, density: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 base of ``n`` elements and a fresh copy with ``density`` of them one ULP off."""
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
    fresh = base.clone()
    fresh.view(torch.int16)[torch.randperm(n, generator=g)[: int(n * density)]] += 1
    return fresh, base


def measure(density: float, n: int, threads: int, isas: list[str], repeats: int) -> list[dict[str, Any]]:
    """The rows of one density: each path's kernel on one thread and on ``threads``, beside the
    same buffers' memcpy and read of both versions."""
    pairs = [versions(n, density, seed) for seed in range(threads)]
    fresh = torch.cat([f for f, _ in pairs])
    dst = torch.empty_like(fresh)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        memcpy_s = best_s(lambda: dst.copy_(fresh), repeats)
        # As int64 words: a sum then reads each byte once, at memory speed (as delta_sync's
        # reference does; an int16 sum is far slower than the memory).
        read_s = best_s(lambda: [t.view(torch.int64).sum() for p in pairs for t in p], repeats)
    finally:
        torch.set_num_threads(before)
    cap = n  # bytes: half the tensor's, as the pipeline's budget (sparser than that, or dense)
    outs = [torch.zeros(cap, dtype=torch.uint8) for _ in pairs]  # faulted in before the timing
    rows: list[dict[str, Any]] = []
    for isa_name in isas:
        isa = native.Isa[isa_name.upper()]

        def one(i: int, isa: native.Isa = isa) -> None:
            f, b = pairs[i]
            native.encode(f.data_ptr(), b.data_ptr(), 0, n, 2, outs[i].data_ptr(), cap, isa)

        try:
            one_s = best_s(functools.partial(one, 0), repeats) * threads  # one thread over all of it
            all_s = best_s(functools.partial(on_threads, [functools.partial(one, i) for i in range(threads)]),
                           repeats)
        except Exception as exc:  # noqa: BLE001 -- an ISA this CPU lacks: reported, not fatal
            rows.append({"density": density, "isa": isa_name, "error": str(exc)})
            print(f"{density:.2%} {isa_name}: {exc}", flush=True)
            continue
        row = {"density": density, "isa": isa_name, "one_thread_s": one_s, "threads_s": all_s,
               "memcpy_s": memcpy_s, "read_both_s": read_s, "diff_over_memcpy": memcpy_s / all_s,
               "scaling": one_s / all_s}
        rows.append(row)
        print(f"{density:.2%} {isa_name}: diff {all_s * 1e3:.1f} ms on {threads} threads "
              f"({one_s * 1e3:.1f} ms on one, x{row['scaling']:.2f}); memcpy {memcpy_s * 1e3:.1f} ms, "
              f"read both {read_s * 1e3:.1f} ms; diff at {row['diff_over_memcpy']:.2f}x the memcpy", flush=True)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    threads = len(os.sched_getaffinity(0))
    n = args.mb * 1_000_000 // 2 // threads // 4 * 4  # elements per thread, whole int64 words
    return {"benchmark": "delta_kernel", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "machine": {"platform": platform.platform(), "threads": threads, "torch": torch.__version__,
                        "diff_isa": delta_isa()},
            "mb": args.mb, "repeats": args.repeats,
            "rows": [row for d in args.densities for row in measure(d, n, threads, args.isas, args.repeats)]}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.delta_kernel", description=__doc__.split("\n\n")[1])
    p.add_argument("--mb", type=int, default=200, help="MB of bf16 in all (one tensor per thread)")
    p.add_argument("--densities", type=float, nargs="+", default=[0.03, 0.11])
    p.add_argument("--isas", nargs="+", default=["avx2", "avx512"], choices=["scalar", "avx2", "avx512"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    out = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
