"""Model layouts (transport.plan._models and _vllm): Hugging Face checkpoint tensors sharded as an FSDP2/TP
trainer holds them, vLLM TP/EP generator ranks, and the plans between them executed with numpy.

Every global element gets a distinct integer, each trainer rank's shard is cut from the full
tensors by its box, every move is copied through ``Planner.segments`` into zeroed local tensors,
and each local tensor is compared bit for bit with (1) the tensor built from its pieces and
(2) an independent numpy rendering of vLLM's layout (np.split / np.concatenate of the full
tensors, as vLLM's weight loaders cut them). Every element a piece covers is written exactly
once; vocabulary padding rows never.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import types
from pathlib import Path

import numpy as np
import pytest

from tests.plan._cases import reference
from transport.plan import (
    BUILTIN_MODELS,
    ITEMSIZE,
    MeshLayoutError,
    ModelConfig,
    Planner,
    Replica,
    TrainerLayout,
    builtin_model,
    checkpoint_tensors,
    generator_rank,
    generator_replica,
    model_config,
    parameter_count,
    trainer_layout,
    volume,
)

Arrays = dict[str, np.ndarray]

LLAMA_MEDIUM = model_config({  # big enough that shared (HSDP) parts are cut over several holders
    "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 4, "intermediate_size": 1024, "vocab_size": 4000,
})
QWEN2_TINY = model_config({  # q/k/v biases, tied embeddings, a vocabulary whose last tp=4 rank is all padding
    "model_type": "qwen2", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 48, "vocab_size": 70, "tie_word_embeddings": True,
})
QWEN3_TINY = model_config(types.SimpleNamespace(  # a transformers-like object; attention_bias: q/k/v and o biases
    model_type="qwen3", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
    head_dim=16, intermediate_size=64, vocab_size=200, attention_bias=True, tie_word_embeddings=False,
))
MLA_NO_QLORA = dataclasses.replace(builtin_model("mla-tiny"), q_lora_rank=None)


# --- executing plans with numpy -------------------------------------------------------------------


def hf_globals(cfg: ModelConfig) -> Arrays:
    """Every unstacked checkpoint tensor, filled with distinct integers starting at 1."""
    out, at = {}, 1
    for name, shape in checkpoint_tensors(cfg):
        n = int(np.prod(shape))
        out[name] = np.arange(at, at + n, dtype=np.int64).reshape(shape)
        at += n
    return out


def stack_globals(cfg: ModelConfig, full: Arrays) -> Arrays:
    """The stacked virtual tensors built from the unstacked ones: a ``*`` stacks every layer
    (then expert) index for which the name exists, in order."""
    out = {}
    for name, shape in checkpoint_tensors(cfg, stacked=True):
        if "*" not in name:
            out[name] = full[name]
            continue
        layers = [i for i in range(cfg.num_hidden_layers) if any(k.startswith(f"model.layers.{i}.")
                                                                  and _matches(name, k) for k in full)]
        if name.count("*") == 1:
            out[name] = np.stack([full[name.replace("*", str(i))] for i in layers])
        else:
            out[name] = np.stack([np.stack([full[name.replace("*", str(i), 1).replace("*", str(e))]
                                            for e in range(cfg.num_experts)]) for i in layers])
        assert out[name].shape == shape, name
    return out


def _matches(pattern: str, name: str) -> bool:
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name) is not None


def shards(trainer: TrainerLayout, full: Arrays) -> dict[tuple[str, int], np.ndarray]:
    """Each trainer rank's contiguous shard of each tensor, cut by its box."""
    out = {}
    for t in trainer.tensors:
        for rank, box in t.sharding.boxes(t.shape).items():
            out[t.name, rank] = np.ascontiguousarray(full[t.name][tuple(slice(lo, hi) for lo, hi in box)])
    return out


