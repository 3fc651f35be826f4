"""Generalised JSD to a teacher known only by its top-k tokens, plus one tail bucket.

A scoring server returns the teacher's distribution at each token as its k most likely ids and
their log-probs (SGLang's `input_top_logprobs`), not as logits over the whole vocabulary. The
divergence is then taken between two distributions over the same k + 1 outcomes:

    teacher  q_1..q_k = exp(teacher top-k log-probs),  q_tail = 1 - sum_i q_i
    policy   p_1..p_k = softmax(policy logits / T) at the teacher's top-k ids,
             p_tail   = the policy's mass on every other id, as one bucket (= 1 - sum_i p_i)

and `D(P_S, P_T)` is `generalized_jsd`'s (beta, token clip) on those (k + 1)-vectors. Merging
outcomes never raises an f-divergence, so the value is at most the full-vocabulary JSD, grows
with k, and equals it at k = V (`tests/test_losses_topk_jsd.py`). The teacher's log-probs are
taken as they come: they must be at the temperature the policy's logits are divided by.

Vocabulary parallel: under tensor parallelism each rank holds the logits of one contiguous slice
of the vocabulary (`[N, V / TP]`, slice r starting at r * V / TP, as Megatron splits its output
layer). The log-softmax is formed from all-reduces of the row maximum and of the sums of
exponentials (all ids, and the ids outside the top-k), and each top-k logit is read on the rank
that holds it and summed over ranks; every rank then computes the same loss and backpropagates
into its own slice (the all-reduce's backward is the identity, as Megatron's vocab-parallel
cross-entropy does it). `VocabShards` is the abstract all-reduce; `ProcessGroupShards` is
torch.distributed's over a process group.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from ._common import as_bool_mask, rowwise, selected_rows
from .distill import JSDOutput, _jsd_output, check_jsd_settings, divergence_from_logps

# The log of an empty bucket: a floor, not -inf, so that 0 * log 0 and its gradient stay finite.
_TINY = 1e-30


class VocabShards:
    """The whole vocabulary on this rank: the all-reduces are the identity."""

    def rank(self) -> int:
        return 0

    def all_reduce_max_(self, values: Tensor) -> Tensor:
        return values

    def all_reduce_sum_(self, values: Tensor) -> Tensor:
        return values


class ProcessGroupShards(VocabShards):
    """Rank r of a torch.distributed process group holds vocabulary slice r (equal slices)."""

    def __init__(self, group=None):
        self.group = group

    def rank(self) -> int:
        return dist.get_rank(self.group)

    def all_reduce_max_(self, values: Tensor) -> Tensor:
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        return values

    def all_reduce_sum_(self, values: Tensor) -> Tensor:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.group)
        return values


class _SumOverShards(torch.autograd.Function):
    """Sum over ranks forward; identity backward: every rank computes the same loss from the sum,
    so the gradient of its own summand is the gradient of the sum."""

    @staticmethod
    def forward(ctx, values: Tensor, shards: VocabShards) -> Tensor:  # type: ignore[override]
        return shards.all_reduce_sum_(values.clone())

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return grad, None


def _policy_bucket_logps(student_c_V: Tensor, ids_c_K: Tensor, temperature: float, shards: VocabShards) -> Tensor:
    """`[c, K + 1]` log-probs of the policy at the teacher's top-k ids and of the rest (the tail)."""
    compute = torch.float64 if student_c_V.dtype == torch.float64 else torch.float32
    scaled_c_V = student_c_V.to(compute) / temperature
    width = scaled_c_V.shape[-1]
    row_max_c = shards.all_reduce_max_(scaled_c_V.detach().amax(dim=-1))  # any shift works: not differentiated
    exp_c_V = torch.exp(scaled_c_V - row_max_c[:, None])
    local_ids_c_K = ids_c_K.long() - shards.rank() * width
    here_c_K = (local_ids_c_K >= 0) & (local_ids_c_K < width)
    safe_ids_c_K = torch.where(here_c_K, local_ids_c_K, torch.zeros_like(local_ids_c_K))
    # Top-k logits: read where held, 0 elsewhere, summed over ranks.
    zero = torch.zeros((), dtype=compute, device=scaled_c_V.device)
    topk_c_K = torch.where(here_c_K, scaled_c_V.gather(-1, safe_ids_c_K), zero)
    topk_c_K = _SumOverShards.apply(topk_c_K, shards)
    in_topk_c_V = torch.zeros_like(exp_c_V).scatter_add_(-1, safe_ids_c_K, here_c_K.to(compute)) > 0
    total_c = _SumOverShards.apply(exp_c_V.sum(dim=-1), shards)
    tail_c = _SumOverShards.apply(exp_c_V.masked_fill(in_topk_c_V, 0.0).sum(dim=-1), shards)
    log_z_c = row_max_c + torch.log(total_c)
    tail_logp_c = row_max_c + torch.log(tail_c.clamp_min(_TINY)) - log_z_c
    return torch.cat([topk_c_K - log_z_c[:, None], tail_logp_c[:, None]], dim=-1)


