"""Sequences to train, padding, and micro-batch grouping by length (the policy passes pack rows in `packing.py`).

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
    # Log-probs of the response tokens under the start weights (the KL anchor), when the step needs them.
    reference_logprobs: tuple[float, ...] | None = None


@dataclass(frozen=True)
class MicroBatching:
    """How a training pass splits its forwards: `micro_batch_size` sequences each, or with
    `max_tokens` (dynamic batch size) by padded tokens (`micro_batch_groups`); rows padded with
    `pad_id` to a multiple of `width_multiple` columns, run on `device`."""

    micro_batch_size: int
    pad_id: int
    device: torch.device
    max_tokens: int | None = None
    width_multiple: int = 1


# On a GPU a micro-batch's rows are padded to a multiple of this many columns. Each new token count a
# matmul runs keeps about 20 KiB of host memory in CUDA's libraries for good (docs/memory.md), and a
# step's micro-batches are rows x (their longest row) tokens, nearly always a count not seen before;
# in steps of 64 columns they are at most max_tokens / 64 counts.
# The padding columns come after every row's real tokens, so causal attention keeps them out.
CUDA_WIDTH_MULTIPLE = 64


def padded_width(length: int, width_multiple: int) -> int:
    """The columns a row of `length` tokens takes: rounded up to `width_multiple`."""
    return -(-length // width_multiple) * width_multiple


def pad_sequences(
    sequences: Sequence[Sequence[int]], pad_id: int, width_multiple: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids (to the longest, rounded up to `width_multiple` columns) and their attention mask."""
    length = padded_width(max(len(s) for s in sequences), width_multiple)
    tokens = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, ids in enumerate(sequences):
        tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[row, : len(ids)] = 1
    return tokens, attention


def response_columns(prompt_length: int, response_length: int) -> slice:
    """Columns of the shifted batch that hold the response's targets."""
    return slice(prompt_length - 1, prompt_length - 1 + response_length)


def micro_batch_groups(lengths: Sequence[int], micro_batch_size: int, max_tokens: int | None = None) -> list[list[int]]:
    """Indices of each micro-batch, shortest sequences first (similar lengths waste less padding).

    Without `max_tokens`: `micro_batch_size` sequences each. With it (dynamic batch size): as many
    sequences as keep the padded forward, rows x longest row, within `max_tokens`; a sequence
    longer than `max_tokens` is a micro-batch of its own. Padded tokens, not the sum of lengths,
    because the padded batch is what the forward holds activations for.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if max_tokens is None:
        return [order[i : i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]
    groups: list[list[int]] = []
    for i in order:  # ascending, so the newcomer is the longest row
        if groups and (len(groups[-1]) + 1) * lengths[i] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def chunks(items: Sequence, size: int) -> list[Sequence]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def budget_chunks(
    items: Sequence, lengths: Sequence[int], size: int, max_tokens: int | None, width_multiple: int = 1
) -> list[list]:
    """`chunks(items, size)` in order, or with `max_tokens` the items grouped by `micro_batch_groups`
    (`lengths`: each item's longest forward row, counted at its padded width)."""
    if max_tokens is None:
        return [list(c) for c in chunks(items, size)]
    padded = [padded_width(n, width_multiple) for n in lengths]
    return [[items[i] for i in group] for group in micro_batch_groups(padded, size, max_tokens)]
