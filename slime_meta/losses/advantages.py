"""Advantage estimators: GRPO group baselines and context-distillation shaping."""

from __future__ import annotations

import torch
from torch import Tensor

from ._common import broadcast_per_sample, check_same_shape, compute_dtype


def grpo_advantages(rewards: Tensor, group_size: int, std_normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages, `[N] -> [N]` (detached).

    `rewards_N` has `N = n_groups * group_size`; samples `[g*K, (g+1)*K)` form group `g`
    (K = group_size), i.e. the rollouts of one prompt are consecutive.

        std_normalize=True  (GRPO):     A_i = (r_i - mean_g) / (std_g + eps)
        std_normalize=False (Dr. GRPO): A_i =  r_i - mean_g

    `std_g` is the *unbiased* standard deviation (divides by K-1), the `torch.std` default and
    what slime uses. A group whose rewards are all equal gets exactly 0 (also with eps=0); so does
    a group of size 1, which has no baseline (the unbiased std of one sample would be NaN).

    Integer and low-precision rewards compute in float32; float64 stays float64.
    Raises ValueError when `rewards` is not 1-D or `N` is not a multiple of `group_size`.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"len(rewards)={rewards.numel()} is not a multiple of group_size={group_size}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r_G_K = rewards.detach().to(compute_dtype(rewards.dtype)).view(-1, group_size)
    # A group whose rewards are all equal (incl. every group of size 1) has no signal: exactly 0,
    # not mean-rounding noise, and never 0/0 (std of one sample is NaN; eps may be 0).
    constant_G_1 = r_G_K.amax(dim=1, keepdim=True) == r_G_K.amin(dim=1, keepdim=True)
    adv_G_K = r_G_K - r_G_K.mean(dim=1, keepdim=True)
    if std_normalize and group_size > 1:
        std_G_1 = r_G_K.std(dim=1, keepdim=True)  # unbiased (correction=1)
        adv_G_K = adv_G_K / (std_G_1 + eps)
    adv_G_K = torch.where(constant_G_1, torch.zeros((), dtype=adv_G_K.dtype, device=adv_G_K.device), adv_G_K)
    return adv_G_K.reshape(-1)


def context_distillation_advantages(
    task_adv: Tensor,
    teacher_logp: Tensor,
    student_logp: Tensor,
    adv_tau: float,
    teacher_tau: float,
    student_tau: float,
) -> Tensor:
    """Per-token shaped advantage `[B, T]` (detached: advantages never carry gradient).

        A'_{b,t} = adv_tau * A_b(,t) + teacher_tau * log p_teacher(y_t) - student_tau * log p_student(y_t)

    `task_adv` is `[B]` (broadcast over tokens) or `[B, T]`; `teacher_logp` and `student_logp`
    are per-token log-probs `[B, T]` of the sampled tokens. With teacher_tau == student_tau = tau
    the extra term is `-tau * (log p_student - log p_teacher)`, a per-token reverse-KL reward:
    a policy gradient on it pulls the student towards tokens the teacher finds likelier.
    Masking is the caller's job (pass the result to `policy_loss` with the response mask).
    """
    check_same_shape("teacher_logp", teacher_logp, student_logp=student_logp)
    adv_B_T = broadcast_per_sample(task_adv.detach(), teacher_logp.shape, "task_adv")
    dtype = compute_dtype(teacher_logp.dtype)
    out_B_T = (
        adv_tau * adv_B_T.to(dtype)
        + teacher_tau * teacher_logp.detach().to(dtype)
        - student_tau * student_logp.detach().to(dtype)
    )
    return out_B_T
