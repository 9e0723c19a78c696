"""The baseline of ``benchmarks.vllm_sync``: what RL stacks do today, on CPU. The trainer holds
the full state dict, opens a gloo group with every vLLM worker, broadcasts every tensor, and
each worker loads them with ``load_weights`` (under vLLM's layerwise reload, as vLLM's own nccl
backend does). The worker side runs inside the workers through ``collective_rpc``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch


def worker_receive(worker: Any, host: str, port: int, world: int, specs: list[tuple[str, list[int], str]]) -> float:
    """In a vLLM worker: joins the broadcast group as rank 1 + its TP rank, receives every tensor
    and loads it; returns the seconds the load (the pause) took after the last byte arrived."""
    import time

    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    pg = stateless_init_torch_distributed_process_group(host, port, 1 + get_tensor_model_parallel_rank(), world,
                                                        "gloo", timeout=timedelta(seconds=120))
    tensors = []
    for name, shape, dtype in specs:
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        pg.broadcast([t], root=0).wait()
        tensors.append((name, t))
    model = worker.model_runner.get_model()
    t0 = time.perf_counter()
    initialize_layerwise_reload(model)
    with torch.no_grad():
        model.load_weights(iter(tensors))
    finalize_layerwise_reload(model, worker.model_runner.model_config)
    torch.distributed.destroy_process_group(pg)
    return time.perf_counter() - t0


def trainer_send(host: str, port: int, world: int, state: dict[str, torch.Tensor]) -> None:
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    pg = stateless_init_torch_distributed_process_group(host, port, 0, world, "gloo", timeout=timedelta(seconds=120))
    for t in state.values():
        pg.broadcast([t.contiguous()], root=0).wait()
    torch.distributed.destroy_process_group(pg)
