"""The ``transport`` backend against vLLM's weight-transfer contract, with no engine running: run
under each supported vLLM release, in a process of its own, by tests/weights/test_vllm_versions.py
(``vllm`` is then whichever release comes first on ``sys.path``; this module sets up vLLM's
distributed state, so it never runs inside the main test process; its name keeps pytest from
collecting it there).

What vLLM itself does with a backend, done here the same way: its plugin loader runs our entry
point; its factories build our worker engine (on a real vLLM ``LlamaForCausalLM``, loaded by
vLLM's own loader) and our trainer engine; its request dataclasses carry our init and update
info; its ``WeightSource`` contract (0.33: ``metadata`` a ``functools.cached_property``, checked
when a class is created; ``iter_full``/``iter_local`` and ownership) holds for our sources. Then a
push from the trainer must load the trainer's exact weights into vLLM's model.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from examples.vllm_sync import model as tiny

RELEASE_ENV = "TRANSPORT_TEST_VLLM_RELEASE"  # the release test_vllm_versions.py runs this module under


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ownership() -> bool:
    """Whether this vLLM's ``ParamMeta`` carries ownership (0.33 on)."""
    import dataclasses

    return "owners" in {f.name for f in dataclasses.fields(ParamMeta)}


class World:
    """One vLLM worker's setting in this process: the tiny checkpoint, vLLM's configs (the
    ``transport`` weight-transfer backend), vLLM's distributed state (TP 1, gloo)."""

    def __init__(self, work: Any) -> None:
        from vllm.config import ModelConfig, WeightTransferConfig, set_current_vllm_config
        from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

        self.work = work
        self.path = str(tiny.build(work / "model"))
        self.model_config = ModelConfig(model=self.path, dtype="float32", max_model_len=128, enforce_eager=True,
                                        seed=0)
        self.transfer = WeightTransferConfig(backend="transport")
        self.config = self.vllm_config()
        with set_current_vllm_config(self.config):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
            initialize_model_parallel(1, 1)

    def vllm_config(self) -> Any:
        """vLLM's config of one engine (each model needs its own: its layers register there)."""
        from vllm.config import ParallelConfig, VllmConfig

        return VllmConfig(model_config=self.model_config, parallel_config=ParallelConfig(),
                          weight_transfer_config=self.transfer)

    def model(self, weights: Iterator[tuple[str, torch.Tensor]] | None = None) -> torch.nn.Module:
        """A vLLM model as vLLM's loader makes one (its ``load_model`` less the accelerator
        calls a CPU torch refuses): from the checkpoint (the worker's, under :attr:`config`), or
        from ``weights`` (HF names; an engine config of its own)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.utils.torch_utils import set_default_torch_dtype

        config = self.config if weights is None else self.vllm_config()
        loader = get_model_loader(config.load_config)
        with set_current_vllm_config(config), set_default_torch_dtype(self.model_config.dtype), torch.no_grad():
            model = loader.create_model(vllm_config=config, model_config=self.model_config)
            if weights is None:
                loader.load_weights(model, self.model_config)
            else:
                model.load_weights(weights)
            process_weights_after_loading(model, self.model_config, torch.device("cpu"))
        return model.eval()


class InProcessWorker:
    """A ``VLLMWeightSyncClient`` that is vLLM's worker itself, minus the RPC: its weight-sync
    methods (``vllm/v1/worker/gpu_worker.py``) on an engine built by vLLM's factory."""

    def __init__(self, world: World, model: torch.nn.Module) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        self.world, self.model = world, model
        with set_current_vllm_config(world.config):
            self.engine = WeightTransferEngineFactory.create_engine(world.transfer, world.config, torch.device("cpu"),
                                                                    model)
        self.weight_version: str | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        request = WeightTransferInitRequest(init_info=init_info)  # what LLM / the HTTP route carry
        with set_current_vllm_config(self.world.config):
            self.engine.init_transfer_engine(self.engine.parse_init_info(request.init_info))

    def start_weight_update(self) -> None:
        self.engine.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        request = WeightTransferUpdateRequest(update_info=update_info)
        with set_current_vllm_config(self.world.config):
            self.engine.update_weights(request.update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.world.config):
            self.engine.finish_weight_update()
        self.weight_version = weight_version


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what vLLM runs in each of its processes: our entry point registers the backend
    return World(tmp_path_factory.mktemp("vllm-contract"))


@pytest.fixture(scope="module")
def worker(world):
    w = InProcessWorker(world, world.model())
    yield w
    w.engine.shutdown()


def matches(model: torch.nn.Module, other: torch.nn.Module) -> bool:
    """Whether two vLLM models hold the same tensors (after vLLM's processing of each)."""
    a, b = dict(model.state_dict(keep_vars=True)), dict(other.state_dict(keep_vars=True))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def perturbed(world: World, seed: int) -> torch.nn.Module:
    """The trainer's ``transformers`` model, moved away from the checkpoint."""
    ref = tiny.load(world.path)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1 * p.std())
    return ref


