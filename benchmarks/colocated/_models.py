"""The colocated benchmark's models: real Llama shapes, their bf16 state dict built where the
weights live, what one run needs of the machine, and which model fits.

The shapes come from :func:`transport.plan.checkpoint_tensors` (Hugging Face names and shapes of
a ``config.json``, tied embeddings counted once); the version stamps and checksums that check
what arrived are :mod:`benchmarks.weight_sync._models`'.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from transport.plan import ModelConfig, checkpoint_tensors, parameter_count

from ..common.sizes import GiB
from ..weight_sync._models import DTYPE, checksum, stamp

#: The models by ``--model`` name, with the shapes of their public Hugging Face ``config.json``.
MODELS: Mapping[str, ModelConfig] = MappingProxyType({
    # meta-llama/Meta-Llama-3-8B: 8.03 B parameters, 16.1 GB in bf16
    "llama3-8b": ModelConfig(
        "llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=14336, vocab_size=128256),
    # meta-llama/Llama-3.2-3B: 3.21 B parameters (embeddings tied to the LM head), 6.4 GB in bf16
    "llama3.2-3b": ModelConfig(
        "llama", hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
        head_dim=128, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    # smoke tests (no Hugging Face source): Llama-3 proportions, 22 M parameters, 44 MB in bf16
    "llama-small": ModelConfig(
        "llama", hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        intermediate_size=1792, vocab_size=8192),
})
SMALL = "llama-small"
AUTO_ORDER = ("llama3-8b", "llama3.2-3b")  # what ``--model auto`` tries on a GPU, largest first

# Per process: a CUDA context, torch's and transport's kernels, the caching allocator's slack.
GPU_PROCESS_OVERHEAD = 3 * GiB // 2
GPU_HEADROOM = 2 * GiB
HOST_PROCESS_OVERHEAD = 2 * GiB  # Python, torch and transport in one process (RSS)
HOST_HEADROOM = 2 * GiB


def shapes(model: str) -> list[tuple[str, tuple[int, ...]]]:
    """``model``'s tensors: Hugging Face names and shapes, in checkpoint order.

    Raises:
        KeyError: not a model of :data:`MODELS`.
    """
    return checkpoint_tensors(MODELS[model])


def model_bytes(model: str) -> int:
    """Bytes of ``model``'s bf16 state dict."""
    return parameter_count(MODELS[model]) * DTYPE.itemsize


def describe(model: str) -> dict[str, object]:
    """``model``'s shape fields and sizes, for the record."""
    cfg = MODELS[model]
    return {
        "name": model, "hidden_size": cfg.hidden_size, "layers": cfg.num_hidden_layers,
        "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
        "tied_embeddings": cfg.tie_word_embeddings, "params": parameter_count(cfg), "tensors": len(shapes(model)),
        "nbytes": model_bytes(model), "dtype": "bfloat16",
    }


def build_state(model: str, device: torch.device, *, seed: int | None) -> dict[str, torch.Tensor]:
    """Allocates ``model``'s bf16 parameters on ``device``, one tensor each, as a model's own are.

    Args:
        model: a name of :data:`MODELS`.
        device: where they live.
        seed: random values (weights ~ N(0, 0.02), norms ~ 1 + N(0, 0.02)); None for zeros.
    """
    g = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes(model):
        t = torch.empty(shape, dtype=DTYPE, device=device)
        if g is None:
            t.zero_()
        else:
            t.normal_(0.0, 0.02, generator=g)
            if len(shape) == 1:  # RMS norm weights sit around 1
                t.add_(1.0)
        out[name] = t
    return out


def advance(state: Mapping[str, torch.Tensor], version: int) -> None:
    """Makes ``state`` the trainer's ``version``, in place: every element changes (its sign bit
    flips, zeros included) and every tensor's first element carries the version's stamp, so a
    generator left on any earlier version differs in every tensor."""
    with torch.no_grad():
        for t in state.values():
            t.neg_()
    stamp(dict(state), version)


def tensor_sums(state: Mapping[str, torch.Tensor]) -> list[int]:
    """One bit-for-bit checksum per tensor, in ``state``'s order (equal lists: equal bytes)."""
    return [checksum({name: t}) for name, t in state.items()]


