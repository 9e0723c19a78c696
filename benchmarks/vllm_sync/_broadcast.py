"""The baseline of ``benchmarks.vllm_sync``: what RL stacks do today, on CPU. The trainer holds
the full state dict, opens a gloo group with every vLLM worker, broadcasts every tensor, and
each worker loads them with ``load_weights`` under vLLM's layerwise reload (as vLLM's own nccl
backend does). The worker side is a vLLM worker extension (``--worker-extension-cls
benchmarks.vllm_sync._broadcast.BroadcastExtension``), called through the server's
``/collective_rpc`` route, so it runs on the very engine the transport path feeds."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import torch

EXTENSION = "benchmarks.vllm_sync._broadcast.BroadcastExtension"


class BroadcastExtension:
    """Mixed into every vLLM worker: ``bench_gloo_receive`` receives a broadcast and loads it."""

    model_runner: Any

    def bench_gloo_receive(self, host: str, port: str, world: str, specs_json: str) -> str:
        """Joins the broadcast group as rank 1 + its TP rank, receives every tensor and loads
        it; returns JSON ``{"recv_s", "load_s"}``."""
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        t0 = time.perf_counter()
        pg: Any = stateless_init_torch_distributed_process_group(
            host, int(port), 1 + get_tensor_model_parallel_rank(), int(world), "gloo", timeout=timedelta(seconds=120))
        tensors = []
        for name, shape, dtype in json.loads(specs_json):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            pg.broadcast(t, 0).wait()
            tensors.append((name, t))
        t1 = time.perf_counter()
        model = self.model_runner.get_model()
        initialize_layerwise_reload(model)
        with torch.no_grad():
            model.load_weights(iter(tensors))
        finalize_layerwise_reload(model, self.model_runner.model_config)
        _close(pg)
        return json.dumps({"recv_s": t1 - t0, "load_s": time.perf_counter() - t1})


def trainer_send(host: str, port: int, world: int, state: dict[str, torch.Tensor]) -> None:
    """The trainer's side: rank 0 of the group, broadcasts every tensor of ``state`` in order."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    pg: Any = stateless_init_torch_distributed_process_group(host, port, 0, world, "gloo",
                                                             timeout=timedelta(seconds=120))
    for t in state.values():
        pg.broadcast(t.contiguous(), 0).wait()
    _close(pg)


def _close(pg: Any) -> None:
    """Ends a group made by ``stateless_init_torch_distributed_process_group`` (it is not in
    torch.distributed's registry, so ``destroy_process_group`` does not apply)."""
    shutdown = getattr(pg, "shutdown", None)
    if callable(shutdown):
        shutdown()
