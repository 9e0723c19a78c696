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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .._errors import MeshLayoutError
from ._boxes import Shape, full_box, volume
from ._layouts import ITEMSIZE, MeshSharding, Placement, Replicate, Shard, TensorSpec, TrainerLayout

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
