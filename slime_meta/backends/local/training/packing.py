"""Micro-batches in which the sequences that share a prompt share its forward and backward.

A GRPO group is one prompt and G sampled responses, and the teacher's prompts of one problem set
share a long beginning (the template and the problems) before each chain's own attempts and
grades. The prompts run to thousands of tokens and the responses to tens, so with one row per
sequence a step computes that beginning again for every sequence (at the 0.5B benchmark shape:
190k tokens forwarded for 5k trained). Here a row holds the common prefix once, then each
sequence's branch: the rest of its prompt, then its response. A branch token attends to the
prefix and to its own branch's earlier tokens only, and its position continues from the prefix's
end: it sees exactly the context it would see in a row of its own. The prefix's activations
receive the sum of the gradients the copies would have received, so the loss and the gradient
are the same function as with one row per sequence, up to float rounding.

Such a row needs a mask that is neither causal nor padding (`shared_prompt_mask`, `[B, 1, T, T]`,
what the CPU runs), so it runs where the model's attention takes one (`SplitModelCall.shares_prompts`);
on CUDA the same attention runs as variable-length flash attention (`varlen_attention.py`).
Elsewhere, and with `share_prompts=False`, every sequence is a row of its own, right-padded.

Each row's layout is one integer per column, its branch: 0 for the shared prefix (the whole
sequence when the row holds one), k for the row's k-th member's branch, -1 for padding. The loss
rows are gathered from the flattened hidden states by `source_N`: the column whose hidden state
predicts each response token (for a response's first token, its prompt's last column, which is
the prefix's last when the whole prompt is shared).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from slime_meta.backends.local.training.batching import PolicySequence, padded_width

PADDING = -1


@dataclass(frozen=True)
class Row:
    """One row of a micro-batch: a prefix its members' prompts share, then each member's branch
    (the rest of its prompt, then its response). A row of one sequence is all prefix."""

    prefix_ids: tuple[int, ...]
    members: tuple[int, ...]

    def length(self, sequences: Sequence[PolicySequence]) -> int:
        shared = len(self.prefix_ids)
        return shared + sum(
            len(sequences[i].prompt_ids) + len(sequences[i].response_ids) - shared for i in self.members
        )


def common_prefix(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return tuple(a[:n])


@dataclass
class PackedBatch:
    """One micro-batch: `B` rows of `T` columns, and `N` loss tokens in sequence order."""

    tokens_B_T: torch.Tensor
    positions_B_T: torch.Tensor
    branch_B_T: torch.Tensor  # 0 shared prefix (or the whole sequence), k > 0 the k-th member's branch, -1 padding
    source_N: torch.Tensor  # index into the flattened [B * T] hidden states predicting each target
    targets_N: torch.Tensor
    rollout_logp_N: torch.Tensor
    advantages_N: torch.Tensor
    reference_logp_N: torch.Tensor  # 0 where a sequence carries none
    temperature_N: torch.Tensor
    members: tuple[int, ...]  # the sequences whose tokens these are, in the order of the N tokens
    host_branch_B_T: torch.Tensor | None = None  # `branch_B_T` in host memory (`to` leaves it there)

    @property
    def shares_prompts(self) -> bool:
        """Some row holds more than one sequence."""
        branch_B_T = self.branch_B_T if self.host_branch_B_T is None else self.host_branch_B_T
        return bool((branch_B_T > 0).any())

    @property
    def attention_B_T(self) -> torch.Tensor:
        return (self.branch_B_T != PADDING).long()

    def to(self, device: torch.device) -> "PackedBatch":
        fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        fields["host_branch_B_T"] = self.branch_B_T if self.host_branch_B_T is None else self.host_branch_B_T
        return PackedBatch(**fields)


def shared_prompt_mask(branch_B_T: torch.Tensor) -> torch.Tensor:
    """`[B, 1, T, T]` bool, True where a query column (dim 2) may attend to a key column (dim 3):
    an earlier or the same column, in the shared prefix or in the query's own branch. A padding column
    sees the padding before it and itself (never an empty row, whose softmax would be NaN), and no
    real column sees a padding one."""
    width = branch_B_T.shape[1]
    causal_T_T = torch.ones(width, width, dtype=torch.bool, device=branch_B_T.device).tril()
    key_B_1_T = branch_B_T[:, None, :]
    query_B_T_1 = branch_B_T[:, :, None]
    visible_B_T_T = (key_B_1_T == 0) | (key_B_1_T == query_B_T_1)
    return (causal_T_T & visible_B_T_T)[:, None]


def make_rows(
    sequences: Sequence[PolicySequence], share_prompts: bool, micro_batch_size: int, max_tokens: int | None
) -> list[Row]:
    """The rows: one per sequence, or with `share_prompts` sequences whose prompts begin alike in
    one row. In prompt order (so prompts with a long common beginning are neighbours), a sequence
    joins the row before it when the row with it is shorter than the two apart (the common prefix
    outweighs what the row's members lose when the prefix gets shorter) and stays within
    `max_tokens` tokens (without a token budget: `micro_batch_size` sequences)."""
    if not share_prompts:
        return [Row(tuple(s.prompt_ids), (i,)) for i, s in enumerate(sequences)]
    rows: list[Row] = []
    for i in sorted(range(len(sequences)), key=lambda i: tuple(sequences[i].prompt_ids)):
        alone = Row(tuple(sequences[i].prompt_ids), (i,))
        if rows:
            last = rows[-1]
            joined = Row(common_prefix(last.prefix_ids, alone.prefix_ids), last.members + (i,))
            length = joined.length(sequences)
            fits = length <= max_tokens if max_tokens is not None else len(joined.members) <= micro_batch_size
            if joined.prefix_ids and fits and length < last.length(sequences) + alone.length(sequences):
                rows[-1] = joined
                continue
        rows.append(alone)
    return rows


# Loss tokens per micro-batch at most this share of its token budget: each holds a row of logits
# over the vocabulary (151,936 wide for Qwen2.5: 0.3 MB in bf16, several times that with the
# float32 passes of the loss), about 16 tokens' worth of recomputed decoder activations at 0.5B.
# Shared rows hold a whole group's responses, so without it a micro-batch's loss rows grew G-fold.
LOSS_TOKEN_SHARE = 16


def group_rows(
    rows: Sequence[Row],
    sequences: Sequence[PolicySequence],
    micro_batch_size: int,
    max_tokens: int | None,
    width_multiple: int = 1,
) -> list[list[Row]]:
    """Rows into micro-batches, shortest first (similar lengths waste less padding): while rows x
    longest row (at its padded width) stays within `max_tokens` and the loss tokens within
    `max_tokens / LOSS_TOKEN_SHARE` (a row over either alone), or without a token budget while the
    micro-batch holds at most `micro_batch_size` sequences."""
    lengths = [padded_width(row.length(sequences), width_multiple) for row in rows]
    losses = [sum(len(sequences[i].response_ids) for i in row.members) for row in rows]
    groups: list[list[int]] = []
    held = loss_held = 0
    for i in sorted(range(len(rows)), key=lambda i: lengths[i]):  # ascending: the newcomer is the longest
        if max_tokens is not None:
            fits = (
                bool(groups)
                and (len(groups[-1]) + 1) * lengths[i] <= max_tokens
                and loss_held + losses[i] <= max_tokens // LOSS_TOKEN_SHARE
            )
        else:
            fits = bool(groups) and held + len(rows[i].members) <= micro_batch_size
        if fits:
            groups[-1].append(i)
            held += len(rows[i].members)
            loss_held += losses[i]
        else:
            groups.append([i])
            held, loss_held = len(rows[i].members), losses[i]
    return [[rows[i] for i in group] for group in groups]


def collate_rows(
    rows: Sequence[Row], sequences: Sequence[PolicySequence], pad_id: int, width_multiple: int = 1
) -> PackedBatch:
    """The rows as one micro-batch, right-padded to the longest rounded up to `width_multiple` columns."""
    width = padded_width(max(row.length(sequences) for row in rows), width_multiple)
    shape = (len(rows), width)
    tokens = torch.full(shape, pad_id, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    branch = torch.full(shape, PADDING, dtype=torch.long)
    source: list[int] = []
    targets: list[int] = []
    rollout_logp: list[float] = []
    advantages: list[float] = []
    reference_logp: list[float] = []
    temperature: list[float] = []
    members: list[int] = []
    for r, row in enumerate(rows):
        shared = len(row.prefix_ids)
        tokens[r, :shared] = torch.tensor(row.prefix_ids, dtype=torch.long)
        positions[r, :shared] = torch.arange(shared)
        branch[r, :shared] = 0
        start = shared  # the column where the next member's branch begins
        for k, i in enumerate(row.members, start=1):
            s = sequences[i]
            own = (tuple(s.prompt_ids) + tuple(s.response_ids))[shared:]
            end = start + len(own)
            tokens[r, start:end] = torch.tensor(own, dtype=torch.long)
            positions[r, start:end] = torch.arange(shared, shared + len(own))
            branch[r, start:end] = 0 if len(row.members) == 1 else k

            def column(position: int) -> int:  # of the sequence's token at `position`, in this row
                return r * width + (position if position < shared else start + position - shared)

            # Response token t is predicted at the sequence's position before it (the prompt's last for t = 0).
            n = len(s.response_ids)
            source.extend(column(len(s.prompt_ids) - 1 + t) for t in range(n))
            targets.extend(s.response_ids)
            rollout_logp.extend(s.rollout_logprobs)
            advantages.extend(s.advantages)
            reference_logp.extend(s.reference_logprobs if s.reference_logprobs is not None else (0.0,) * n)
            temperature.extend((s.temperature,) * n)
            members.append(i)
            start = end
    as_float = lambda values: torch.tensor(values, dtype=torch.float32)  # noqa: E731
    return PackedBatch(
        tokens,
        positions,
        branch,
        torch.tensor(source, dtype=torch.long),
        torch.tensor(targets, dtype=torch.long),
        as_float(rollout_logp),
        as_float(advantages),
        as_float(reference_logp),
        as_float(temperature),
        tuple(members),
    )


def pack_micro_batches(
    sequences: Sequence[PolicySequence],
    share_prompts: bool,
    micro_batch_size: int,
    pad_id: int,
    max_tokens: int | None = None,
    width_multiple: int = 1,
) -> list[PackedBatch]:
    """The step's micro-batches (sequences without response tokens are left out: nothing to train),
    each padded to a multiple of `width_multiple` columns."""
    kept = [i for i, s in enumerate(sequences) if s.response_ids]
    chosen = [sequences[i] for i in kept]
    rows = make_rows(chosen, share_prompts, micro_batch_size, max_tokens)
    batches = [
        collate_rows(group, chosen, pad_id, width_multiple)
        for group in group_rows(rows, chosen, micro_batch_size, max_tokens, width_multiple)
    ]
    for b in batches:  # members as indices into `sequences`
        b.members = tuple(kept[i] for i in b.members)
    return batches
