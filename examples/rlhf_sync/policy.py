"""The policy and the task: a tiny GRU language model learns to sort digits.

A prompt is K random digits; the policy writes K digits after a separator. The reward is the
fraction of positions that match the sorted prompt (so random output earns ~0.1 and a perfect
sorter 1.0). Nothing is downloaded: the model starts from random weights.
"""

from __future__ import annotations

import torch
from torch import nn

DIGITS = 10
SEP, BOS = 10, 11
VOCAB = 12


class Policy(nn.Module):
    def __init__(self, hidden: int = 128, layers: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.rnn = nn.GRU(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, DIGITS)

    def forward(self, tokens: torch.Tensor, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        out, state = self.rnn(self.embed(tokens), state)
        return self.head(out), state


def prompts(batch: int, k: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, DIGITS, (batch, k), generator=generator)


@torch.no_grad()
def generate(policy: Policy, prompt: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Samples K output digits per prompt; returns full sequences [B, 2K+2] (BOS p SEP o)."""
    b, k = prompt.shape
    head = torch.cat([torch.full((b, 1), BOS), prompt, torch.full((b, 1), SEP)], dim=1)
    logits, state = policy(head)
    outs = []
    last = logits[:, -1]
    for _ in range(k):
        tok = torch.multinomial(torch.softmax(last, -1), 1, generator=generator)
        outs.append(tok)
        logits, state = policy(tok, state)
        last = logits[:, -1]
    return torch.cat([head, *outs], dim=1)


def reward(seqs: torch.Tensor, k: int) -> torch.Tensor:
    prompt, out = seqs[:, 1 : 1 + k], seqs[:, 2 + k :]
    return (out == prompt.sort(dim=1).values).float().mean(dim=1)


def policy_gradient_loss(policy: Policy, seqs: torch.Tensor, advantages: torch.Tensor, k: int) -> torch.Tensor:
    """REINFORCE with group-normalised advantages (GRPO-style, no KL term)."""
    logits, _ = policy(seqs[:, :-1])
    out_logits = logits[:, 1 + k :]  # predictions of the K output tokens
    logp = torch.log_softmax(out_logits, -1).gather(-1, seqs[:, 2 + k :].unsqueeze(-1)).squeeze(-1)
    return -(advantages.unsqueeze(1) * logp).mean()


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    r = rewards.view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)
