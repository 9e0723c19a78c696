"""The ``vllm.general_plugins`` entry point: vLLM runs it in its API process, its engine core
and every worker before the model is built, so ``WeightTransferConfig(backend="transport")``
works with no user code in vLLM's processes."""

from __future__ import annotations


def register() -> None:
    """Registers the ``transport`` worker and trainer engines with vLLM's factories (once per
    process: vLLM may run plugins more than once, and a second registration would raise)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from ._info import BACKEND

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "transport.vllm._worker", "TransportWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, "transport.vllm._trainer", "TransportTrainerEngine")
