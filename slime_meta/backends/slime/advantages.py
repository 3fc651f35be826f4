"""slime's `--custom-advantage-function-path`: per-token advantages of the teacher's infos and of
the policy's own solutions (solver samples), as the local trainer gives them.

    meta_advantages(args, rollout_data) -> None   (sets rollout_data["advantages"], ["returns"])

slime calls it on the trainer, per data-parallel rank, after the reference KL and before any
--normalize-advantages whitening. `rollout_data["rewards"][i]` is what the reward post-process
plugin returned: an info's GRPO advantage over the holdout rewards, a solver sample's task
advantage (GRPO over the m attempts at its problem; 0 with --skip-verification). The kind of a
sample is told by its index (`samples.kind_of_index`: info, distill, sdpo).

    info:           A[i, t] = reward[i]
    replay side:    A[i, t] = reward[i] = +-replay_beta * w of its pair (replay_samples.py)
    solver, distillation (--teacher-tau / --student-tau):
                    A[i, t] = adv_tau * reward[i] + teacher_tau * teacher_logp[i, t] - student_tau * rollout_logp[i, t]

    solver, SDPO shaping form (--sdpo-alpha with --sdpo-form shaping), error sites only:
                    A[i, t] = sdpo_alpha * (teacher_logp[i, t] - rollout_logp[i, t])

teacher_logp: `teacher_log_probs`, the solver's answer scored under its prompt with the context
(`slime_meta.rollout.solver_samples.distillation_prompt_ids`), or with the hint for SDPO; rollout_logp:
the engine's log-probs of the answer, as on the local backend. --adv-tau not given means 0 on
both backends.
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

import torch

from slime_meta.backends.slime.samples import kind_of_index
from slime_meta.losses.advantages import context_distillation_advantages


def _taus(args: Namespace) -> dict[str, float]:
    adv_tau = getattr(args, "adv_tau", None)
    return {
        "adv_tau": 0.0 if adv_tau is None else float(adv_tau),  # not given: the solver's task term is off
        "teacher_tau": float(getattr(args, "teacher_tau", 0.0) or 0.0),
        "student_tau": float(getattr(args, "student_tau", 0.0) or 0.0),
    }


def solver_advantages(
    args: Namespace, kind: str, reward: float, teacher_logp: torch.Tensor, rollout_logp: torch.Tensor
) -> torch.Tensor:
    """One solver sample's token advantages `[R]` (float32); `kind` "distill" or "sdpo". On the device of
    `teacher_logp` (slime's actor holds some of the rollout's tensors on the GPU, others on the host)."""
    device = teacher_logp.device
    task = torch.tensor([float(reward)], dtype=torch.float64, device=device)
    rollout_logp = rollout_logp.to(device)
    if kind == "sdpo":  # alpha * (log p_hint - log p), no task term: as the local shaping pass
        alpha = float(args.sdpo_alpha)
        taus = {"adv_tau": 0.0, "teacher_tau": alpha, "student_tau": alpha}
    else:
        taus = _taus(args)
    shaped = context_distillation_advantages(task, teacher_logp.double()[None], rollout_logp.double()[None], **taus)
    return shaped[0].to(torch.float32)


def meta_advantages(args: Namespace, rollout_data: dict[str, Any]) -> None:
    rewards, shapes = rollout_data["rewards"], rollout_data["kl"]  # kl: one [R_i] tensor per sample
    indices = rollout_data.get("sample_indices") or [0] * len(shapes)
    teacher, rollout = rollout_data.get("teacher_log_probs"), rollout_data.get("rollout_log_probs")
    advantages = []
    for i, like in enumerate(shapes):
        kind = kind_of_index(indices[i])
        if kind in ("distill", "sdpo") and teacher is not None and rollout is not None:
            advantages.append(solver_advantages(args, kind, float(rewards[i]), teacher[i], rollout[i]).to(like.device))
        else:
            advantages.append(torch.full(like.shape, float(rewards[i]), dtype=torch.float32, device=like.device))
    rollout_data["advantages"] = advantages
    rollout_data["returns"] = [a.clone() for a in advantages]
