"""Generalised Jensen-Shannon divergence between student and teacher token distributions (GKD)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor

from ._common import as_bool_mask, masked_extreme, masked_mean, rowwise, scatter_rows, selected_rows


@dataclass
class JSDOutput:
    """`loss`: mean over masked tokens of the (clipped) per-token divergence, gradient to the
    student only. `per_token`: shape of the mask, 0 where masked, with gradient. `metrics`:
    detached scalars `divergence_mean` (before token_clip), `divergence_max`, `num_tokens`,
    and `token_clipfrac` when `token_clip` is set."""

    loss: Tensor
    per_token: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


def _kl_rows(logp_a: Tensor, logp_b: Tensor) -> Tensor:
    """KL(a || b) per row, from log-probs."""
    return (logp_a.exp() * (logp_a - logp_b)).sum(dim=-1)


def _jsd_rows(student_c_V: Tensor, teacher_c_V: Tensor, beta: float, temperature: float, top_k: int | None) -> Tensor:
    s, t = student_c_V.float(), teacher_c_V.float()
    if temperature != 1.0:
        s, t = s / temperature, t / temperature
    if top_k is not None:
        ids = t.topk(top_k, dim=-1).indices
        s, t = s.gather(-1, ids), t.gather(-1, ids)
    logp_s = torch.log_softmax(s, dim=-1)
    logp_t = torch.log_softmax(t, dim=-1)
    if beta == 0.0:
        return _kl_rows(logp_t, logp_s)
    if beta == 1.0:
        return _kl_rows(logp_s, logp_t)
    logp_m = torch.logaddexp(logp_t + math.log(beta), logp_s + math.log1p(-beta))
    return beta * _kl_rows(logp_t, logp_m) + (1.0 - beta) * _kl_rows(logp_s, logp_m)


def generalized_jsd(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Tensor | None,
    beta: float = 0.5,
    temperature: float = 1.0,
    top_k: int | None = None,
    token_clip: float | None = None,
    chunk_size: int | None = None,
) -> JSDOutput:
    """Generalised JSD per token, summed over the vocabulary, averaged over masked tokens.

    With `P_S = softmax(student / temperature)`, `P_T = softmax(teacher / temperature)`
    (float32, no temperature**2 rescaling), `KL(P || Q) = sum_v P_v (log P_v - log Q_v)`:

        beta == 0:     KL(P_T || P_S)   forward KL (mode covering)
        beta == 1:     KL(P_S || P_T)   reverse KL (mode seeking)
        0 < beta < 1:  beta * KL(P_T || M) + (1 - beta) * KL(P_S || M),  M = beta P_T + (1 - beta) P_S
                       (log M = logaddexp(log P_T + log beta, log P_S + log(1 - beta)))

    These are TRL's GKD semantics. Note they are discontinuous at the ends: as beta -> 0 the
    mixture term tends to 0, not to the forward KL used at exactly beta == 0 (same at 1).
    beta = 0.5 is the symmetric JSD (swapping student and teacher gives the same value).

    Shapes: logits `[B, T, V]` with mask `[B, T]`, or flattened `[N, V]` with mask `[N]`
    (`None` = all tokens). Teacher logits are detached (no gradient ever reaches them).
    `top_k`: both distributions are restricted to the teacher's top-k token ids and
    renormalised over those k (log_softmax of the gathered logits).
    `token_clip`: each token's divergence is capped, `min(d, token_clip)`, before averaging
    (capped tokens give no gradient).
    `chunk_size`: compute `chunk_size` tokens at a time in forward and in backward (recomputed),
    so float32 temporaries are about a dozen `[chunk_size, V]` tensors, never `[N, V]`; the
    student gradient is one tensor in the logits' dtype. Chunked and unchunked results agree to
    float32 rounding. Measured on an H100 (torch 2.11), N=8192, V=151936, bf16, beta=0.5,
    forward+backward, memory beyond the inputs: chunk 512: 6.1 GiB / 183 ms; chunk 1024:
    9.9 GiB / 181 ms; unchunked: 49.8 GiB / 128 ms (the bf16 gradient alone is 2.3 GiB).
    """
    if student_logits.shape != teacher_logits.shape or student_logits.dim() < 2:
        raise ValueError(
            f"student and teacher logits must have the same [..., V] shape, got "
            f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}"
        )
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    V = student_logits.shape[-1]
    if top_k is not None and not (isinstance(top_k, int) and 1 <= top_k):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_k is not None and top_k >= V:
        top_k = None  # all ids: identical to the full distribution
    if token_clip is not None and token_clip < 0:
        raise ValueError(f"token_clip must be >= 0, got {token_clip}")

    mask_b = as_bool_mask(mask, student_logits.shape[:-1], student_logits)
    row_idx = selected_rows(mask_b.reshape(-1))
    fn = partial(_jsd_rows, beta=float(beta), temperature=float(temperature), top_k=top_k)
    div_n = rowwise(fn, (student_logits.reshape(-1, V), teacher_logits.detach().reshape(-1, V)), row_idx, chunk_size)

    metrics: dict[str, Tensor] = {
        "divergence_mean": div_n.detach().mean() if div_n.numel() else div_n.new_zeros(()),
        "divergence_max": masked_extreme(div_n, torch.ones_like(div_n, dtype=torch.bool), largest=True),
        "num_tokens": torch.tensor(float(row_idx.numel()), device=div_n.device),
    }
    if token_clip is not None:
        metrics["token_clipfrac"] = (
            (div_n.detach() > token_clip).float().mean() if div_n.numel() else div_n.new_zeros(())
        )
        div_n = torch.clamp(div_n, max=token_clip)
    per_token = scatter_rows(div_n, row_idx, mask_b)
    return JSDOutput(loss=masked_mean(per_token, mask_b), per_token=per_token, metrics=metrics)
