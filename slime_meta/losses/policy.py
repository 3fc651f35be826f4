"""Policy-gradient loss (PPO / GRPO clip, dual clip, TIS, AIPO) and KL penalties.

Sign convention: every loss here is *minimised*. A positive advantage makes the loss
decrease as `logp` of that token increases, so gradient descent raises its probability.
Values at masked-out positions are ignored, even if they are garbage (NaN/inf logps there
produce neither NaN losses nor NaN gradients).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from ._common import (
    as_bool_mask,
    broadcast_per_sample,
    check_same_shape,
    fraction,
    masked_extreme,
    masked_mean,
)

LossAggregation = Literal["token_mean", "sample_mean"]


@dataclass
class PolicyLossOutput:
    """`loss`: scalar to minimise. `per_token_loss`: same shape as `logp`, 0 where masked,
    with gradient (for callers that normalise themselves, e.g. by a global token count).
    `metrics`: detached float scalars."""

    loss: Tensor
    per_token_loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class KLPenaltyOutput:
    """`kl`: masked mean (scalar, with gradient to `logp`). `per_token`: shape of `logp`, 0 where masked."""

    kl: Tensor
    per_token: Tensor


def aggregate(per_token: Tensor, mask: Tensor, mode: str) -> Tensor:
    """Reduce a per-token loss (already 0 where masked).

    token_mean:  sum over all masked tokens / number of masked tokens (GRPO "token-mean").
    sample_mean: per-sample masked mean, then mean over samples that have >= 1 token
                 (a sample with an empty mask is left out rather than counted as 0).
    Both give 0 (attached to the graph) when nothing is masked in.
    """
    if mode == "token_mean":
        return masked_mean(per_token, mask)
    if mode == "sample_mean":
        if per_token.dim() != 2:
            raise ValueError(f"sample_mean needs [B, T] tensors, got shape {tuple(per_token.shape)}")
        count_B = mask.sum(dim=1)
        mean_B = per_token.sum(dim=1) / count_B.clamp(min=1).to(per_token.dtype)
        return masked_mean(mean_B, count_B > 0)
    raise ValueError(f"loss_aggregation must be 'token_mean' or 'sample_mean', got {mode!r}")


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
    rollout_logp: Tensor | None = None,
    tis_clip: float | None = None,
    tis_clip_low: float = 0.0,
    aipo_delta: float | None = None,
    loss_aggregation: LossAggregation = "token_mean",
) -> PolicyLossOutput:
    """Clipped policy-gradient loss over per-token tensors.

    Shapes: `logp`, `old_logp`, `rollout_logp`, `mask` are `[B, T]` (or any equal shape, e.g.
    flattened `[N]`); `advantages` is `[B]` (broadcast over T) or the token shape. `mask` is
    non-zero on response tokens. `logp` carries the gradient; `old_logp` (the policy that
    computed the advantages, pi_old), `rollout_logp` (the inference engine that sampled, mu) and
    `advantages` are treated as constants. Computation is float32 whatever the input dtype.

    PPO / GRPO (default), with `ratio = exp(logp - old_logp)`, `eps_high = eps_clip_high or eps_clip`:
        pg = max(-ratio * A, -clamp(ratio, 1 - eps_clip, 1 + eps_high) * A)
    Dual clip (`eps_clip_c > 1`), for A < 0 only:   pg = min(pg, -eps_clip_c * A)
    Truncated importance sampling (`rollout_logp` and `tis_clip` given):
        pg = pg * w,   w = clamp(exp(old_logp - rollout_logp), tis_clip_low, tis_clip)   (detached)
    AIPO (`aipo_delta` given; needs `rollout_logp`; replaces the PPO clip, so `eps_clip*` are
    ignored and `eps_clip_c` / `tis_clip` must be None):
        pg = -clamp(exp(logp - rollout_logp), max=aipo_delta) * A
        Tokens whose ratio exceeds delta contribute a constant (no gradient).

    Loss: `loss_aggregation` "token_mean" (mean over all masked tokens of the batch) or
    "sample_mean" (per-sample masked mean, then mean over non-empty samples).
    On-policy (logp == old_logp) the token-mean loss equals `-mean(A)` and its gradient is the
    REINFORCE gradient `-A * d logp / N_tokens`.

    Metrics (detached, over masked tokens): `clipfrac` (tokens whose gradient the active clip
    removes: PPO clip, or AIPO's delta), `ratio_mean` (pi/pi_old), `approx_kl` (k1:
    mean(old_logp - logp)), `approx_kl_k3` (mean(ratio - 1 - log ratio)); `dual_clipfrac` with
    dual clip; `tis_weight_mean/min/max`, `tis_clipfrac` (raw weight outside the clamp range)
    with TIS; `aipo_ratio_mean` with AIPO; `rollout_kl_k1` (mean(rollout_logp - old_logp)) whenever
    `rollout_logp` is given (it is otherwise unused without TIS/AIPO).
    """
    shape = logp.shape
    check_same_shape("logp", logp, old_logp=old_logp, rollout_logp=rollout_logp)
    mask_b = as_bool_mask(mask, shape, logp)
    adv = broadcast_per_sample(advantages.detach(), shape, "advantages").float()
    if eps_clip < 0 or (eps_clip_high is not None and eps_clip_high < 0):
        raise ValueError("eps_clip and eps_clip_high must be >= 0")

    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    logp32 = logp.float()
    old32 = old_logp.detach().float()
    log_ratio = torch.where(mask_b, logp32 - old32, zero)  # masked-out garbage never reaches exp
    ratio = torch.exp(log_ratio)
    roll32 = rollout_logp.detach().float() if rollout_logp is not None else None
    metrics: dict[str, Tensor] = {}

    if aipo_delta is not None:
        if roll32 is None:
            raise ValueError("aipo_delta needs rollout_logp (the sampler's log-probs)")
        if tis_clip is not None or eps_clip_c is not None:
            raise ValueError("aipo_delta replaces PPO clipping and TIS: leave tis_clip and eps_clip_c None")
        if aipo_delta <= 0:
            raise ValueError(f"aipo_delta must be > 0, got {aipo_delta}")
        ratio_mu = torch.exp(torch.where(mask_b, logp32 - roll32, zero))
        pg = -torch.clamp(ratio_mu, max=aipo_delta) * adv
        metrics["clipfrac"] = fraction(ratio_mu > aipo_delta, mask_b)
        metrics["aipo_ratio_mean"] = masked_mean(ratio_mu, mask_b).detach()
    else:
        eps_high = eps_clip if eps_clip_high is None else eps_clip_high
        pg_unclipped = -ratio * adv
        pg_clipped = -torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_high) * adv
        clip_active = pg_clipped > pg_unclipped
        pg = torch.where(clip_active, pg_clipped, pg_unclipped)
        metrics["clipfrac"] = fraction(clip_active, mask_b)
        if eps_clip_c is not None:
            if eps_clip_c <= 1.0:
                raise ValueError(f"eps_clip_c must be > 1, got {eps_clip_c}")
            pg_dual = -eps_clip_c * adv
            dual_active = (adv < 0) & (pg > pg_dual)
            pg = torch.where(dual_active, pg_dual, pg)
            metrics["dual_clipfrac"] = fraction(dual_active, mask_b)
        if tis_clip is not None:
            if roll32 is None:
                raise ValueError("tis_clip needs rollout_logp (the sampler's log-probs)")
            if not 0.0 <= tis_clip_low <= tis_clip:
                raise ValueError(f"need 0 <= tis_clip_low <= tis_clip, got {tis_clip_low}, {tis_clip}")
            raw_w = torch.exp(torch.where(mask_b, old32 - roll32, zero))
            w = torch.clamp(raw_w, tis_clip_low, tis_clip)
            pg = pg * w
            metrics["tis_weight_mean"] = masked_mean(w, mask_b).detach()
            metrics["tis_weight_min"] = masked_extreme(w, mask_b, largest=False)
            metrics["tis_weight_max"] = masked_extreme(w, mask_b, largest=True)
            metrics["tis_clipfrac"] = fraction((raw_w < tis_clip_low) | (raw_w > tis_clip), mask_b)

    per_token = torch.where(mask_b, pg, zero)
    loss = aggregate(per_token, mask_b, loss_aggregation)

    metrics["ratio_mean"] = masked_mean(ratio, mask_b).detach()
    metrics["approx_kl"] = masked_mean(-log_ratio, mask_b).detach()
    metrics["approx_kl_k3"] = masked_mean(ratio - 1.0 - log_ratio, mask_b).detach()
    if roll32 is not None:
        metrics["rollout_kl_k1"] = masked_mean(torch.where(mask_b, roll32 - old32, zero), mask_b).detach()
    return PolicyLossOutput(loss=loss, per_token_loss=per_token, metrics=metrics)


def kl_penalty(logp: Tensor, ref_logp: Tensor, mask: Tensor, kind: str = "k3") -> KLPenaltyOutput:
    """Per-token KL(pi || ref) estimate on sampled tokens, `d = ref_logp - logp` (ref detached):

        k1 = logp - ref_logp = -d               (unbiased, can be negative)
        k2 = 0.5 * d**2
        k3 = exp(d) - d - 1                      (unbiased, always >= 0, low variance)

    Returns the masked token mean (scalar, gradient to `logp`) and the per-token values.
    """
    check_same_shape("logp", logp, ref_logp=ref_logp)
    mask_b = as_bool_mask(mask, logp.shape, logp)
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    d = torch.where(mask_b, ref_logp.detach().float() - logp.float(), zero)
    if kind == "k1":
        per_token = -d
    elif kind == "k2":
        per_token = 0.5 * d * d
    elif kind == "k3":
        per_token = torch.exp(d) - d - 1.0
    else:
        raise ValueError(f"kind must be 'k1', 'k2' or 'k3', got {kind!r}")
    per_token = torch.where(mask_b, per_token, zero)
    return KLPenaltyOutput(kl=masked_mean(per_token, mask_b), per_token=per_token)