def meta(name: str, t: torch.Tensor, owners: tuple[int, ...] | None = None) -> ParamMeta:
    return ParamMeta(name, t.dtype, tuple(t.shape), **({"owners": owners} if owners else {}))


class PlainSource(WeightSource):
    """A whole-tensor ``WeightSource`` written to both releases' contracts: ``metadata`` a
    cached_property, ``iter_full`` (0.33) and iteration (0.32), ``held_names`` (0.32)."""

    def __init__(self, tensors: dict[str, torch.Tensor], *, owners: dict[str, tuple[int, ...]] | None = None) -> None:
        self.tensors, self.owners = tensors, owners or {}

    @functools.cached_property
    def metadata(self) -> list[ParamMeta]:
        return [meta(n, t, self.owners.get(n) if _ownership() else None) for n, t in self.tensors.items()]

    def held_names(self) -> list[str] | None:  # vLLM 0.32's ownership: this rank's (rank 0 here)
        return [n for n in self.tensors if 0 in self.owners.get(n, (0,))]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.tensors.items()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.iter_full()


def trainer(world: World, worker: InProcessWorker, source: Any, stream: str, **kw: Any) -> Any:
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from transport.vllm import TransportTrainerInitInfo

    info = TransportTrainerInitInfo(rank=kw.pop("rank", 0), store=f"file://{world.work / 'store'}", stream=stream,
                                    engines=["engine-0"], timeout=20, **kw)
    return WeightTransferTrainerFactory.trainer_init(info, client=worker, source=source)


# -- the release, the plugin, the factories ------------------------------------------------------


def test_vllm_is_the_release_under_test():
    import vllm

    release = os.environ.get(RELEASE_ENV)
    if release is None:
        pytest.fail(f"run by tests/weights/test_vllm_versions.py, which sets {RELEASE_ENV}")
    assert vllm.__version__.split("+")[0].startswith(release + "."), (vllm.__version__, vllm.__file__)
    assert torch.__version__.endswith("+cpu"), torch.__version__


def test_vllm_plugins_register_the_backend_in_both_factories(world):
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from transport.vllm import TransportTrainerEngine, TransportWeightTransferEngine, register

    assert WeightTransferEngineFactory._registry["transport"]() is TransportWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["transport"]() is TransportTrainerEngine
    register()  # vLLM may run plugins again in one process: no second registration error
    assert WeightTransferEngineFactory._registry["transport"]() is TransportWeightTransferEngine


def test_the_worker_engine_from_vllms_factory_is_ours_and_its_client_is_vllms_protocol(world, worker):
    from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient, WeightTransferEngine

    from transport.vllm import LLMClient, TransportWeightTransferEngine

    assert type(worker.engine) is TransportWeightTransferEngine
    assert isinstance(worker.engine, WeightTransferEngine)
    assert worker.engine.supports_draft_weight_update is False
    assert isinstance(LLMClient(None), VLLMWeightSyncClient) and isinstance(worker, VLLMWeightSyncClient)


def test_init_and_update_info_travel_as_vllm_requests(world, worker):
    from vllm.distributed.weight_transfer.base import (
        TrainerInitInfo,
        WeightTransferInitRequest,
        WeightTransferUpdateRequest,
    )

    from transport.vllm import TransportInitInfo, TransportTrainerInitInfo, TransportUpdateInfo

    info = TransportInitInfo(store="file:///tmp/x", engine="e", backends=["ipc"], receive="slices", timeout=5.0)
    request = WeightTransferInitRequest(init_info=info.to_dict())
    assert worker.engine.parse_init_info(request.init_info) == info
    update = WeightTransferUpdateRequest(update_info={"version": 3, "timeout": 1.5})
    assert worker.engine.parse_update_info(update.update_info) == TransportUpdateInfo(version=3, timeout=1.5)
    with pytest.raises(ValueError, match="Invalid update_info"):
        worker.engine.parse_update_info({"bogus": 1})
    with pytest.raises(ValueError, match="version must be an int"):
        worker.engine.parse_update_info({"version": -1})
    with pytest.raises(ValueError, match="Invalid init_info"):
        worker.engine.parse_init_info({"store": "file:///tmp/x", "engine": "e", "bogus": 1})
    assert issubclass(TransportTrainerInitInfo, TrainerInitInfo) and TransportTrainerInitInfo.backend == "transport"
    assert TransportTrainerInitInfo(rank=1, store="file:///tmp/x").is_sender is False
    with pytest.raises(TypeError, match="rank"):
        TransportTrainerInitInfo(store="file:///tmp/x")  # type: ignore[call-arg]


# -- sources -------------------------------------------------------------------------------------


def test_shard_source_metadata_is_a_cached_property_fixed_at_first_read(world):
    from transport.vllm import ShardSource

    assert isinstance(ShardSource.__dict__["metadata"], functools.cached_property)
    tensors = {"a.weight": torch.zeros(4, 3), "b.bias": torch.zeros(5, dtype=torch.bfloat16)}
    source = ShardSource(tensors)
    assert isinstance(source, WeightSource)
    first = source.metadata
    assert [(m.name, m.dtype, tuple(m.shape)) for m in first] == [
        ("a.weight", torch.float32, (4, 3)), ("b.bias", torch.bfloat16, (5,))]
    tensors["c.weight"] = torch.zeros(2)  # the module changes after the first read ...
    assert source.metadata is first and len(source.metadata) == 2  # ... its metadata does not