def placeholders(state: Mapping[str, torch.Tensor]) -> None:
    """Lets go of the tensors' storage, keeping their shapes, device and dtype (stride-0 views of
    one element): a zero-copy subscriber re-points them at its slot on the first apply and never
    reads them before, so the generator holds its three slots and nothing else rather than the
    model and three slots until then (after the first apply the two are the same)."""
    for t in state.values():
        one = torch.zeros(1, dtype=t.dtype, device=t.device)
        t.set_(one.untyped_storage(), 0, t.shape, (0,) * t.dim())


@dataclass(frozen=True)
class Need:
    """What one run with a model asks of the machine (peaks; bytes)."""

    gpu: int
    host: int


def need(model: str, k: int, device: str) -> Need:
    """The peaks of one run with ``model`` and ``k`` generators on ``device`` ("cuda" or "cpu").

    Device memory: each generator holds its model plus two slots (copy apply), or three slots
    instead of the model (zero-copy; the model's own storage goes first, see
    :func:`placeholders`); the trainer its model, and twice more for the floor's two buffers.
    Host memory: the publisher's two packed snapshots (with ``device="cpu"`` all of the above is
    host memory too), and each process's own.
    """
    b = model_bytes(model)
    weights = max(1 + 3 * k, 3 + k) * b
    procs = k + 1
    if device == "cuda":
        return Need(gpu=weights + procs * GPU_PROCESS_OVERHEAD + GPU_HEADROOM,
                    host=2 * b + procs * HOST_PROCESS_OVERHEAD + HOST_HEADROOM)
    return Need(gpu=0, host=weights + 2 * b + procs * HOST_PROCESS_OVERHEAD + HOST_HEADROOM)


def choose(requested: str, k: int, device: str, free_gpu: int, free_host: int, *,
           largest: str | None = None) -> tuple[str, str]:
    """The model to run, and why.

    ``auto`` on a GPU takes the largest of :data:`AUTO_ORDER` (from ``largest`` on, when given)
    that fits in the free device and host memory (:func:`need`), else the small model; on the
    CPU the small model. A named model is taken as asked (the reason then says whether it fits).

    Args:
        requested: ``"auto"`` or a name of :data:`MODELS`.
        k: generators.
        device: ``"cuda"`` or ``"cpu"``.
        free_gpu: free device memory (bytes; ignored on the CPU).
        free_host: available host memory (bytes).
        largest: the largest model of :data:`AUTO_ORDER` that ``auto`` may take.
    """

    def fits(model: str) -> bool:
        n = need(model, k, device)
        return n.gpu <= free_gpu and n.host <= free_host if device == "cuda" else n.host <= free_host

    def gib(n: int) -> str:
        return f"{n / GiB:.1f} GiB"

    def needs(model: str) -> str:
        n = need(model, k, device)
        return (f"needs {gib(n.gpu)} of GPU and {gib(n.host)} of host memory" if device == "cuda"
                else f"needs {gib(n.host)} of host memory")

    free = (f"{gib(free_gpu)} GPU / {gib(free_host)} host memory free" if device == "cuda"
            else f"{gib(free_host)} host memory available")
    if requested != "auto":
        return requested, f"--model {requested}: {needs(requested)}, {free}" + ("" if fits(requested) else
                                                                                 " (it may not fit)")
    if device != "cuda":
        return SMALL, f"auto on the CPU: the small model ({needs(SMALL)}, {free})"
    order = AUTO_ORDER[AUTO_ORDER.index(largest):] if largest is not None else AUTO_ORDER
    for model in order:
        if fits(model):
            capped = f", at most {largest}" if largest is not None else ""
            return model, f"auto: the largest that fits{capped} ({needs(model)}, {free})"
    return SMALL, (f"auto: {' nor '.join(order)} does not fit ({needs(order[-1])} with K={k}; {free}): "
                   "the small model")


def gbps(nbytes: int, seconds: float) -> float:
    """GB/s (1e9 bytes a second) of ``nbytes`` in ``seconds`` (nan for no time)."""
    return nbytes / seconds / 1e9 if seconds > 0 else math.nan