def _run_indices(offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The element indices of runs ``[offsets[i], offsets[i] + lengths[i])``, concatenated."""
    if not len(lengths):
        return np.zeros(0, np.int64)
    starts = np.repeat(offsets - np.cumsum(lengths) + lengths, lengths)
    return starts + np.arange(int(lengths.sum()), dtype=np.int64)


def execute(trainer: TrainerLayout, replica: Replica, full: Arrays) -> tuple[list[Arrays], list[Arrays]]:
    """Plans ``replica`` and copies every move: the local tensors and write counts per rank."""
    planner = Planner(trainer)
    plan = planner.plan([replica])
    held = shards(trainer, full)
    outs, counts = [], []
    for g, rp in zip(replica.ranks, plan.replicas[replica.id].ranks, strict=True):
        by_name = {lt.name: lt for lt in g.tensors}
        out = {lt.name: np.zeros(lt.shape, np.int64) for lt in g.tensors}
        cnt = {lt.name: np.zeros(lt.shape, np.int64) for lt in g.tensors}
        for m in rp.moves:
            lt = by_name[m.dst_tensor]
            s, d, n = planner.segments(m, lt)
            si, di = _run_indices(s, n), _run_indices(d, n)
            out[lt.name].reshape(-1)[di] = held[m.name, m.src].reshape(-1)[si]
            np.add.at(cnt[lt.name].reshape(-1), di, 1)
            assert m.nbytes == volume(m.box) * ITEMSIZE[lt.dtype]
        assert rp.nbytes == sum(volume(p.box) * ITEMSIZE[lt.dtype] for lt in g.tensors for p in lt.pieces)
        outs.append(out)
        counts.append(cnt)
    return outs, counts


def from_pieces(replica: Replica, g: int, full: Arrays) -> tuple[Arrays, Arrays]:
    """Rank ``g``'s local tensors assembled straight from the pieces, and the piece coverage."""
    out, cover = {}, {}
    for lt in replica.ranks[g].tensors:
        out[lt.name], cover[lt.name] = reference(lt, full, np.int64)
    return out, cover


# --- vLLM's layout, independently, with numpy -----------------------------------------------------


def vllm_expected(cfg: ModelConfig, f: Arrays, tp: int, ep: int, r: int) -> Arrays:
    """What vLLM's weight loaders put on TP rank ``r`` (unstacked names), from the full tensors."""
    out: Arrays = {}
    h, v = cfg.hidden_size, cfg.vocab_size
    vp = -(-v // 64) * 64

    def vocab(name: str) -> np.ndarray:
        padded = np.zeros((vp, h), np.int64)
        padded[:v] = f[name]
        return np.split(padded, tp)[r]

    def mlp(p: str) -> None:
        out[p + "gate_up_proj.weight"] = np.concatenate([np.split(f[p + "gate_proj.weight"], tp)[r],
                                                          np.split(f[p + "up_proj.weight"], tp)[r]])
        out[p + "down_proj.weight"] = np.split(f[p + "down_proj.weight"], tp, axis=1)[r]

    out["model.embed_tokens.weight"] = vocab("model.embed_tokens.weight")
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = vocab("lm_head.weight")
    out["model.norm.weight"] = f["model.norm.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + n] = f[p + n]
        if cfg.architecture == "mla":
            if cfg.q_lora_rank is not None:
                out[a + "fused_qkv_a_proj.weight"] = np.concatenate([f[a + "q_a_proj.weight"],
                                                                     f[a + "kv_a_proj_with_mqa.weight"]])
                out[a + "q_a_layernorm.weight"] = f[a + "q_a_layernorm.weight"]
                out[a + "q_b_proj.weight"] = np.split(f[a + "q_b_proj.weight"], tp)[r]  # rows are head-major
            else:
                out[a + "q_proj.weight"] = np.split(f[a + "q_proj.weight"], tp)[r]
                out[a + "kv_a_proj_with_mqa.weight"] = f[a + "kv_a_proj_with_mqa.weight"]
            out[a + "kv_a_layernorm.weight"] = f[a + "kv_a_layernorm.weight"]
            out[a + "kv_b_proj.weight"] = np.split(f[a + "kv_b_proj.weight"], tp)[r]
        else:
            kv, hd = cfg.num_key_value_heads, cfg.head_dim

            def kv_part(x: np.ndarray, kv: int = kv) -> np.ndarray:
                if kv >= tp:
                    return np.split(x, tp)[r]
                return np.split(x, kv)[r // (tp // kv)]  # kv heads replicated over tp // kv ranks

            kinds = ["weight", "bias"] if cfg.attention_bias else ["weight"]
            for kind in kinds:
                out[a + f"qkv_proj.{kind}"] = np.concatenate([np.split(f[a + f"q_proj.{kind}"], tp)[r],
                                                              kv_part(f[a + f"k_proj.{kind}"]),
                                                              kv_part(f[a + f"v_proj.{kind}"])])
                rows = (cfg.num_attention_heads // tp + 2 * max(1, kv // tp)) * hd
                assert out[a + f"qkv_proj.{kind}"].shape[0] == rows
            if cfg.o_proj_bias:
                out[a + "o_proj.bias"] = f[a + "o_proj.bias"]
            if cfg.qk_norm:
                out[a + "q_norm.weight"] = f[a + "q_norm.weight"]
                out[a + "k_norm.weight"] = f[a + "k_norm.weight"]
        out[a + "o_proj.weight"] = np.split(f[a + "o_proj.weight"], tp, axis=1)[r]
        if i in cfg.dense_layers:
            mlp(p + "mlp.")
            continue
        out[p + "mlp.gate.weight"] = f[p + "mlp.gate.weight"]
        if cfg.router_bias:
            out[p + "mlp.gate.e_score_correction_bias"] = f[p + "mlp.gate.e_score_correction_bias"]
        if cfg.n_shared_experts:
            mlp(p + "mlp.shared_experts.")
        gtp = tp // ep
        group, t = divmod(r, gtp)
        experts = np.split(np.arange(cfg.num_experts), ep)[group]
        e = p + "mlp.experts."
        out[e + "w13_weight"] = np.stack([np.concatenate([np.split(f[f"{e}{x}.gate_proj.weight"], gtp)[t],
                                                          np.split(f[f"{e}{x}.up_proj.weight"], gtp)[t]])
                                          for x in experts])
        out[e + "w2_weight"] = np.stack([np.split(f[f"{e}{x}.down_proj.weight"], gtp, axis=1)[t] for x in experts])
    return out


def stack_expected(cfg: ModelConfig, unstacked: Arrays, names: list[str]) -> Arrays:
    """The stacked local tensors from the unstacked ones: a ``*`` stacks the layers that have the name."""
    out = {}
    for name in names:
        if "*" not in name:
            out[name] = unstacked[name]
            continue
        out[name] = np.stack([unstacked[name.replace("*", str(i))] for i in range(cfg.num_hidden_layers)
                              if name.replace("*", str(i)) in unstacked])
    return out


# --- the executed plans ---------------------------------------------------------------------------

CASES = [
    # (model, trainer spec, tp, ep, stacked, dtype)
    ("llama-tiny", "fsdp=4", 2, 1, False, "bfloat16"),
    ("llama-tiny", "fsdp=4", 2, 1, True, "bfloat16"),
    ("llama-tiny", "dp=2,fsdp=2", 4, 1, False, "bfloat16"),
    ("llama-tiny", "fsdp=2,tp=2", 8, 1, True, "bfloat16"),  # kv heads replicated (2 kv heads, tp=8)
    ("llama-tiny", "fsdp=3,tp=2", 8, 1, False, "float8_e4m3fn"),  # uneven FSDP chunks, strided with TP
    ("llama-tiny", "tp=4", 1, 1, False, "bfloat16"),
    ("moe-tiny", "fsdp=4", 2, 1, False, "bfloat16"),
    ("moe-tiny", "fsdp=4", 2, 1, True, "bfloat16"),
    ("moe-tiny", "fsdp=2,tp=2", 4, 2, False, "bfloat16"),
    ("moe-tiny", "dp=2,fsdp=2", 4, 4, True, "bfloat16"),
    ("moe-tiny", "dp=2,fsdp=3,tp=2", 8, 2, False, "float8_e4m3fn"),
    ("mla-tiny", "fsdp=4", 2, 1, False, "bfloat16"),
    ("mla-tiny", "fsdp=4", 2, 1, True, "bfloat16"),
    ("mla-tiny", "fsdp=2,tp=2", 4, 2, False, "bfloat16"),
    ("mla-tiny", "dp=2,fsdp=2,tp=2", 8, 8, True, "float8_e4m3fn"),
    ("mla-no-qlora", "fsdp=3", 2, 2, False, "bfloat16"),
    ("mla-no-qlora", "fsdp=3", 4, 1, True, "bfloat16"),
    ("qwen2-tiny", "fsdp=2", 4, 1, False, "bfloat16"),
    ("qwen2-tiny", "fsdp=2,tp=2", 2, 1, True, "bfloat16"),
    ("qwen3-tiny", "fsdp=2,tp=2", 2, 1, False, "bfloat16"),
    ("qwen3-tiny", "dp=3", 4, 1, True, "bfloat16"),
    ("llama-medium", "dp=2,fsdp=2", 2, 1, False, "float32"),
    ("llama-medium", "dp=2,fsdp=2,tp=2", 4, 1, True, "float32"),
]
MODELS = {"mla-no-qlora": MLA_NO_QLORA, "qwen2-tiny": QWEN2_TINY, "qwen3-tiny": QWEN3_TINY,
          "llama-medium": LLAMA_MEDIUM}


def _model(name: str) -> ModelConfig:
    return MODELS[name] if name in MODELS else builtin_model(name)


def _padding_rows(cfg: ModelConfig, tp: int, r: int, name: str) -> int:
    per = -(-cfg.vocab_size // 64) * 64 // tp
    return per - max(0, min(per, cfg.vocab_size - r * per)) if name in ("model.embed_tokens.weight",
                                                                        "lm_head.weight") else 0


@pytest.mark.parametrize(("model", "spec", "tp", "ep", "stacked", "dtype"), CASES,
                         ids=[f"{c[0]}-{c[1]}-tp{c[2]}-ep{c[3]}{'-stacked' if c[4] else ''}" for c in CASES])
def test_plan_executes_to_vllm_layout(model: str, spec: str, tp: int, ep: int, stacked: bool, dtype: str) -> None:
    cfg = _model(model)
    hf = hf_globals(cfg)
    full = stack_globals(cfg, hf) if stacked else hf
    trainer = trainer_layout(cfg, spec, stacked=stacked)
    assert {t.name: t.shape for t in trainer.tensors} == dict(checkpoint_tensors(cfg, stacked=stacked))
    replica = generator_replica(cfg, "r0", tp=tp, ep=ep, dtype=dtype, stacked=stacked)
    assert len(replica.ranks) == tp
    outs, counts = execute(trainer, replica, full)
    for g in range(tp):
        assert replica.ranks[g] == generator_rank(cfg, tp=tp, rank=g, ep=ep, dtype=dtype, stacked=stacked)
        ref, cover = from_pieces(replica, g, full)
        expected = vllm_expected(cfg, hf, tp, ep, g)
        if stacked:
            expected = stack_expected(cfg, expected, list(outs[g]))
        assert sorted(outs[g]) == sorted(expected)
        for name, got in outs[g].items():
            where = f"rank {g} {name}"
            assert got.shape == expected[name].shape, where
            np.testing.assert_array_equal(got, ref[name], err_msg=where)
            np.testing.assert_array_equal(got, expected[name], err_msg=where)
            assert cover[name].max(initial=0) <= 1, where  # pieces do not overlap
            np.testing.assert_array_equal(counts[g][name], cover[name], err_msg=where)  # each piece element once
            pad = _padding_rows(cfg, tp, g, name)
            assert int((cover[name] == 0).sum()) == pad * cfg.hidden_size, where  # only padding rows unwritten
            if pad:
                assert not counts[g][name][-pad:].any(), where
        for lt in replica.ranks[g].tensors:
            fused = any(k in lt.name for k in ("proj", "experts"))
            assert lt.dtype == (dtype if fused else ("bfloat16" if ITEMSIZE[dtype] == 1 else dtype)), lt.name


def test_trainer_shards_cover_every_element_equally() -> None:
    for model, spec in [("mla-tiny", "dp=2,fsdp=3,tp=2"), ("moe-tiny", "fsdp=5,tp=2"), ("llama-tiny", "dp=3")]:
        cfg = builtin_model(model)
        for stacked in (False, True):
            trainer = trainer_layout(cfg, spec, stacked=stacked)
            world = int(np.prod([int(x.split("=")[1]) for x in spec.split(",")]))
            assert trainer.ranks() == list(range(world))
            for t in trainer.tensors:
                held = np.zeros(t.shape, np.int64)
                for box in t.sharding.boxes(t.shape).values():
                    held[tuple(slice(lo, hi) for lo, hi in box)] += 1
                assert held.min() >= 1 and held.min() == held.max(), (spec, t.name)


# --- shapes and shardings by hand -----------------------------------------------------------------


def _shapes(g: object) -> dict[str, tuple[int, ...]]:
    return {t.name: t.shape for t in g.tensors}  # type: ignore[attr-defined]


def test_llama_tiny_tp2_vllm_shapes_by_hand() -> None:
    cfg = builtin_model("llama-tiny")  # hidden 64, 8 heads of 8, 2 kv heads, intermediate 128, vocab 1000
    s = _shapes(generator_rank(cfg, tp=2, rank=1))
    assert s["model.layers.0.self_attn.qkv_proj.weight"] == ((4 + 2 * 1) * 8, 64)
    assert s["model.layers.0.self_attn.o_proj.weight"] == (64, 32)
    assert s["model.layers.1.mlp.gate_up_proj.weight"] == (128, 64)
    assert s["model.layers.1.mlp.down_proj.weight"] == (64, 64)
    assert s["model.embed_tokens.weight"] == s["lm_head.weight"] == (512, 64)  # 1000 padded to 1024
    lm = next(t for t in generator_rank(cfg, tp=2, rank=1).tensors if t.name == "lm_head.weight")
    assert [(p.box, p.local) for p in lm.pieces] == [(((512, 1000), (0, 64)), ((0, 488), (0, 64)))]
    qkv = next(t for t in generator_rank(cfg, tp=8, rank=5).tensors
               if t.name == "model.layers.0.self_attn.qkv_proj.weight")
    assert qkv.shape == (8 + 8 + 8, 64)  # one q head, one (replicated) kv head
    assert [(p.name.rsplit(".", 2)[-2], p.box[0], p.local[0]) for p in qkv.pieces] == [
        ("q_proj", (40, 48), (0, 8)), ("k_proj", (8, 16), (8, 16)), ("v_proj", (8, 16), (16, 24))]  # kv head 5 // 4


def test_moe_and_mla_vllm_shapes_by_hand() -> None:
    moe = builtin_model("moe-tiny")  # 8 experts, moe_intermediate 32
    s = _shapes(generator_rank(moe, tp=4, rank=3, ep=2))
    assert s["model.layers.0.mlp.experts.w13_weight"] == (4, 2 * 16, 64)
    assert s["model.layers.0.mlp.experts.w2_weight"] == (4, 64, 16)
    assert s["model.layers.1.mlp.gate.weight"] == (8, 64)
    assert s["model.layers.1.self_attn.q_norm.weight"] == (8,)
    w13 = next(t for t in generator_rank(moe, tp=4, rank=3, ep=2).tensors
               if t.name == "model.layers.0.mlp.experts.w13_weight")
    first = w13.pieces[0]  # expert 4 (group 1), rows 16..32 of its gate_proj, as a 2-D box into 3-D
    assert (first.name, first.box, first.local) == ("model.layers.0.mlp.experts.4.gate_proj.weight",
                                                    ((16, 32), (0, 64)), ((0, 1), (0, 16), (0, 64)))
    s = _shapes(generator_rank(moe, tp=4, rank=3, ep=2, stacked=True))
    assert s["model.layers.*.mlp.experts.w13_weight"] == (2, 4, 32, 64)

    mla = builtin_model("mla-tiny")  # 8 heads, q_lora 24, kv_lora 16, nope 8, rope 4, v 8, 1 dense layer
    s = _shapes(generator_rank(mla, tp=2, rank=0))
    assert s["model.layers.0.self_attn.fused_qkv_a_proj.weight"] == (24 + 16 + 4, 64)
    assert s["model.layers.0.self_attn.q_b_proj.weight"] == (4 * 12, 24)
    assert s["model.layers.0.self_attn.kv_b_proj.weight"] == (4 * 16, 16)
    assert s["model.layers.0.self_attn.o_proj.weight"] == (64, 4 * 8)
    assert s["model.layers.0.mlp.gate_up_proj.weight"] == (96, 64)
    assert s["model.layers.1.mlp.shared_experts.gate_up_proj.weight"] == (32, 64)
    assert s["model.layers.2.mlp.gate.e_score_correction_bias"] == (8,)
    assert "model.layers.1.mlp.gate_up_proj.weight" not in s


def test_checkpoint_names_and_stacks() -> None:
    mla = dict(checkpoint_tensors(builtin_model("mla-tiny")))
    assert mla["model.layers.0.self_attn.q_a_proj.weight"] == (24, 64)
    assert mla["model.layers.0.self_attn.q_a_layernorm.weight"] == (24,)
    assert mla["model.layers.0.self_attn.q_b_proj.weight"] == (8 * 12, 24)
    assert mla["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (16 + 4, 64)
    assert mla["model.layers.0.self_attn.kv_b_proj.weight"] == (8 * 16, 16)
    assert mla["model.layers.0.self_attn.o_proj.weight"] == (64, 8 * 8)
    assert mla["model.layers.2.mlp.experts.7.down_proj.weight"] == (64, 32)
    assert mla["model.layers.2.mlp.shared_experts.up_proj.weight"] == (32, 64)
    assert mla["model.layers.2.mlp.gate.weight"] == (8, 64)
    assert "model.layers.0.mlp.gate.weight" not in mla and "model.layers.1.mlp.gate_proj.weight" not in mla
    st = dict(checkpoint_tensors(builtin_model("mla-tiny"), stacked=True))
    assert st["model.layers.*.self_attn.q_a_proj.weight"] == (3, 24, 64)  # every layer
    assert st["model.layers.*.mlp.gate_proj.weight"] == (1, 96, 64)  # dense layers only
    assert st["model.layers.*.mlp.experts.*.gate_proj.weight"] == (2, 8, 32, 64)  # MoE layers x experts
    assert st["model.layers.*.mlp.gate.e_score_correction_bias"] == (2, 8)
    assert "lm_head.weight" not in dict(checkpoint_tensors(QWEN2_TINY))  # tied
    q2 = dict(checkpoint_tensors(QWEN2_TINY))
    assert q2["model.layers.1.self_attn.k_proj.bias"] == (16,) and "model.layers.1.self_attn.o_proj.bias" not in q2
    assert dict(checkpoint_tensors(QWEN3_TINY))["model.layers.0.self_attn.o_proj.bias"] == (32,)


def test_trainer_fsdp_and_tp_cut_tp_outer() -> None:
    cfg = builtin_model("llama-tiny")
    specs = trainer_layout(cfg, "fsdp=2,tp=2").by_name()
    q = specs["model.layers.0.self_attn.q_proj.weight"]  # [64, 64], both cut dim 0: TP chunks, FSDP inside
    rows = {r: box[0] for r, box in q.sharding.boxes(q.shape).items()}
    assert rows == {0: (0, 16), 2: (16, 32), 1: (32, 48), 3: (48, 64)}  # rank = f * tp + t
    o = specs["model.layers.0.self_attn.o_proj.weight"]  # FSDP rows, TP columns
    assert o.sharding.boxes(o.shape) == {0: ((0, 32), (0, 32)), 1: ((0, 32), (32, 64)),
                                         2: ((32, 64), (0, 32)), 3: ((32, 64), (32, 64))}
    n = specs["model.layers.0.input_layernorm.weight"]  # replicated over TP, FSDP-sharded
    assert n.sharding.boxes(n.shape) == {0: ((0, 32),), 1: ((0, 32),), 2: ((32, 64),), 3: ((32, 64),)}
    hs = trainer_layout(cfg, "dp=2,fsdp=2").by_name()["model.norm.weight"]
    assert hs.sharding.boxes(hs.shape) == {0: ((0, 32),), 1: ((32, 64),), 2: ((0, 32),), 3: ((32, 64),)}
    st = trainer_layout(builtin_model("moe-tiny"), "fsdp=4,tp=2", stacked=True).by_name()
    e = st["model.layers.*.mlp.experts.*.gate_proj.weight"]  # [2, 8, 32, 64]: member dim 0 is dim 2
    assert e.sharding.boxes(e.shape)[3] == ((0, 2), (0, 8), (20, 24), (0, 64))  # f=1, t=1: 16 + chunk 1 of 4
    mla = trainer_layout(builtin_model("mla-tiny"), "fsdp=4").by_name()
    bias = mla["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert set(bias.sharding.boxes(bias.shape).values()) == {((0, 8),)}  # a buffer: not sharded


# --- configs ----------------------------------------------------------------------------------------

OFFICIAL = {  # the fields of the public config.json files (plus keys this module ignores)
    "deepseek-v3": {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
                    "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280, "tie_word_embeddings": False,
                    "num_nextn_predict_layers": 1, "topk_method": "noaux_tc", "moe_layer_freq": 1},
    "kimi-k2": {"model_type": "kimi_k2", "hidden_size": 7168, "intermediate_size": 18432,
                "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
                "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 384,
                "first_k_dense_replace": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840, "tie_word_embeddings": False},
    "qwen3-235b-a22b": {"model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288,
                        "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64,
                        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "vocab_size": 151936,
                        "attention_bias": False, "tie_word_embeddings": False, "decoder_sparse_step": 1,
                        "mlp_only_layers": []},
    "llama3-70b": {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                   "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
                   "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False},
}


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_builtins_match_their_config_json(name: str, tmp_path: Path) -> None:
    assert model_config(OFFICIAL[name]) == builtin_model(name)
    (tmp_path / "config.json").write_text(json.dumps(OFFICIAL[name]))
    assert model_config(tmp_path) == model_config(tmp_path / "config.json") == builtin_model(name)
    assert model_config(types.SimpleNamespace(**OFFICIAL[name])) == builtin_model(name)
    wrapped = {"model_type": "kimi_k25", "text_config": OFFICIAL[name]}  # multimodal wrapper
    assert model_config(wrapped) == builtin_model(name)


# Published totals: DeepSeek-V3 671B (main model; the 14B multi-token-prediction module is not
# counted), Kimi-K2 "1T" (1.03T exactly by these shapes), Qwen3-235B-A22B 235B, Llama-3-70B
# 70.6B. Our count is the checkpoint's tensors, so it matches to rounding; 1% (3% for the
# round "1T") leaves room for the published figures' rounding only.
@pytest.mark.parametrize(("name", "published", "rel"), [
    ("deepseek-v3", 671e9, 0.01), ("kimi-k2", 1.0e12, 0.03), ("qwen3-235b-a22b", 235e9, 0.01),
    ("llama3-70b", 70.6e9, 0.01)])
def test_builtin_parameter_counts(name: str, published: float, rel: float) -> None:
    assert parameter_count(builtin_model(name)) == pytest.approx(published, rel=rel)
    assert parameter_count(builtin_model(name)) == sum(int(np.prod(s)) for _, s in
                                                       checkpoint_tensors(builtin_model(name), stacked=True))


def test_errors_name_the_numbers() -> None:
    with pytest.raises(MeshLayoutError, match=r"'mistral'.*deepseek_v3.*llama.*qwen3_moe"):
        model_config({"model_type": "mistral", "hidden_size": 8})
    with pytest.raises(MeshLayoutError, match="hidden_size"):
        model_config({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 8})
    with pytest.raises(MeshLayoutError, match="kimi-k2"):
        builtin_model("nope")
    with pytest.raises(MeshLayoutError, match="config"):
        model_config("/nonexistent/dir/config.json")
    llama, moe = builtin_model("llama-tiny"), builtin_model("moe-tiny")
    with pytest.raises(MeshLayoutError, match=r"8 is not divisible by 3"):
        generator_replica(llama, "r", tp=3)
    with pytest.raises(MeshLayoutError, match=r"ep=3 must divide tp=4"):
        generator_replica(moe, "r", tp=4, ep=3)
    wide = dataclasses.replace(moe, num_attention_heads=64, num_key_value_heads=64, head_dim=1)
    with pytest.raises(MeshLayoutError, match=r"8 experts are not divisible by ep=16"):
        generator_replica(wide, "r", tp=16, ep=16)
    with pytest.raises(MeshLayoutError, match=r"moe_intermediate_size 32 is not divisible by tp/ep=64"):
        generator_replica(wide, "r", tp=64)
    twelve = dataclasses.replace(llama, num_key_value_heads=3, num_attention_heads=12, intermediate_size=96)
    with pytest.raises(MeshLayoutError, match=r"tp over num_key_value_heads=3: 4 is not divisible by 3"):
        generator_replica(twelve, "r", tp=4)
    with pytest.raises(MeshLayoutError, match=r"vocab 1000 padded to 1024 over tp=3: 1024 is not divisible by 3"):
        generator_replica(twelve, "r", tp=3)
    with pytest.raises(MeshLayoutError, match=r"ep=2 .*without experts"):
        generator_replica(llama, "r", tp=2, ep=2)
    with pytest.raises(MeshLayoutError, match=r"rank 2"):
        generator_rank(llama, tp=2, rank=2)
    with pytest.raises(MeshLayoutError, match=r"float7"):
        generator_replica(llama, "r", tp=2, dtype="float7")
    with pytest.raises(MeshLayoutError, match=r"mlp.intermediate size over tp=4: 90 is not divisible by 4"):
        generator_replica(dataclasses.replace(builtin_model("mla-tiny"), intermediate_size=90), "r", tp=4)
    for bad in ["fsdp=0", "zz=2", "fsdp=2,fsdp=2", "fsdp", "", "fsdp=2;tp=2"]:
        with pytest.raises(MeshLayoutError, match="trainer spec"):
            trainer_layout(llama, bad)


# --- cluster scale ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "spec", "tp", "ep", "dtype"), [
    ("kimi-k2", "fsdp=256", 16, 1, "bfloat16"),
    ("deepseek-v3", "dp=2,fsdp=16,tp=8", 8, 8, "float8_e4m3fn"),
    ("qwen3-235b-a22b", "fsdp=64", 8, 2, "bfloat16"),
])
def test_stacked_cluster_scale_plan_bytes(model: str, spec: str, tp: int, ep: int, dtype: str) -> None:
    cfg = builtin_model(model)
    t0 = time.perf_counter()
    trainer = trainer_layout(cfg, spec, stacked=True)
    replica = generator_replica(cfg, "r0", tp=tp, ep=ep, dtype=dtype, stacked=True)
    plan = Planner(trainer).plan([replica])
    print(f"{model} {spec} -> tp={tp} ep={ep}: {len(trainer.tensors)} tensors, layouts+plan "
          f"{time.perf_counter() - t0:.2f}s, {plan.nbytes / 1e12:.3f} TB")
    for g, (rank, rp) in enumerate(zip(replica.ranks, plan.replicas["r0"].ranks, strict=True)):
        pieces = sum(volume(p.box) * ITEMSIZE[lt.dtype] for lt in rank.tensors for p in lt.pieces)
        padding = sum(_padding_rows(cfg, tp, g, lt.name) * cfg.hidden_size * ITEMSIZE[lt.dtype] for lt in rank.tensors)
        assert rp.nbytes == pieces == sum(lt.nbytes for lt in rank.tensors) - padding
    # the experts are in there once per replica, whatever the sharding
    expert = sum(lt.nbytes for rank in replica.ranks for lt in rank.tensors if "experts.w" in lt.name)
    assert expert == len(cfg.moe_layers) * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size * \
        ITEMSIZE[dtype]


@pytest.mark.parametrize("name", list(BUILTIN_MODELS))
def test_every_builtin_builds_stacked(name: str) -> None:
    cfg = builtin_model(name)
    trainer = trainer_layout(cfg, "dp=2,fsdp=4,tp=2", stacked=True)
    replica = generator_replica(cfg, name, tp=8, ep=2 if cfg.num_experts else 1, stacked=True)
    replica.validate(trainer)
    assert sum(volume(p.box) for lt in replica.ranks[0].tensors for p in lt.pieces if ".experts." in p.name) \
        == (len(cfg.moe_layers) * cfg.num_experts // 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size // 4)
