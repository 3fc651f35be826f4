"""Token choice and log-probabilities for the embedded worker, batched over rows.

The log-prob conventions here are a contract with the trainer, which recomputes the same numbers
to form the PPO ratio: a sampled token's log-prob is `log_softmax(logits / temperature)` at that
token, taken before any top-p/top-k cut, with temperature 1 for greedy rows. Input (prompt)
log-probs always use temperature 1. Everything is computed in float32 whatever the model dtype.

Where the batch needs no top-p/top-k cut and no top log-probs (the rollouts' case), the choice can
run as two Triton kernels (`kernel_seed`, kernels/sampling_triton.py: chunks of the vocabulary, then each
row's chunks merged) instead of about ten torch kernels over a float32 copy of the logits. Per
row: log_softmax(logits / T), and a token by the Gumbel-max trick (argmax of logits / T plus
Gumbel noise from Triton's Philox stream under `kernel_seed`), the same distribution as
`torch.multinomial` over the softmax; greedy rows take the first largest logit, as `argmax` does.
The log-prob differs from torch's in the float32 summation order only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from slime_meta_engine.kernels.layer_ops import kernels_unavailable_reason, next_power_of_two
from slime_meta_engine.protocol import SamplingParams


@dataclass(frozen=True)
class RowSampling:
    """Per-row sampling settings as tensors, rebuilt only when the batch's membership changes."""

    temperatures: torch.Tensor  # (B,) float32; 1.0 for greedy rows
    top_ps: torch.Tensor  # (B,) float32
    top_ks: torch.Tensor  # (B,) int64; vocabulary size where there is no top-k cut
    greedy: torch.Tensor  # (B,) bool
    sampled_rows: torch.Tensor  # (S,) int64 indices of non-greedy rows
    needs_truncation: bool  # some sampled row has top-p < 1 or a top-k cut
    max_top_logprobs: int  # largest top_logprobs_num in the batch

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        top_logprobs_nums: Sequence[int],
        vocab_size: int,
        device: torch.device,
    ) -> RowSampling:
        greedy = [p.is_greedy for p in params]
        top_ks = [vocab_size if p.top_k < 1 else min(p.top_k, vocab_size) for p in params]
        sampled_rows = [i for i, is_greedy in enumerate(greedy) if not is_greedy]
        needs_truncation = any(params[i].top_p < 1.0 or top_ks[i] < vocab_size for i in sampled_rows)
        return cls(
            temperatures=torch.tensor(
                [1.0 if g else p.temperature for p, g in zip(params, greedy)], dtype=torch.float32, device=device
            ),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            sampled_rows=torch.tensor(sampled_rows, dtype=torch.int64, device=device),
            needs_truncation=needs_truncation,
            max_top_logprobs=max(top_logprobs_nums, default=0),
        )


@dataclass(frozen=True)
class TokenChoice:
    token_ids: torch.Tensor  # (B,) int64
    logprobs: torch.Tensor  # (B,) float32, log-prob of each chosen token (see module docstring)
    top_logprobs: torch.Tensor | None  # (B, K) float32, or None when no row asked for top-n
    top_token_ids: torch.Tensor | None  # (B, K) int64


def _sample_truncated(logprobs: torch.Tensor, top_ps: torch.Tensor, top_ks: torch.Tensor, generator) -> torch.Tensor:
    """Sample from each row's distribution after the top-k and top-p cuts.

    Works in sorted order so both cuts are a mask on ranks; the most likely token always
    survives (its preceding mass is 0 and top_k >= 1), so no row is left empty.
    """
    sorted_logprobs, sorted_ids = logprobs.sort(dim=-1, descending=True)
    ranks = torch.arange(logprobs.shape[-1], device=logprobs.device)
    remove = ranks.unsqueeze(0) >= top_ks.unsqueeze(1)
    sorted_probs = sorted_logprobs.exp()
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove |= mass_before > top_ps.unsqueeze(1)
    kept_probs = sorted_probs.masked_fill(remove, 0.0)
    picks = torch.multinomial(kept_probs, num_samples=1, generator=generator)
    return sorted_ids.gather(1, picks).squeeze(1)


