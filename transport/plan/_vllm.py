"""The local tensors of a vLLM tensor/expert-parallel generator rank, and the pieces of the
trainer's (Hugging Face) tensors that fill them; model shapes and naming are in ``_models``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .._errors import MeshLayoutError
from ._boxes import Box, Shape, full_box, volume
from ._layouts import ITEMSIZE, GeneratorRank, LocalTensor, Piece, Replica
from ._models import VOCAB_PADDING, ModelConfig


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
