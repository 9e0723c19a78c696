"""``python -m benchmarks.delta_parts [--backends ipc,tcp] [--iters 40] [--out DIR] [--tag T]``

What one part of a delta version costs to push into a subscriber's slot, two ways, in one run,
alternating: the way a push sent a part before, ``put_many`` of (a view of the staging buffer,
slot key, slot offset) items (a new transfer per part: local checks per item, routing, the
checks against the peer's record, the backend's list), and the way it sends one now, a prepared
put of every run the encodings may take (made once per subscriber and slot) started with the
part's rows (``PreparedTransfer.start(runs=...)``); for reference, the floor: a transfer prepared
for exactly this part's rows, started again (what a part would cost were its rows known ahead).
Each case is a staging buffer packed with
``N`` encodings that land at their tensors' places in a slot region of another process
(tests/peers/peer_target.py), over each backend: 75 tensors' encodings of 1-4 KiB, and 10,000
encodings of 64 B. Prints the median time per part (start to landed), runs/s, and the ratio; with
``--out`` writes ``delta-parts-<date>[-tag].json`` and ``.md`` there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch

from benchmarks.common.machine import CpuSample, command_line, library, library_line, machine, other_load
from benchmarks.common.stats import median

SLOT = 16 << 20  # bytes
# (label, encodings, bytes each may take in the staging buffer, bytes each takes this time)
CASES = [("75 tensors, 1-4 KiB each", 75, 8 << 10, (1 << 10, 4 << 10)), ("10,000 runs of 64 B", 10_000, 128, (64, 64))]


def layout(n: int, cap: int, sizes: tuple[int, int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The window of ``n`` encodings (staging offset, slot offset, cap), packed back to back in
    the staging buffer and spread over the slot, and one part's rows: each encoding's first
    bytes (as many as this version's change took)."""
    rng = np.random.default_rng(seed)
    stride = SLOT // n // 64 * 64
    window = np.stack([np.arange(n) * cap, np.arange(n) * stride, np.full(n, cap)], axis=1).astype(np.int64)
    took = rng.integers(sizes[0] // 16, sizes[1] // 16 + 1, n) * 16
    return window, np.stack([window[:, 0], window[:, 1], took], axis=1)


async def measure(t: Any, peer: str, n: int, cap: int, sizes: tuple[int, int], iters: int) -> dict[str, Any]:
    window, rows = layout(n, cap, sizes, n)
    staging = torch.randint(0, 255, (n * cap,), dtype=torch.uint8)
    items = [(staging[a:a + k], "slot", b) for a, b, k in rows.tolist()]  # the views the encoder made
    t0 = time.perf_counter()
    prepared = t.prepare_put_runs(peer, staging, "slot", window)
    await prepared.start(runs=rows)
    first = time.perf_counter() - t0
    exact = t.prepare_put_runs(peer, staging, "slot", rows)
    before: list[float] = []
    after: list[float] = []
    floor: list[float] = []
    for i in range(iters + 3):  # alternating; the first three of each are a warm-up
        t0 = time.perf_counter()
        await t.put_many(peer, items)
        t1 = time.perf_counter()
        await prepared.start(runs=rows)
        t2 = time.perf_counter()
        await exact.start()
        t3 = time.perf_counter()
        if i >= 3:
            before.append(t1 - t0)
            after.append(t2 - t1)
            floor.append(t3 - t2)
    back = torch.empty(SLOT, dtype=torch.uint8)
    await t.get(back, peer, key="slot")
    for a, b, k in rows[:: max(1, n // 200)].tolist():
        assert torch.equal(back[b:b + k], staging[a:a + k]), "a part landed wrong"
    b, a = median(before), median(after)
    return {"runs": n, "bytes": int(rows[:, 2].sum()), "put_many_s": b, "subset_start_s": a,
            "put_many_runs_per_s": n / b, "subset_runs_per_s": n / a, "ratio": b / a,
            "floor_s": median(floor), "prepare_and_first_start_s": first, "put_many_all_s": before,
            "subset_all_s": after, "floor_all_s": floor}


async def run_backend(backend: str, iters: int) -> list[dict[str, Any]]:
    import transport
    from tests._support import Target

    tmp = Path(tempfile.mkdtemp(prefix="delta-parts-"))
    store = f"file://{tmp / 'store'}"
    out = []
    async with transport.Transport("bench", store=store, backends=(backend,), timeout=60) as t:
        target = Target(tmp, {"name": "slot-owner", "store": store, "backends": [backend], "initiator": "bench",
                              "mode": "serve", "timeout": 600, "regions": [{"key": "slot", "numel": SLOT,
                                                                            "dtype": "uint8"}]})
        try:
            await t.wait_signal("ready", timeout=60)
            await t.peer("slot-owner", regions=["slot"])
            for label, n, cap, sizes in CASES:
                r = await measure(t, "slot-owner", n, cap, sizes, iters)
                out.append({"backend": backend, "case": label, **r})
                print(f"{backend:4} {label:26} put_many {r['put_many_s'] * 1e3:8.3f} ms "
                      f"{r['put_many_runs_per_s'] / 1e6:7.3f}M runs/s | prepared, start(runs=) "
                      f"{r['subset_start_s'] * 1e3:8.3f} ms "
                      f"{r['subset_runs_per_s'] / 1e6:7.3f}M runs/s | {r['ratio']:5.2f}x", flush=True)
            await t.signal("slot-owner", "done", 1)
            await target.result()
        finally:
            target.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.delta_parts", description=__doc__.split("\n\n")[1])
    ap.add_argument("--backends", default="ipc,tcp")
    ap.add_argument("--iters", type=int, default=40, help="timed pushes per way and case (after 3 warm-ups)")
    ap.add_argument("--out", type=Path, help="write delta-parts-<date>.json/.md here")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    start = CpuSample.take()
    rows: list[dict[str, Any]] = []
    for backend in args.backends.split(","):
        rows += anyio.run(run_backend, backend, args.iters, backend="trio")
    result = {"date": datetime.date.today().isoformat(), "command": command_line(argv, "benchmarks.delta_parts"),
              "machine": machine(), "library": library(), "other_load": other_load(start, CpuSample.take()),
              "iters": args.iters, "rows": rows}
    table = ["| backend | part | put_many per part | runs/s | prepared, start(runs=) per part | runs/s | ratio | "
             "floor: exactly these runs prepared |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        table.append(f"| {r['backend']} | {r['case']} | {r['put_many_s'] * 1e3:.3f} ms | "
                     f"{r['put_many_runs_per_s'] / 1e6:.3f}M | {r['subset_start_s'] * 1e3:.3f} ms | "
                     f"{r['subset_runs_per_s'] / 1e6:.3f}M | **{r['ratio']:.2f}x** | {r['floor_s'] * 1e3:.3f} ms |")
    print("\n".join(table))
    if args.out:
        stem = f"delta-parts-{result['date']}{'-' + args.tag if args.tag else ''}"
        (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
        m = result["machine"]
        md = [f"# One delta part's push: a new transfer per part vs one prepared transfer started with its runs, "
              f"{result['date']}", "", f"`{result['command']}`", "",
              f"Machine: {m['cpu']}, {m['nproc']} cores, {m['memory_gib']} GiB; torch {m['torch']}. "
              + library_line(result["library"]) + f" Other load during the run: "
              f"{result['other_load']['other_cores_avg']} cores on average.", "",
              "Per backend, a target process with a 16 MiB slot region; per case, a staging buffer packed with the "
              "encodings and one part's rows (each encoding's first bytes, at its tensor's place in the slot). "
              "put_many: the part as (view, key, offset) items, a new transfer per push (the push before); "
              "prepared: one prepare_put_runs of every run the encodings may take, made once, started with the "
              "part's rows (the push now); floor: prepare_put_runs of exactly the part's rows, made once and "
              f"started again. Alternating, {args.iters} timed pushes each after 3 warm-ups; medians, from start to "
              "landed. Ratio: put_many time / prepared time.", "", *table, ""]
        (args.out / f"{stem}.md").write_text("\n".join(md) + "\n")
        print(f"wrote {args.out / stem}.json and .md")


if __name__ == "__main__":
    main(sys.argv[1:])
