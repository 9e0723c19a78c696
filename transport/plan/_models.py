"""Model shapes: the trainer-side tensors of a Hugging Face checkpoint, sharded as an FSDP2/TP
trainer holds them, and the local tensors of a vLLM tensor/expert-parallel generator rank.

Architectures: Llama 3, Qwen2, Qwen3 (dense, GQA; qwen2 has q/k/v biases, qwen3 q/k norms),
Qwen3-MoE (every layer MoE) and DeepSeek-V3 / Kimi-K2 (MLA attention, MoE with shared experts,
``first_k_dense_replace`` dense layers first). Pure Python: a model is read from a dict, a
``config.json`` or any object with a transformers config's attributes; nothing imports torch
or transformers.

Two naming modes. By default every tensor is one Hugging Face tensor (``model.layers.3.mlp.
experts.17.gate_proj.weight``). With ``stacked=True`` (cluster-scale simulation, where 60 layers
x 384 experts would be 70k tensors) the layer index is replaced by ``*`` and the tensors of the
layers that have that name are stacked into one virtual tensor with a leading layer dimension;
expert tensors have the expert index replaced by ``*`` too and a second, expert, dimension:
``model.layers.*.mlp.experts.*.gate_proj.weight`` is ``[L_moe, E, moe_inter, H]``. A ``*`` name
stacks exactly the layers whose tensor it names, in layer order, so the stacks differ by group:

* attention and the two layer norms: every layer;
* ``mlp.{gate,up,down}_proj``: the dense layers only (DeepSeek's ``first_k_dense_replace``);
* ``mlp.gate``, ``mlp.experts.*``, ``mlp.shared_experts``: the MoE layers only.

No name belongs to two groups in these architectures, so no ``*`` name is ambiguous. Generator
tensors are stacked over the same groups (``model.layers.*.mlp.experts.w13_weight`` is
``[L_moe, E_local, 2 * I_e, H]``), so layer ``k`` of a stack feeds layer ``k`` of its stack.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ._boxes import Box, Shape, full_box, volume
from ._layouts import (
    ITEMSIZE,
    GeneratorRank,
    LocalTensor,
    MeshLayoutError,
    MeshSharding,
    Piece,
    Placement,
    Replica,
    Replicate,
    Shard,
    TensorSpec,
    TrainerLayout,
)

#: Architectures by Hugging Face ``model_type`` (kimi_k2 is the deepseek_v3 architecture).
ARCHITECTURES: Mapping[str, str] = MappingProxyType({
    "llama": "dense", "qwen2": "dense", "qwen3": "dense",
    "qwen3_moe": "moe",
    "deepseek_v3": "mla", "kimi_k2": "mla",
})

#: vLLM pads the vocabulary of VocabParallelEmbedding / ParallelLMHead to a multiple of this.
VOCAB_PADDING = 64


@dataclass(frozen=True)
class ModelConfig:
    """The shapes of one model (the fields of its Hugging Face ``config.json`` that matter).

    ``attention_bias`` means q/k/v biases (qwen2 always has them); ``o_proj_bias`` a bias on
    o_proj (llama/qwen3 with ``attention_bias``). ``num_experts`` is 0 for a dense model. For
    MoE layers ``moe_intermediate_size`` is the intermediate size of one routed expert, and the
    shared experts (DeepSeek) form one MLP of ``moe_intermediate_size * n_shared_experts``.
    MLA fields (``q_lora_rank`` None: no q compression, a plain q_proj) are used by the
    deepseek_v3 architecture only; there ``num_key_value_heads`` equals the heads and
    ``head_dim`` is ``qk_nope_head_dim + qk_rope_head_dim`` (neither is used).
    """

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise MeshLayoutError(f"model_type {self.model_type!r} is not supported "
                              f"(supported: {', '.join(sorted(ARCHITECTURES))})")
        need = ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
        if self.architecture == "mla":
            need += ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
        else:
            need += ["num_key_value_heads", "head_dim"]
        if self.architecture != "dense":
            need += ["num_experts", "moe_intermediate_size"]
        for name in need:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise MeshLayoutError(f"{self.model_type}: {name} must be a positive int, got {value!r}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise MeshLayoutError(f"{self.model_type}: q_lora_rank must be positive or None, got {self.q_lora_rank}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise MeshLayoutError(f"{self.model_type}: first_k_dense_replace={self.first_k_dense_replace} is not in "
                              f"[0, {self.num_hidden_layers}]")
        if self.dense_layers and (not isinstance(self.intermediate_size, int) or self.intermediate_size < 1):
            raise MeshLayoutError(f"{self.model_type}: intermediate_size must be a positive int for its dense layers, "
                              f"got {self.intermediate_size!r}")

    @property
    def architecture(self) -> str:
        """``"dense"`` (llama, qwen2, qwen3), ``"moe"`` (qwen3_moe) or ``"mla"`` (deepseek_v3)."""
        return ARCHITECTURES[self.model_type]

    @property
    def dense_layers(self) -> range:
        """The layers with a dense MLP (all of a dense model, the first k of DeepSeek's)."""
        if self.architecture == "dense":
            return range(self.num_hidden_layers)
        if self.architecture == "moe":
            return range(0)
        return range(self.first_k_dense_replace)

    @property
    def moe_layers(self) -> range:
        """The layers with routed experts."""
        return range(len(self.dense_layers), self.num_hidden_layers)

    @property
    def router_bias(self) -> bool:
        """Whether MoE layers carry ``mlp.gate.e_score_correction_bias`` (DeepSeek-V3's noaux_tc)."""
        return self.architecture == "mla"


def _get(src: Any, key: str, default: Any = None) -> Any:
    if isinstance(src, Mapping):
        return src.get(key, default)
    return getattr(src, key, default)


def model_config(source: ModelConfig | Mapping[str, Any] | str | os.PathLike[str] | Any) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face model description.

    Args:
        source: a ModelConfig (returned as is); a dict of ``config.json``; a path to a
            ``config.json`` or to the directory that holds one; or a transformers config object
            (read duck-typed by attribute). A multimodal config whose own model_type is not
            supported but that has a ``text_config`` is read from that.

    Returns:
        The config. Qwen3-MoE's ``decoder_sparse_step`` / ``mlp_only_layers`` are ignored (every
        layer is MoE, as in the released models); multi-token-prediction layers
        (``num_nextn_predict_layers``) are not part of the model.

    Raises:
        MeshLayoutError: an unknown model_type (the message lists the supported ones), a missing or
            non-positive size, or a path without a readable ``config.json``.
    """
    if isinstance(source, ModelConfig):
        return source
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        try:
            source = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise MeshLayoutError(f"cannot read a model config from {path}: {e}") from e
    model_type = _get(source, "model_type")
    text = _get(source, "text_config")
    if model_type not in ARCHITECTURES and text is not None:
        return model_config(text)
    if model_type not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise MeshLayoutError(f"model_type {model_type!r} is not supported (supported: {supported})")
    arch = ARCHITECTURES[model_type]
    hidden = _get(source, "hidden_size")
    heads = _get(source, "num_attention_heads")
    head_dim = _get(source, "head_dim")
    if head_dim is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        head_dim = hidden // heads
    kv_heads = _get(source, "num_key_value_heads") or heads
    if _get(source, "mlp_bias", False):
        raise MeshLayoutError(f"{model_type}: mlp_bias=True is not supported")
    bias = bool(_get(source, "attention_bias", False))
    fields: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": _get(source, "num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": _get(source, "intermediate_size") or 0,
        "vocab_size": _get(source, "vocab_size"),
        "tie_word_embeddings": bool(_get(source, "tie_word_embeddings", False)),
        "attention_bias": True if model_type == "qwen2" else bias,
        "o_proj_bias": bias if model_type in ("llama", "qwen3", "qwen3_moe") else False,
        "qk_norm": model_type in ("qwen3", "qwen3_moe"),
    }
    if arch == "moe":
        fields.update(num_experts=_get(source, "num_experts"),
                      moe_intermediate_size=_get(source, "moe_intermediate_size"))
    elif arch == "mla":
        if bias:
            raise MeshLayoutError(f"{model_type}: attention_bias=True is not supported")
        nope, rope = _get(source, "qk_nope_head_dim"), _get(source, "qk_rope_head_dim")
        fields.update(
            # MLA has no kv heads of its own; head_dim is the q/k head (nope + rope) whatever the
            # source says (transformers sets it to the rope part, config.json leaves it out).
            num_key_value_heads=heads, head_dim=nope + rope if isinstance(nope, int) and isinstance(rope, int) else 0,
            attention_bias=False, o_proj_bias=False,
            num_experts=_get(source, "n_routed_experts"),
            moe_intermediate_size=_get(source, "moe_intermediate_size"),
            n_shared_experts=_get(source, "n_shared_experts") or 0,
            first_k_dense_replace=_get(source, "first_k_dense_replace") or 0,
            q_lora_rank=_get(source, "q_lora_rank"),
            kv_lora_rank=_get(source, "kv_lora_rank"),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=_get(source, "v_head_dim"),
        )
    return ModelConfig(**fields)


def _deepseek(**kw: Any) -> ModelConfig:
    base: dict[str, Any] = {
        "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "head_dim": 192, "intermediate_size": 18432, "vocab_size": 129280,
        "num_experts": 256, "moe_intermediate_size": 2048, "n_shared_experts": 1, "first_k_dense_replace": 3,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    }
    base.update(kw)
    return ModelConfig(**base)


#: Models by short name, with the shapes of their public Hugging Face ``config.json``.
BUILTIN_MODELS: Mapping[str, ModelConfig] = MappingProxyType({
    # deepseek-ai/DeepSeek-V3 (config.json; MTP layer 61 not counted)
    "deepseek-v3": _deepseek(),
    # moonshotai/Kimi-K2-Instruct (model_type kimi_k2: the DeepSeek-V3 architecture)
    "kimi-k2": _deepseek(model_type="kimi_k2", num_attention_heads=64, num_key_value_heads=64,
                         vocab_size=163840, num_experts=384, first_k_dense_replace=1),
    # Qwen/Qwen3-235B-A22B
    "qwen3-235b-a22b": ModelConfig(
        "qwen3_moe", hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
        head_dim=128, intermediate_size=12288, vocab_size=151936, qk_norm=True, num_experts=128,
        moe_intermediate_size=1536),
    # meta-llama/Meta-Llama-3-70B
    "llama3-70b": ModelConfig(
        "llama", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        head_dim=128, intermediate_size=28672, vocab_size=128256),
    # tiny test models (no Hugging Face source); vocabularies not multiples of 64, to exercise padding
    "llama-tiny": ModelConfig(
        "llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
        intermediate_size=128, vocab_size=1000),
    "moe-tiny": ModelConfig(
        "qwen3_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
        intermediate_size=128, vocab_size=1000, qk_norm=True, num_experts=8, moe_intermediate_size=32),
    "mla-tiny": _deepseek(hidden_size=64, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=8,
                          head_dim=12, intermediate_size=96, vocab_size=500, num_experts=8, moe_intermediate_size=32,
                          first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                          qk_rope_head_dim=4, v_head_dim=8),
})


def builtin_model(name: str) -> ModelConfig:
    """The built-in model ``name`` (see :data:`BUILTIN_MODELS`).

    Raises:
        MeshLayoutError: an unknown name (the message lists the known ones).
    """
    try:
        return BUILTIN_MODELS[name]
    except KeyError:
        raise MeshLayoutError(f"unknown model {name!r} (built in: {', '.join(BUILTIN_MODELS)})") from None


# --- trainer side ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Param:
    """One checkpoint tensor: its name and shape (with stack dimensions first), how many leading
    dimensions are stack dimensions, the member dimension TP shards (None: replicated), and
    whether it is a buffer (FSDP does not shard buffers)."""

    name: str
    shape: Shape
    stack: int = 0
    tp_dim: int | None = None
    buffer: bool = False


@dataclass(frozen=True)
class _Member:
    """A per-layer tensor: suffix after ``model.layers.N.`` (``{e}`` for the expert index),
    member shape, TP dimension, buffer flag."""

    suffix: str
    shape: Shape
    tp_dim: int | None = None
    buffer: bool = False


def _attention_members(cfg: ModelConfig) -> list[_Member]:
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    a = "self_attn."
    if cfg.architecture == "mla":
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        out: list[_Member] = []
        if cfg.q_lora_rank is not None:
            out += [_Member(a + "q_a_proj.weight", (cfg.q_lora_rank, h)),
                    _Member(a + "q_a_layernorm.weight", (cfg.q_lora_rank,)),
                    _Member(a + "q_b_proj.weight", (heads * qk, cfg.q_lora_rank), 0)]
        else:
            out.append(_Member(a + "q_proj.weight", (heads * qk, h), 0))
        out += [_Member(a + "kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h)),
                _Member(a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,)),
                _Member(a + "kv_b_proj.weight", (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), 0),
                _Member(a + "o_proj.weight", (h, heads * cfg.v_head_dim), 1)]
    else:
        q, kv = heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        out = [_Member(a + "q_proj.weight", (q, h), 0), _Member(a + "k_proj.weight", (kv, h), 0),
               _Member(a + "v_proj.weight", (kv, h), 0), _Member(a + "o_proj.weight", (h, q), 1)]
        if cfg.attention_bias:
            out += [_Member(a + "q_proj.bias", (q,), 0), _Member(a + "k_proj.bias", (kv,), 0),
                    _Member(a + "v_proj.bias", (kv,), 0)]
        if cfg.o_proj_bias:
            out.append(_Member(a + "o_proj.bias", (h,)))
        if cfg.qk_norm:
            out += [_Member(a + "q_norm.weight", (cfg.head_dim,)), _Member(a + "k_norm.weight", (cfg.head_dim,))]
    return [*out, _Member("input_layernorm.weight", (h,)), _Member("post_attention_layernorm.weight", (h,))]


def _mlp_members(prefix: str, h: int, inter: int) -> list[_Member]:
    return [_Member(prefix + "gate_proj.weight", (inter, h), 0), _Member(prefix + "up_proj.weight", (inter, h), 0),
            _Member(prefix + "down_proj.weight", (h, inter), 1)]


def _moe_members(cfg: ModelConfig) -> tuple[list[_Member], list[_Member]]:
    """(per-layer members, per-expert members) of a MoE layer."""
    h, e = cfg.hidden_size, cfg.num_experts
    layer = [_Member("mlp.gate.weight", (e, h))]
    if cfg.router_bias:
        layer.append(_Member("mlp.gate.e_score_correction_bias", (e,), buffer=True))
    if cfg.n_shared_experts:
        layer += _mlp_members("mlp.shared_experts.", h, cfg.moe_intermediate_size * cfg.n_shared_experts)
    return layer, _mlp_members("mlp.experts.{e}.", h, cfg.moe_intermediate_size)


def _params(cfg: ModelConfig, stacked: bool) -> list[_Param]:
    """Every checkpoint tensor, in checkpoint order (embeddings, layers, norm, lm_head)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    out = [_Param("model.embed_tokens.weight", (v, h), tp_dim=0)]
    attention = _attention_members(cfg)
    dense = _mlp_members("mlp.", h, cfg.intermediate_size)
    moe_layer, moe_expert = _moe_members(cfg) if cfg.num_experts else ([], [])

    def emit(layers: range, members: list[_Member], experts: bool = False) -> None:
        if not layers:
            return
        for m in members:
            if stacked:
                lead: Shape = (len(layers), cfg.num_experts) if experts else (len(layers),)
                name = "model.layers.*." + m.suffix.replace("{e}", "*")
                out.append(_Param(name, lead + m.shape, len(lead), m.tp_dim, m.buffer))
                continue
            for i in layers:
                for e in range(cfg.num_experts) if experts else [None]:
                    out.append(_Param(f"model.layers.{i}." + m.suffix.replace("{e}", str(e)), m.shape, 0,
                                      m.tp_dim, m.buffer))

    if stacked:
        emit(range(cfg.num_hidden_layers), attention)
        emit(cfg.dense_layers, dense)
        emit(cfg.moe_layers, moe_layer)
        emit(cfg.moe_layers, moe_expert, experts=True)
    else:
        for i in range(cfg.num_hidden_layers):
            one = range(i, i + 1)
            emit(one, attention)
            if i in cfg.dense_layers:
                emit(one, dense)
            else:
                emit(one, moe_layer)
                emit(one, moe_expert, experts=True)
    out.append(_Param("model.norm.weight", (h,)))
    if not cfg.tie_word_embeddings:
        out.append(_Param("lm_head.weight", (v, h), tp_dim=0))
    return out


