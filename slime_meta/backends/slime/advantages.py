"""slime's `--custom-advantage-function-path`: context distillation on top of our GRPO advantages.

    context_distillation(args, rollout_data) -> None   (sets rollout_data["advantages"], ["returns"])

slime calls it on the trainer, per data-parallel rank, after the reference KL and before any
--normalize-advantages whitening. `rollout_data["rewards"][i]` is already sample i's GRPO
advantage over the holdout rewards (the reward post-process plugin put it there). Per response
token t of sample i:

    A[i, t] = adv_tau * reward[i] + teacher_tau * teacher_logp[i, t] - student_tau * student_logp[i, t]

teacher_logp: `Sample.teacher_log_probs`, the info's tokens scored under the context-conditioned
teacher prompt (--teacher-context or --context-key) by the rollout; student_logp: the trainer's
own log-probs (`log_probs`, or the engine's with --use-rollout-logprobs), as slime's on-policy
distillation uses them. Without teacher log-probs every token gets reward[i]: slime's GRPO.
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

import torch

from slime_meta.losses import context_distillation_advantages


def context_distillation(args: Namespace, rollout_data: dict[str, Any]) -> None:
    rewards, shapes = rollout_data["rewards"], rollout_data["kl"]  # kl: one [R_i] tensor per sample
    teacher = rollout_data.get("teacher_log_probs")
    student = (
        rollout_data.get("rollout_log_probs")
        if getattr(args, "use_rollout_logprobs", False)
        else rollout_data.get("log_probs")
    )
    student = student or rollout_data.get("rollout_log_probs")
    taus = {
        "adv_tau": 1.0 if getattr(args, "adv_tau", None) is None else float(args.adv_tau),  # not given: GRPO kept
        "teacher_tau": float(getattr(args, "teacher_tau", 0.0)),
        "student_tau": float(getattr(args, "student_tau", 0.0)),
    }
    advantages = []
    for i, like in enumerate(shapes):
        task = torch.full(like.shape, float(rewards[i]), dtype=torch.float32, device=like.device)
        if teacher is None or student is None:
            advantages.append(task)
            continue
        shaped = context_distillation_advantages(
            task, teacher[i].to(like.device), student[i].to(like.device), **taus
        )  # fmt: skip
        advantages.append(shaped.to(torch.float32))
    rollout_data["advantages"] = advantages
    rollout_data["returns"] = [a.clone() for a in advantages]
