"""Combine the three training channels into one scalar loss with logging metrics."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import Tensor

from ._common import as_bool_mask, masked_mean


@dataclass
class ThreeChannelInputs:
    """The already-computed pieces of one step. Every loss is a scalar tensor or None (absent).

    grpo:        policy-gradient loss, e.g. `policy_loss(...).loss`.
    sdpo_jsd:    self-distillation divergence, e.g. `generalized_jsd(...).loss`.
    replay_dpo:  trace-replay preference loss, e.g. `dpo_loss(...).loss`.
    advantages:  the advantages the policy loss actually used (`[B]` or `[B, T]`), for logging.
    advantages_mask: mask of the same shape as `advantages` selecting the entries to average
                 (e.g. the response mask for `[B, T]` advantages); None = all entries.
    """

    grpo: Tensor | None = None
    sdpo_jsd: Tensor | None = None
    replay_dpo: Tensor | None = None
    advantages: Tensor | None = None
    advantages_mask: Tensor | None = None


@dataclass
class TotalLossOutput:
    """`loss`: scalar to minimise (float32). `metrics`: detached float scalars, see `total_loss`."""

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


_METRIC_KEYS = {"grpo": "loss/grpo", "sdpo_jsd": "loss/sdpo_kl", "replay_dpo": "loss/trace_replay_dpo"}


def total_loss(inputs: ThreeChannelInputs, *, alpha: float, beta: float) -> TotalLossOutput:
    """`loss = grpo + alpha * sdpo_jsd + beta * replay_dpo`, absent (None) terms contributing 0.

    Metrics: `loss/grpo`, `loss/sdpo_kl`, `loss/trace_replay_dpo` hold each present term
    *unweighted*; an absent term is not logged at all (a logged 0 would read as a perfect loss).
    `loss/total` (weighted sum) is always logged; `combined_advantage` (masked mean of
    `inputs.advantages`) when advantages are given. Raises ValueError when every term is None,
    a term is not a scalar, or a weight is not finite.
    """
    if not (math.isfinite(alpha) and math.isfinite(beta)):
        raise ValueError(f"alpha and beta must be finite, got {alpha}, {beta}")
    weights = {"grpo": 1.0, "sdpo_jsd": float(alpha), "replay_dpo": float(beta)}
    total: Tensor | None = None
    metrics: dict[str, Tensor] = {}
    for name, weight in weights.items():
        term = getattr(inputs, name)
        if term is None:
            continue
        if term.dim() != 0:
            raise ValueError(f"ThreeChannelInputs.{name} must be a scalar tensor, got shape {tuple(term.shape)}")
        term = term.float()
        metrics[_METRIC_KEYS[name]] = term.detach()
        weighted = term if weight == 1.0 else weight * term
        total = weighted if total is None else total + weighted
    if total is None:
        raise ValueError("total_loss: every term of ThreeChannelInputs is None")
    metrics["loss/total"] = total.detach()
    if inputs.advantages is not None:
        adv = inputs.advantages.detach().float()
        mask_b = as_bool_mask(inputs.advantages_mask, adv.shape, adv, name="advantages_mask")
        metrics["combined_advantage"] = masked_mean(adv, mask_b)
    return TotalLossOutput(loss=total, metrics=metrics)