def teacher_bucket_logps(teacher_logprobs_N_K: Tensor) -> Tensor:
    """`[N, K + 1]`: the teacher's top-k log-probs and log(1 - their mass), the tail bucket."""
    logps = teacher_logprobs_N_K.detach()
    logps = logps if logps.dtype == torch.float64 else logps.float()
    mass_N = torch.logsumexp(logps, dim=-1)
    tail_N = torch.log((-torch.expm1(mass_N.clamp_max(0.0))).clamp_min(_TINY))
    return torch.cat([logps, tail_N[:, None]], dim=-1)


def _topk_jsd_rows(
    student_c_V: Tensor, ids_c_K: Tensor, teacher_c_K: Tensor, beta: float, temperature: float, shards: VocabShards
) -> Tensor:
    logp_s = _policy_bucket_logps(student_c_V, ids_c_K, temperature, shards)
    logp_t = teacher_bucket_logps(teacher_c_K).to(logp_s.dtype)
    return divergence_from_logps(logp_s, logp_t, beta)


def topk_generalized_jsd(
    student_logits: Tensor,
    teacher_topk_ids: Tensor,
    teacher_topk_logprobs: Tensor,
    mask: Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    token_clip: float | None = None,
    chunk_size: int | None = None,
    shards: VocabShards | None = None,
) -> JSDOutput:
    """`generalized_jsd` (beta, token_clip, same output) with the teacher given as top-k ids and
    log-probs, over the k top ids plus one tail bucket on both sides (module docstring).

    Shapes: `student_logits` `[..., V_local]` (this rank's vocabulary slice, the whole vocabulary
    on one rank), `teacher_topk_ids` / `teacher_topk_logprobs` `[..., K]` (global ids, distinct
    per token, log-probs at `temperature`), `mask` the leading shape (None: every token).
    `chunk_size`: tokens per chunk in forward and backward (recomputed), so the float32
    temporaries are a few `[chunk_size, V_local]` tensors. `shards`: the vocabulary split
    (`ProcessGroupShards(group)`), None for one rank; every rank must call with the same ids,
    teacher log-probs and mask.
    """
    if (
        teacher_topk_ids.shape != teacher_topk_logprobs.shape
        or teacher_topk_ids.shape[:-1] != student_logits.shape[:-1]
    ):
        raise ValueError(
            f"expected student logits [..., V] and teacher top-k ids and log-probs [..., K] over the same tokens, got "
            f"{tuple(student_logits.shape)}, {tuple(teacher_topk_ids.shape)} and {tuple(teacher_topk_logprobs.shape)}"
        )
    check_jsd_settings(beta, temperature, token_clip)
    V, K = student_logits.shape[-1], teacher_topk_ids.shape[-1]
    mask_b = as_bool_mask(mask, student_logits.shape[:-1], student_logits)
    row_idx = selected_rows(mask_b.reshape(-1))
    fn = partial(_topk_jsd_rows, beta=float(beta), temperature=float(temperature), shards=shards or VocabShards())
    inputs = (
        student_logits.reshape(-1, V),
        teacher_topk_ids.reshape(-1, K),
        teacher_topk_logprobs.detach().reshape(-1, K),
    )
    div_n = rowwise(fn, inputs, row_idx, chunk_size)
    return _jsd_output(div_n, row_idx, mask_b, token_clip)


def teacher_topk(teacher_logits: Tensor, k: int, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """(ids, log-probs) `[..., k]` of the k most likely tokens of softmax(teacher_logits / T), as
    a scoring server returns them (`top_logprobs_num`); no gradient."""
    with torch.no_grad():
        logps = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
        values, ids = logps.topk(min(int(k), logps.shape[-1]), dim=-1)
    return ids, values


def topk_bytes_per_token(k: int) -> int:
    """What the teacher's top-k costs per response token when carried with a sample: k ids and k
    log-probs, float32 each (ids below 2**24 are exact in float32)."""
    return 2 * int(k) * 4


__all__ = [
    "ProcessGroupShards",
    "VocabShards",
    "teacher_bucket_logps",
    "teacher_topk",
    "topk_bytes_per_token",
    "topk_generalized_jsd",
]
