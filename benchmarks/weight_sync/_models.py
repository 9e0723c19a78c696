"""Llama-shaped state dicts of a chosen size, and version stamps to check what arrived.

:func:`llama_like` picks a decoder-only configuration (Llama family: token embedding, per layer
q/k/v/o attention projections with grouped-query attention, gate/up/down SwiGLU MLP, two RMS
norms; final norm and an untied ``lm_head``) whose bf16 parameters add up to a target byte
count: the hidden size is chosen so the depth is typical for that width, the depth so the
layers fill the target, and the vocabulary absorbs the remainder. Tensor names follow Hugging
Face ``LlamaForCausalLM``.

Every version the trainer sends carries a *stamp*: the first element of every tensor holds the
version number (exact in bf16 for 0..256), so a generator can check cheaply, per tensor, that the
whole version arrived and nothing older or torn is live.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

DTYPE = torch.bfloat16
_BASE_VOCAB = 32000
_WIDTHS = (64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192)
_DEPTH_PER_WIDTH = 1 / 80  # typical depth ≈ hidden / 80 (Llama-7B 4096/32, TinyLlama 2048/22)
_POOL_NUMEL = 1 << 22  # random values are tiled from a pool of this many (fast to build)
_STAMP_MOD = 256  # bf16 holds every integer in 0..256 exactly


@dataclass(frozen=True)
class DecoderConfig:
    """A decoder-only (Llama-style) model configuration."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter name -> shape, in the order a ``state_dict()`` lists them."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out[p + "self_attn.q_proj.weight"] = (self.heads * self.head_dim, h)
            out[p + "self_attn.k_proj.weight"] = (kv, h)
            out[p + "self_attn.v_proj.weight"] = (kv, h)
            out[p + "self_attn.o_proj.weight"] = (h, self.heads * self.head_dim)
            out[p + "mlp.gate_proj.weight"] = (self.intermediate, h)
            out[p + "mlp.up_proj.weight"] = (self.intermediate, h)
            out[p + "mlp.down_proj.weight"] = (h, self.intermediate)
            out[p + "input_layernorm.weight"] = (h,)
            out[p + "post_attention_layernorm.weight"] = (h,)
        out["model.norm.weight"] = (h,)
        out["lm_head.weight"] = (self.vocab, h)
        return out

    @property
    def params(self) -> int:
        return sum(math.prod(s) for s in self.shapes().values())

    @property
    def nbytes(self) -> int:
        return self.params * DTYPE.itemsize

    def describe(self) -> dict[str, Any]:
        return {
            **asdict(self), "params": self.params, "tensors": len(self.shapes()), "nbytes": self.nbytes,
            "dtype": "bfloat16",
        }


def _config(hidden: int, layers: int, vocab: int) -> DecoderConfig:
    head_dim = 64 if hidden <= 1024 else 128
    heads = max(1, hidden // head_dim)
    kv_heads = max(1, heads // 4)  # grouped-query attention, 4 query heads per kv head
    intermediate = 256 * math.ceil(hidden * 8 / 3 / 256)  # SwiGLU width, rounded like Llama
    return DecoderConfig(hidden, intermediate, layers, heads, kv_heads, head_dim, vocab)


def _per_layer(c: DecoderConfig) -> int:
    h, kv = c.hidden, c.kv_heads * c.head_dim
    return 2 * h * c.heads * c.head_dim + 2 * h * kv + 3 * h * c.intermediate + 2 * h


def llama_like(target_bytes: int) -> DecoderConfig:
    """A Llama-style configuration whose bf16 parameters total about ``target_bytes``.

    Raises:
        ValueError: the target is too small for even one layer of the narrowest width.
    """
    target = target_bytes // DTYPE.itemsize
    best: tuple[float, DecoderConfig] | None = None
    for h in _WIDTHS:
        # Embeddings take at most a quarter of the parameters (small targets get a small vocab).
        vocab = min(_BASE_VOCAB, target // (8 * h) // 64 * 64)
        if vocab < 64:
            continue
        c = _config(h, 1, vocab)
        layers = round((target - 2 * vocab * h - h) / _per_layer(c))
        if layers < 1:
            continue
        score = abs(math.log(layers / (h * _DEPTH_PER_WIDTH)))
        if best is None or score < best[0]:
            best = (score, _config(h, layers, vocab))
    if best is None:
        raise ValueError(f"{target_bytes} bytes is too small for a Llama-shaped model; use at least 1 MiB")
    c = best[1]
    # Let the vocabulary absorb the remainder (kept within 2x of its first choice, a multiple of 64).
    vocab = (target - c.layers * _per_layer(c) - c.hidden) // (2 * c.hidden) // 64 * 64
    if c.vocab // 2 <= vocab <= 2 * c.vocab:
        c = _config(c.hidden, c.layers, vocab)
    return c


def make_state(config: DecoderConfig, *, seed: int | None) -> dict[str, torch.Tensor]:
    """Allocates the model's parameters (bf16, contiguous, memory touched).

    Args:
        config: the shapes.
        seed: random values (weights ~ N(0, 0.02), norms ~ 1 + N(0, 0.02), tiled from a seeded
            pool so that building a GiB takes about as long as writing it); None for zeros.
    """
    shapes = config.shapes()
    if seed is None:
        return {k: torch.zeros(s, dtype=DTYPE) for k, s in shapes.items()}
    g = torch.Generator().manual_seed(seed)
    pool = (torch.randn(_POOL_NUMEL, generator=g) * 0.02).to(DTYPE)
    out = {}
    for k, s in shapes.items():
        t = torch.empty(s, dtype=DTYPE)
        flat = t.view(-1)
        pos, start = 0, int(torch.randint(0, _POOL_NUMEL, (1,), generator=g))
        while pos < flat.numel():
            n = min(flat.numel() - pos, _POOL_NUMEL - start)
            flat[pos : pos + n].copy_(pool[start : start + n])
            pos, start = pos + n, 0
        if len(s) == 1:  # RMS norm weights sit around 1
            t.add_(1.0)
        out[k] = t
    return out


def stamp(state: dict[str, torch.Tensor], version: int) -> None:
    """Marks every tensor with ``version`` (its first element), in place."""
    value = float(version % _STAMP_MOD)
    with torch.no_grad():
        for t in state.values():
            t.view(-1)[0] = value


def stamp_mismatches(state: dict[str, torch.Tensor], version: int) -> int:
    """How many tensors do not carry the stamp of ``version`` (0: the whole version is live)."""
    value = float(version % _STAMP_MOD)
    return sum(1 for t in state.values() if float(t.view(-1)[0]) != value)


def checksum(state: dict[str, torch.Tensor]) -> int:
    """An order-sensitive checksum of every byte of every tensor (a bit-for-bit check).

    Sums each tensor's bytes as int64 words (wrapping; trailing bytes as int8), weighted by the
    tensor's position; about as fast as reading the memory once.
    """
    total = 0
    for i, t in enumerate(state.values(), start=1):
        raw = t.reshape(-1).view(torch.uint8)
        head = raw.numel() // 8 * 8
        s = int(raw[:head].view(torch.int64).sum()) + int(raw[head:].to(torch.int64).sum())
        total = (total + i * s) % (1 << 61)
    return total


def state_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())
