"""Padded micro-batches of (prompt ids + response ids) with per-token training fields.

Positions are the targets' (shifted by one): logits at position t predict token t+1, so a
response token at sequence index i lives at batch column i - 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class PolicySequence:
    """One sequence trained by the policy-gradient pass."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]
    advantages: tuple[float, ...]  # one per response token
    temperature: float


@dataclass
class MicroBatch:
    tokens_B_T: torch.Tensor
    attention_mask_B_T: torch.Tensor
    loss_mask_B_T: torch.Tensor  # [B, T-1], 1 where the target token is a response token
    rollout_logp_B_T: torch.Tensor  # [B, T-1]
    advantages_B_T: torch.Tensor  # [B, T-1]
    temperature_B: torch.Tensor

    def to(self, device: torch.device) -> "MicroBatch":
        return MicroBatch(*(t.to(device) for t in vars(self).values()))


def pad_sequences(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and their attention mask."""
    length = max(len(s) for s in sequences)
    tokens = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, ids in enumerate(sequences):
        tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[row, : len(ids)] = 1
    return tokens, attention


def response_columns(prompt_length: int, response_length: int) -> slice:
    """Columns of the shifted batch that hold the response's targets."""
    return slice(prompt_length - 1, prompt_length - 1 + response_length)


def make_micro_batches(sequences: Sequence[PolicySequence], micro_batch_size: int, pad_id: int) -> list[MicroBatch]:
    # Similar lengths together waste less padding.
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i].prompt_ids) + len(sequences[i].response_ids))
    batches = []
    for start in range(0, len(order), micro_batch_size):
        chunk = [sequences[i] for i in order[start : start + micro_batch_size]]
        tokens, attention = pad_sequences([s.prompt_ids + s.response_ids for s in chunk], pad_id)
        shape = (len(chunk), tokens.shape[1] - 1)
        loss_mask, rollout_logp, advantages = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
        for row, seq in enumerate(chunk):
            cols = response_columns(len(seq.prompt_ids), len(seq.response_ids))
            loss_mask[row, cols] = 1.0
            rollout_logp[row, cols] = torch.tensor(seq.rollout_logprobs, dtype=torch.float32)
            advantages[row, cols] = torch.tensor(seq.advantages, dtype=torch.float32)
        temperature = torch.tensor([s.temperature for s in chunk], dtype=torch.float32)
        batches.append(MicroBatch(tokens, attention, loss_mask, rollout_logp, advantages, temperature))
    return batches


def chunks(items: Sequence, size: int) -> list[Sequence]:
    return [items[i : i + size] for i in range(0, len(items), size)]
