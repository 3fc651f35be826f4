"""Direct preference optimisation (DPO) loss over per-sequence log-probs."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from ._common import check_same_shape


@dataclass
class DPOOutput:
    """`loss`: scalar. `chosen_rewards`, `rejected_rewards`: `[P]` implicit rewards (detached).
    `reward_accuracy`: fraction of pairs with chosen_reward > rejected_reward (strict; ties count
    as wrong). `reward_margin`: mean(chosen_rewards - rejected_rewards). All but `loss` detached."""

    loss: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor
    reward_accuracy: Tensor
    reward_margin: Tensor

    @property
    def metrics(self) -> dict[str, Tensor]:
        return {
            "chosen_reward": self.chosen_rewards.mean(),
            "rejected_reward": self.rejected_rewards.mean(),
            "reward_accuracy": self.reward_accuracy,
            "reward_margin": self.reward_margin,
        }


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
) -> DPOOutput:
    """Sigmoid DPO loss over `P` preference pairs.

    Inputs are per-sequence summed log-probs `[P]` (e.g. `sequence_logps(...).seq_logps`);
    the policy terms carry gradient, the reference terms are detached.

        delta = (chosen - ref_chosen) - (rejected - ref_rejected)
        loss  = mean_p -log sigmoid(beta * delta_p)          (= log 2 at delta = 0)
        chosen_rewards = beta * (chosen - ref_chosen),  rejected_rewards = beta * (rejected - ref_rejected)
    """
    check_same_shape(
        "chosen_logps",
        chosen_logps,
        rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    if chosen_logps.dim() != 1 or chosen_logps.numel() == 0:
        raise ValueError(f"expected non-empty 1-D [P] log-probs, got shape {tuple(chosen_logps.shape)}")
    chosen_lr = chosen_logps.float() - ref_chosen_logps.detach().float()
    rejected_lr = rejected_logps.float() - ref_rejected_logps.detach().float()
    loss = -F.logsigmoid(beta * (chosen_lr - rejected_lr)).mean()
    chosen_rewards = (beta * chosen_lr).detach()
    rejected_rewards = (beta * rejected_lr).detach()
    return DPOOutput(
        loss=loss,
        chosen_rewards=chosen_rewards,
        rejected_rewards=rejected_rewards,
        reward_accuracy=(chosen_rewards > rejected_rewards).float().mean(),
        reward_margin=(chosen_rewards - rejected_rewards).mean(),
    )