def kernel_can_choose(logits: torch.Tensor, sampling: RowSampling) -> bool:
    """Whether the kernels' choice serves this batch: no cuts, no top log-probs, and Triton
    where the logits are (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    return (
        not sampling.needs_truncation
        and sampling.max_top_logprobs == 0
        and logits.dim() == 2
        and logits.stride(-1) == 1
        and kernels_unavailable_reason(logits.device, logits.dtype) is None
    )


# Columns per program of the token choice: a 150k vocabulary is 37 programs a row.
KERNEL_CHUNK = 4096


def _choose_with_kernel(logits_B_V: torch.Tensor, sampling: RowSampling, seed: int) -> TokenChoice:
    from slime_meta_engine.kernels import sampling_triton

    rows, vocab = logits_B_V.shape
    device = logits_B_V.device
    chunk = min(KERNEL_CHUNK, next_power_of_two(vocab))
    chunks = -(-vocab // chunk)
    token_ids_B = torch.empty(rows, dtype=torch.int64, device=device)
    logprobs_B = torch.empty(rows, dtype=torch.float32, device=device)
    if rows:
        largest_B_C, total_B_C, best_score_B_C = torch.empty(3, rows, chunks, dtype=torch.float32, device=device)
        best_index_B_C = torch.empty(rows, chunks, dtype=torch.int32, device=device)
        sampling_triton.chunk_choice[(rows, chunks)](
            logits_B_V,
            logits_B_V.stride(0),
            sampling.temperatures,
            sampling.greedy,
            seed,
            largest_B_C,
            total_B_C,
            best_score_B_C,
            best_index_B_C,
            VOCAB=vocab,
            CHUNK=chunk,
            CHUNKS=chunks,
            BLOCK=min(chunk, 1024),
            num_warps=4,
        )
        sampling_triton.combine_chunks[(rows,)](
            logits_B_V,
            logits_B_V.stride(0),
            sampling.temperatures,
            largest_B_C,
            total_B_C,
            best_score_B_C,
            best_index_B_C,
            token_ids_B,
            logprobs_B,
            CHUNKS=chunks,
            CHUNKS_BLOCK=next_power_of_two(chunks),
        )
    return TokenChoice(token_ids_B, logprobs_B, None, None)


def choose_next_tokens(
    logits: torch.Tensor, sampling: RowSampling, generator: torch.Generator, kernel_seed: int | None = None
) -> TokenChoice:
    """Pick one token per row from last-position `logits` (B, V) and report its log-prob.

    `kernel_seed` (a 31-bit integer, a new one each call): choose with the kernels where
    `kernel_can_choose`; otherwise, and without it, torch's ops draw from `generator`.
    """
    if kernel_seed is not None and kernel_can_choose(logits, sampling):
        return _choose_with_kernel(logits, sampling, kernel_seed)
    logits = logits.float()
    logprobs = torch.log_softmax(logits / sampling.temperatures.unsqueeze(1), dim=-1)
    token_ids = logits.argmax(dim=-1)  # greedy rows; argmax is the same with or without temperature
    if sampling.sampled_rows.numel() > 0:
        rows = sampling.sampled_rows
        row_logprobs = logprobs.index_select(0, rows)
        if sampling.needs_truncation:
            sampled = _sample_truncated(
                row_logprobs, sampling.top_ps.index_select(0, rows), sampling.top_ks.index_select(0, rows), generator
            )
        else:
            sampled = torch.multinomial(row_logprobs.exp(), num_samples=1, generator=generator).squeeze(1)
        token_ids = token_ids.index_copy(0, rows, sampled)
    chosen_logprobs = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top_logprobs = top_token_ids = None
    if sampling.max_top_logprobs > 0:
        top_logprobs, top_token_ids = logprobs.topk(sampling.max_top_logprobs, dim=-1)
    return TokenChoice(token_ids, chosen_logprobs, top_logprobs, top_token_ids)


def prompt_logprobs(
    position_logits: torch.Tensor, next_token_ids: torch.Tensor, top_n: int
) -> tuple[list[float], list[list[tuple[float, int]]]]:
    """Log-probs (temperature 1) of `next_token_ids[i]` under `position_logits[i]`, plus top-n lists.

    `position_logits` (N, V) are the logits at the positions *before* each scored token.
    """
    logprobs = torch.log_softmax(position_logits.float(), dim=-1)
    chosen = logprobs.gather(1, next_token_ids.unsqueeze(1)).squeeze(1).tolist()
    if top_n <= 0:
        return chosen, []
    top_values, top_ids = logprobs.topk(top_n, dim=-1)
    tops = [list(zip(values, ids)) for values, ids in zip(top_values.tolist(), top_ids.tolist())]
    return chosen, tops