def test_shard_source_declares_a_dtensor_as_vllm_does_and_yields_this_ranks_pieces(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from transport.vllm import ShardSource

    mesh = init_device_mesh("cpu", (1,))
    full = torch.arange(12.0).reshape(4, 3)
    source = ShardSource({"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.ones(3)})
    (w, b) = source.metadata
    assert (w.name, tuple(w.shape), b.name, tuple(b.shape)) == ("w", (4, 3), "b", (3,))  # full shapes
    pieces = list(source.iter_local())
    assert [n for n, _ in pieces] == ["w", "b"] and torch.equal(pieces[0][1], full)  # one rank: its piece is whole
    assert not isinstance(pieces[0][1], type(source.state()["w"]))  # a local tensor, not the DTensor
    if _ownership():
        from vllm.distributed.weight_transfer.base import Shard as VShard

        assert (w.owners, w.mesh_shape, w.placements) == ((0,), (1,), (VShard(0),))
        assert b.owners is None
        assert source.owned_names(0) == ["w", "b"] and source.owned_names(1) == ["b"]
        assert source.implements_iter_local() and not source.implements_iter_full()


def test_vllm_rejects_a_source_whose_metadata_is_not_a_cached_property(world):
    if not _ownership():
        pytest.skip("vLLM 0.32 declares metadata a method and checks nothing when a source class is made")
    with pytest.raises(TypeError, match=r"metadata must be a functools\.cached_property"):
        type("Bad", (WeightSource,), {"metadata": lambda self: []})  # the check that broke ShardSource


# -- pushes --------------------------------------------------------------------------------------


def test_a_push_through_vllms_factories_loads_the_trainers_weights(world, worker):
    from vllm.distributed.weight_transfer.base import ModuleSource

    ref = perturbed(world, seed=1)
    expected = world.model(iter(list(ref.named_parameters())))  # vLLM's own load of the trainer's weights
    assert not matches(worker.model, expected)  # a push that did nothing fails below
    eng = trainer(world, worker, ModuleSource(ref), "module")
    try:
        report = eng.send_weights()
        assert report.loaded == ["engine-0"], report.engines
        assert matches(worker.model, expected)
        assert worker.engine.loaded == report.version and worker.weight_version == str(report.version)
        with torch.no_grad():
            for p in ref.parameters():
                p.mul_(0.5)
        report = eng.send_weights()  # the next version loads too (only what changed, through vLLM's reload)
        assert report.loaded == ["engine-0"], report.engines
        assert matches(worker.model, world.model(iter(list(ref.named_parameters()))))
    finally:
        eng.shutdown()


def test_a_shard_source_push_loads_the_trainers_weights(world, worker):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from transport.vllm import ShardSource, TransportTrainerEngine

    ref = perturbed(world, seed=2)
    expected = world.model(iter(list(ref.named_parameters())))
    mesh = init_device_mesh("cpu", (1,))  # FSDP2's layout (dim 0 sharded) over this one trainer rank
    shards = {n: distribute_tensor(p.detach(), mesh, [Shard(0)]) for n, p in ref.named_parameters()}
    eng = trainer(world, worker, ShardSource(shards), "shards")
    try:
        assert isinstance(eng, TransportTrainerEngine) and eng.sharded
        report = eng.send_weights()
        assert report.loaded == ["engine-0"], report.engines
        assert matches(worker.model, expected)
    finally:
        eng.shutdown()


def test_a_shard_source_whose_module_changed_after_its_metadata_is_refused(world, worker):
    from transport.vllm import ShardSource

    tensors = dict(tiny.load(world.path).named_parameters())
    source = ShardSource(tensors)
    assert len(source.metadata) == len(tensors)  # read (and fixed) here
    tensors["model.extra.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match="does not describe its module"):
        trainer(world, worker, source, "changed")


def test_a_whole_tensor_source_needs_rank_0_to_own_every_tensor(world, worker):
    tensors = {"model.norm.weight": torch.ones(128), "lm_head.weight": torch.zeros(256, 128)}
    with pytest.raises(ValueError, match=r"does not own 1 of them \['lm_head.weight'\]"):
        trainer(world, worker, PlainSource(tensors, owners={"lm_head.weight": (1,)}), "owners")


def test_a_source_without_full_tensors_is_refused(world, worker):
    if not _ownership():
        pytest.skip("vLLM 0.32 sources always iterate full tensors (iteration is abstract there)")

    class LocalOnly(WeightSource):
        @functools.cached_property
        def metadata(self) -> list[ParamMeta]:
            return [meta("lm_head.weight", torch.zeros(2))]

        def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
            yield "lm_head.weight", torch.zeros(2)

    with pytest.raises(TypeError, match="does not implement iter_full"):
        trainer(world, worker, LocalOnly(), "local")