def checkpoint_tensors(cfg: ModelConfig, *, stacked: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """The trainer's global tensors: Hugging Face names and shapes, in checkpoint order.

    Args:
        cfg: the model.
        stacked: stack layers (and experts) into virtual tensors named with ``*`` (see the
            module docstring for which layers each stack holds).

    Returns:
        ``(name, shape)`` pairs: embeddings, then layer by layer (attention, norms, MLP or MoE:
        router, DeepSeek's ``e_score_correction_bias``, shared experts, experts in order), the
        final norm, and ``lm_head.weight`` unless the embeddings are tied.
    """
    return [(p.name, p.shape) for p in _params(cfg, stacked)]


def parameter_count(cfg: ModelConfig) -> int:
    """Elements of all checkpoint tensors (the router's correction bias buffer included, tied
    embeddings counted once)."""
    return sum(volume(full_box(p.shape)) for p in _params(cfg, True))


_SPEC_KEYS = ("dp", "fsdp", "tp")


def parse_trainer_spec(spec: str) -> dict[str, int]:
    """The degrees of a trainer spec such as ``"fsdp=256"``, ``"dp=2,fsdp=128"`` or
    ``"fsdp=32,tp=8"``; absent keys are 1.

    Raises:
        MeshLayoutError: an unknown or repeated key, or a degree that is not a positive int.
    """
    out = dict.fromkeys(_SPEC_KEYS, 1)
    seen: set[str] = set()
    for item in spec.split(","):
        m = re.fullmatch(r"\s*([a-z]+)\s*=\s*(\d+)\s*", item)
        if m is None or m.group(1) not in _SPEC_KEYS or m.group(1) in seen or int(m.group(2)) < 1:
            raise MeshLayoutError(f"bad trainer spec {spec!r} at {item.strip()!r}: want comma-separated "
                              f"{'/'.join(_SPEC_KEYS)}=N with N >= 1, each key once (e.g. 'dp=2,fsdp=64,tp=8')")
        seen.add(m.group(1))
        out[m.group(1)] = int(m.group(2))
    return out


def _trainer_sharding(p: _Param, dp: int, fsdp: int, tp: int) -> MeshSharding:
    """The DTensor sharding of ``p`` on the (dp, fsdp, tp) mesh, size-1 mesh dims dropped.

    FSDP2 shards dim 0 of the member (the first dim after the stack dims); TP shards ``tp_dim``.
    When both cut the same dim, FSDP2 cuts inside each TP shard (_StridedShard): the tp mesh
    dim comes first, so MeshSharding cuts TP-outer.
    """
    tp_place: Placement = Shard(p.stack + p.tp_dim) if p.tp_dim is not None and not p.buffer else Replicate()
    fsdp_place: Placement = Replicate() if p.buffer else Shard(p.stack)
    axes = [("dp", dp, Replicate()), ("fsdp", fsdp, fsdp_place), ("tp", tp, tp_place)]
    if tp_place == fsdp_place:
        axes = [axes[0], axes[2], axes[1]]
    axes = [a for a in axes if a[1] > 1]
    if not axes:
        return MeshSharding((1,), (Replicate(),), (0,))
    sizes = {"dp": dp, "fsdp": fsdp, "tp": tp}
    coords: list[dict[str, int]] = [{}]
    for name, n, _ in axes:
        coords = [{**c, name: i} for c in coords for i in range(n)]
    ranks = tuple((c.get("dp", 0) * sizes["fsdp"] + c.get("fsdp", 0)) * sizes["tp"] + c.get("tp", 0) for c in coords)
    return MeshSharding(tuple(a[1] for a in axes), tuple(a[2] for a in axes), ranks)


def trainer_layout(cfg: ModelConfig, spec: str, *, dtype: str = "bfloat16", stacked: bool = False) -> TrainerLayout:
    """The layout of an FSDP2 (+ HSDP, + torchtitan TP) trainer holding ``cfg``.

    Global trainer ranks are numbered tp innermost, then fsdp, then dp:
    ``rank = (d * fsdp + f) * tp + t``. FSDP2 shards every parameter on dim 0 (of the member,
    for stacked tensors), DP replicates (HSDP), TP shards as torchtitan does: column-parallel
    (q/k/v and their biases, gate/up, MLA q_b/kv_b, experts' gate/up) and the vocab-parallel
    embeddings and lm_head on dim 0, row-parallel (o_proj, down_proj) on dim 1; norms, router,
    o_proj bias and MLA's a-projections are replicated. DeepSeek's ``e_score_correction_bias`` is
    a buffer: every rank holds all of it.

    Args:
        cfg: the model.
        spec: degrees, ``"fsdp=256"``, ``"dp=2,fsdp=128"``, ``"fsdp=32,tp=8"`` (absent: 1).
        dtype: the trainer's dtype of every tensor.
        stacked: stacked virtual tensors (see the module docstring).

    Returns:
        The validated layout.

    Raises:
        MeshLayoutError: a bad spec or an unknown dtype.
    """
    deg = parse_trainer_spec(spec)
    if dtype not in ITEMSIZE:
        raise MeshLayoutError(f"unknown dtype {dtype!r} (known: {', '.join(ITEMSIZE)})")
    return TrainerLayout.of(TensorSpec(p.name, p.shape, dtype, _trainer_sharding(p, deg["dp"], deg["fsdp"], deg["tp"]))
                            for p in _params(cfg, stacked))


# --- generator side (vLLM) ---------------------------------------------------------------------


def _unquantized(dtype: str) -> str:
    """The dtype of tensors that stay unquantized (norms, router, biases, embeddings, lm_head):
    ``dtype`` itself unless it is an 8-bit type, then bfloat16."""
    return "bfloat16" if ITEMSIZE[dtype] == 1 else dtype


def _even(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise MeshLayoutError(f"{what}: {n} is not divisible by {parts}")
    return n // parts


@dataclass(frozen=True)
class _Stack:
    """Where a layer group's tensors live: the name prefix and the leading (stack) dims that
    every piece and local tensor of the group carries (none for one unstacked layer)."""

    prefix: str
    lead: Shape = ()

    @property
    def box(self) -> Box:
        return full_box(self.lead)


@dataclass
class _RankBuilder:
    """The local tensors of one generator rank, added group by group."""

    cfg: ModelConfig
    tp: int
    rank: int
    ep: int
    dtype: str
    stacked: bool
    out: list[LocalTensor] = field(default_factory=list)

    def add(self, st: _Stack, name: str, shape: Shape, dtype: str,
            pieces: list[tuple[str, Box, Box]]) -> None:
        """A local tensor ``st.prefix + name`` of member shape ``shape``; pieces are
        ``(global suffix, member box, local member box)``; empty ones are dropped."""
        self.out.append(LocalTensor(st.prefix + name, st.lead + shape, dtype, tuple(
            Piece(st.prefix + g, st.box + gbox, st.box + lbox) for g, gbox, lbox in pieces if volume(gbox) > 0)))

    def replicated(self, st: _Stack, name: str, shape: Shape, dtype: str, local: str | None = None) -> None:
        self.add(st, local or name, shape, dtype, [(name, full_box(shape), full_box(shape))])

    def rows(self, st: _Stack, local: str, cols: Shape, dtype: str, blocks: list[tuple[str, int, int]]) -> None:
        """A local tensor of row blocks ``(global suffix, lo, hi)`` stacked in order (all cols)."""
        pieces: list[tuple[str, Box, Box]] = []
        at = 0
        for g, lo, hi in blocks:
            pieces.append((g, ((lo, hi), *full_box(cols)), ((at, at + hi - lo), *full_box(cols))))
            at += hi - lo
        self.add(st, local, (at, *cols), dtype, pieces)

    def vocab(self, name: str) -> None:
        cfg = self.cfg
        padded = -(-cfg.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
        per = _even(padded, self.tp, f"vocab {cfg.vocab_size} padded to {padded} over tp={self.tp}")
        lo = self.rank * per
        hi = min(lo + per, cfg.vocab_size)
        h = cfg.hidden_size
        self.add(_Stack(""), name, (per, h), _unquantized(self.dtype),
                 [(name, ((lo, max(lo, hi)), (0, h)), ((0, max(0, hi - lo)), (0, h)))])

    def attention(self, st: _Stack) -> None:
        cfg, tp, r, w, u = self.cfg, self.tp, self.rank, self.dtype, _unquantized(self.dtype)
        h, a = cfg.hidden_size, "self_attn."
        heads = _even(cfg.num_attention_heads, tp, f"num_attention_heads over tp={tp}")
        if cfg.architecture == "mla":
            qk, ql = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.q_lora_rank
            kv_a = cfg.kv_lora_rank + cfg.qk_rope_head_dim
            if ql is not None:
                self.rows(st, a + "fused_qkv_a_proj.weight", (h,), w,
                          [(a + "q_a_proj.weight", 0, ql), (a + "kv_a_proj_with_mqa.weight", 0, kv_a)])
                self.replicated(st, a + "q_a_layernorm.weight", (ql,), u)
                self.rows(st, a + "q_b_proj.weight", (ql,), w, [(a + "q_b_proj.weight", r * heads * qk,
                                                                 (r + 1) * heads * qk)])
            else:
                self.rows(st, a + "q_proj.weight", (h,), w, [(a + "q_proj.weight", r * heads * qk,
                                                              (r + 1) * heads * qk)])
                self.replicated(st, a + "kv_a_proj_with_mqa.weight", (kv_a, h), w)
            self.replicated(st, a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,), u)
            kvb = cfg.qk_nope_head_dim + cfg.v_head_dim
            self.rows(st, a + "kv_b_proj.weight", (cfg.kv_lora_rank,), w,
                      [(a + "kv_b_proj.weight", r * heads * kvb, (r + 1) * heads * kvb)])
            self.columns(st, a + "o_proj.weight", h, heads * cfg.v_head_dim, w)
        else:
            hd, kv = cfg.head_dim, cfg.num_key_value_heads
            if kv >= tp:
                kv_local = _even(kv, tp, f"num_key_value_heads over tp={tp}")
                kv_shard = r
            else:
                kv_local, kv_shard = 1, r // _even(tp, kv, f"tp over num_key_value_heads={kv}")
            q = (r * heads * hd, (r + 1) * heads * hd)
            k = (kv_shard * kv_local * hd, (kv_shard + 1) * kv_local * hd)
            for kind, cols, dt in [("weight", (h,), w), ("bias", (), u)]:
                if kind == "bias" and not cfg.attention_bias:
                    continue
                self.rows(st, a + f"qkv_proj.{kind}", cols, dt,
                          [(a + f"q_proj.{kind}", *q), (a + f"k_proj.{kind}", *k), (a + f"v_proj.{kind}", *k)])
            self.columns(st, a + "o_proj.weight", h, heads * hd, w)
            if cfg.o_proj_bias:
                self.replicated(st, a + "o_proj.bias", (h,), u)
            if cfg.qk_norm:
                self.replicated(st, a + "q_norm.weight", (hd,), u)
                self.replicated(st, a + "k_norm.weight", (hd,), u)
        self.replicated(st, "input_layernorm.weight", (h,), u)
        self.replicated(st, "post_attention_layernorm.weight", (h,), u)

    def columns(self, st: _Stack, name: str, rows: int, per: int, dtype: str) -> None:
        """Row-parallel: this rank's ``per`` columns of ``name`` (``[rows, per * tp]``)."""
        self.add(st, name, (rows, per), dtype, [(name, ((0, rows), (self.rank * per, (self.rank + 1) * per)),
                                                 ((0, rows), (0, per)))])

    def mlp(self, st: _Stack, prefix: str, inter: int) -> None:
        """vLLM's MergedColumnParallelLinear gate_up_proj and RowParallelLinear down_proj."""
        h, r = self.cfg.hidden_size, self.rank
        per = _even(inter, self.tp, f"{prefix}intermediate size over tp={self.tp}")
        self.rows(st, prefix + "gate_up_proj.weight", (h,), self.dtype,
                  [(prefix + "gate_proj.weight", r * per, (r + 1) * per), (prefix + "up_proj.weight", r * per,
                                                                           (r + 1) * per)])
        self.columns(st, prefix + "down_proj.weight", h, per, self.dtype)

    def moe(self, st: _Stack) -> None:
        cfg, u = self.cfg, _unquantized(self.dtype)
        h, e = cfg.hidden_size, cfg.num_experts
        self.replicated(st, "mlp.gate.weight", (e, h), u)
        if cfg.router_bias:
            self.replicated(st, "mlp.gate.e_score_correction_bias", (e,), u)
        if cfg.n_shared_experts:
            self.mlp(st, "mlp.shared_experts.", cfg.moe_intermediate_size * cfg.n_shared_experts)
        group_tp = self.tp // self.ep
        local = e // self.ep
        inter = cfg.moe_intermediate_size // group_tp
        e0 = (self.rank // group_tp) * local
        t = self.rank % group_tp
        rows = (t * inter, (t + 1) * inter)
        # (expert global suffix, expert dims of the global box, expert dims of the local box)
        blocks: list[tuple[str, Box, Box]]
        if self.stacked:
            blocks = [("mlp.experts.*.", ((e0, e0 + local),), ((0, local),))]
        else:
            blocks = [(f"mlp.experts.{e0 + j}.", (), ((j, j + 1),)) for j in range(local)]
        w13: list[tuple[str, Box, Box]] = []
        w2: list[tuple[str, Box, Box]] = []
        for g, gbox, lbox in blocks:
            w13 += [(g + "gate_proj.weight", (*gbox, rows, (0, h)), (*lbox, (0, inter), (0, h))),
                    (g + "up_proj.weight", (*gbox, rows, (0, h)), (*lbox, (inter, 2 * inter), (0, h)))]
            w2.append((g + "down_proj.weight", (*gbox, (0, h), rows), (*lbox, (0, h), (0, inter))))
        self.add(st, "mlp.experts.w13_weight", (local, 2 * inter, h), self.dtype, w13)
        self.add(st, "mlp.experts.w2_weight", (local, h, inter), self.dtype, w2)

    def build(self) -> GeneratorRank:
        cfg = self.cfg
        self.vocab("model.embed_tokens.weight")
        if not cfg.tie_word_embeddings:
            self.vocab("lm_head.weight")
        self.replicated(_Stack(""), "model.norm.weight", (cfg.hidden_size,), _unquantized(self.dtype))
        groups: list[tuple[_Stack, Callable[[_Stack], None]]] = []

        def dense(st: _Stack) -> None:
            self.mlp(st, "mlp.", cfg.intermediate_size)

        if self.stacked:
            groups.append((_Stack("model.layers.*.", (cfg.num_hidden_layers,)), self.attention))
            if cfg.dense_layers:
                groups.append((_Stack("model.layers.*.", (len(cfg.dense_layers),)), dense))
            if cfg.moe_layers:
                groups.append((_Stack("model.layers.*.", (len(cfg.moe_layers),)), self.moe))
        else:
            for i in range(cfg.num_hidden_layers):
                st = _Stack(f"model.layers.{i}.")
                groups += [(st, self.attention), (st, dense if i in cfg.dense_layers else self.moe)]
        for st, fn in groups:
            fn(st)
        return GeneratorRank.of(self.out)


def _check_generator(cfg: ModelConfig, tp: int, ep: int, dtype: str) -> None:
    if dtype not in ITEMSIZE:
        raise MeshLayoutError(f"unknown dtype {dtype!r} (known: {', '.join(ITEMSIZE)})")
    if tp < 1 or ep < 1:
        raise MeshLayoutError(f"tp={tp} and ep={ep} must be positive")
    if ep > 1 and not cfg.num_experts:
        raise MeshLayoutError(f"ep={ep} for {cfg.model_type}, a model without experts")
    if tp % ep:
        raise MeshLayoutError(f"ep={ep} must divide tp={tp}")
    # The builder checks these too, as it meets them; here they come in a fixed, readable order.
    _even(cfg.num_attention_heads, tp, f"num_attention_heads over tp={tp}")
    if cfg.architecture != "mla":
        kv = cfg.num_key_value_heads
        if kv >= tp:
            _even(kv, tp, f"num_key_value_heads over tp={tp}")
        else:
            _even(tp, kv, f"tp over num_key_value_heads={kv}")
    if cfg.dense_layers:
        _even(cfg.intermediate_size, tp, f"mlp.intermediate size over tp={tp}")
    if cfg.n_shared_experts:
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        _even(shared, tp, f"mlp.shared_experts.intermediate size over tp={tp}")
    if cfg.num_experts:
        if cfg.num_experts % ep:
            raise MeshLayoutError(f"{cfg.num_experts} experts are not divisible by ep={ep}")
        if cfg.moe_intermediate_size % (tp // ep):
            raise MeshLayoutError(f"moe_intermediate_size {cfg.moe_intermediate_size} is not divisible by "
                              f"tp/ep={tp // ep} (tp={tp}, ep={ep})")
    padded = -(-cfg.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    _even(padded, tp, f"vocab {cfg.vocab_size} padded to {padded} over tp={tp}")


def generator_rank(cfg: ModelConfig, *, tp: int, rank: int, ep: int = 1, dtype: str = "bfloat16",
                   stacked: bool = False) -> GeneratorRank:
    """The local tensors of vLLM's TP rank ``rank`` of ``tp`` holding ``cfg``, and their pieces.

    vLLM's layout: ``qkv_proj`` (q rows of this rank's heads, then k, then v; with fewer kv heads
    than tp, rank r holds kv head ``r // (tp // kv_heads)``), row-parallel ``o_proj`` (a column
    slice), ``gate_up_proj`` (gate slice then up slice) and ``down_proj``; vocab padded to a
    multiple of 64 and split evenly, padding rows have no piece; FusedMoE ``w13_weight``
    ``[E_local, 2 * I_e, H]`` and ``w2_weight`` ``[E_local, H, I_e]``, the experts split into
    ``ep`` contiguous groups (group ``rank // (tp // ep)``), each TP-sharded over ``tp // ep``
    ranks; MLA ``fused_qkv_a_proj`` (q_a_proj rows then kv_a_proj_with_mqa rows, replicated),
    ``q_b_proj`` / ``kv_b_proj`` column-parallel by heads, ``o_proj`` row-parallel; shared
    experts as a TP-sharded dense MLP.

    Dtypes: the weights of linear layers and experts take ``dtype``; norms, router, biases,
    embeddings and lm_head take ``dtype`` too unless it is an 8-bit type, then bfloat16. FP8
    block scales (``weight_scale_inv``) are not modelled.

    Args:
        cfg: the model.
        tp: tensor-parallel degree of the replica.
        rank: this rank, ``0 <= rank < tp``.
        ep: expert-parallel groups (must divide tp; 1: every rank holds every expert).
        dtype: dtype of the generator's weights (e.g. ``"bfloat16"``, ``"float8_e4m3fn"``).
        stacked: stacked virtual tensors (see the module docstring), to match a stacked trainer.

    Returns:
        The rank's local tensors, each with the pieces that fill it.

    Raises:
        MeshLayoutError: a degree that does not divide a size (heads % tp, kv heads and tp, intermediate
            % tp, moe_intermediate % (tp/ep), experts % ep, tp % ep, padded vocab % tp), ep > 1
            for a dense model, a rank out of range or an unknown dtype.
    """
    _check_generator(cfg, tp, ep, dtype)
    if not 0 <= rank < tp:
        raise MeshLayoutError(f"rank {rank} is not in [0, tp={tp})")
    return _RankBuilder(cfg, tp, rank, ep, dtype, stacked).build()


def generator_replica(cfg: ModelConfig, replica_id: str, *, tp: int, ep: int = 1, dtype: str = "bfloat16",
                      stacked: bool = False) -> Replica:
    """A vLLM replica of ``tp`` ranks (see :func:`generator_rank`), in TP rank order.

    Args:
        cfg: the model.
        replica_id: the replica's id, unique in the job.
        tp: tensor-parallel degree.
        ep: expert-parallel groups (divides tp).
        dtype: dtype of the generator's weights.
        stacked: stacked virtual tensors.

    Returns:
        The replica (``meta`` records model, tp, ep, dtype).

    Raises:
        MeshLayoutError: see :func:`generator_rank`.
    """
    _check_generator(cfg, tp, ep, dtype)
    ranks = tuple(_RankBuilder(cfg, tp, r, ep, dtype, stacked).build() for r in range(tp))
    meta = (("model", cfg.model_type), ("tp", str(tp)), ("ep", str(ep)), ("dtype", dtype))
    return Replica(replica_id, ranks, meta)
