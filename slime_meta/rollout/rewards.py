"""From holdout grades to rewards and GRPO advantages, per group of G infos.

Two ways, chosen by `--holdout-advantage`:
  mean-then-normalize  reward_g = mean_h score[g, h]; advantage = GRPO over the G rewards.
  normalize-then-mean  normalise each holdout problem's scores across the G infos first, then
                       average over holdout problems (the published slime module's way: a hard
                       holdout problem on which every info scores low adds no noise).
"""

from __future__ import annotations

from typing import Sequence

import torch

from slime_meta.losses.advantages import grpo_advantages


def group_rewards_and_advantages(
    scores_G_H: Sequence[Sequence[float]], *, mode: str, std_normalize: bool
) -> tuple[list[float], list[float]]:
    scores = torch.tensor(scores_G_H, dtype=torch.float64)
    group_size, num_holdout = scores.shape
    rewards_G = scores.mean(dim=1)
    if mode == "mean-then-normalize":
        advantages_G = grpo_advantages(rewards_G, group_size, std_normalize=std_normalize)
    elif mode == "normalize-then-mean":
        # Columns are holdout problems: normalise each across the G infos (one GRPO group per column).
        per_problem_H_G = grpo_advantages(scores.T.reshape(-1), group_size, std_normalize=std_normalize)
        advantages_G = per_problem_H_G.reshape(num_holdout, group_size).mean(dim=0)
    else:
        raise ValueError(f"unknown holdout advantage mode {mode!r}")
    return rewards_G.tolist(), advantages_G.tolist()
