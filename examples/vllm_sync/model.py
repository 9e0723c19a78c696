"""A tiny Llama-style model made locally (no hub): config, sharpened random weights, tokenizer.

vLLM loads it from a directory like any Hugging Face checkpoint. The weights are initialised
with a large spread so that greedy decoding is decisive (the top logit leads the second by a
wide margin), which makes "vLLM's tokens equal the trainer's" a sharp check rather than a coin
flip between near-ties.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

VOCAB = 256  # words w0..w{VOCAB-1-specials}
SPECIALS = ("<unk>", "<s>", "</s>")

TINY: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "vocab_size": VOCAB,
}


def _tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for i in range(VOCAB - len(SPECIALS)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(out))


def hf_config(dtype: str = "float32", **overrides: Any) -> Any:
    from transformers import LlamaConfig

    cfg = dict(TINY, **overrides)
    return LlamaConfig(**cfg, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, rms_norm_eps=1e-5,
                       dtype=dtype)


def sharpen(model: torch.nn.Module, seed: int) -> None:
    """Re-initialises ``model`` with a spread wide enough for decisive greedy decoding."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / p.shape[-1] ** 0.5))


def build(out: str | Path, *, dtype: str = "float32", seed: int = 0, **overrides: Any) -> Path:
    """Writes the tiny model (config, safetensors weights, tokenizer) to ``out`` and returns it."""
    from transformers import LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_config(dtype, **overrides))
    sharpen(model, seed)
    model.to(getattr(torch, dtype)).save_pretrained(str(out), safe_serialization=True)
    _tokenizer(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return out


def load(path: str | Path, dtype: str = "float32") -> Any:
    """The trainer's own ``transformers`` copy of the model at ``path``."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(path), torch_dtype=getattr(torch, dtype))


def prompts(n: int, length: int = 6, seed: int = 0) -> list[str]:
    """``n`` prompts of ``length`` random words (no specials)."""
    g = torch.Generator().manual_seed(seed)
    words = VOCAB - len(SPECIALS)
    return [" ".join(f"w{int(i)}" for i in torch.randint(0, words, (length,), generator=g)) for _ in range(n)]


@torch.no_grad()
def reference_logprobs(model: Any, prompt_ids: list[int], tokens: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens of ``model`` teacher-forced along ``tokens`` after ``prompt_ids``, and the
    log-probability ``model`` gives each of ``tokens``."""
    ids = torch.tensor([prompt_ids + tokens])
    logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    logp = torch.log_softmax(logits, dim=-1)
    greedy = logits.argmax(-1).tolist()
    return greedy, [float(logp[i, t]) for i, t in enumerate(tokens)]
