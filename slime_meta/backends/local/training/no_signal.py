"""Steps whose loss has no gradient: every advantage zero and no other term that could move the weights.

With the built-in verifier and a small real model, every grade of a step can be 0: every GRPO
group then has zero spread, so every advantage is 0, and the policy-gradient terms (PPO clip,
dual clip, TIS, AIPO: each a multiple of the advantage) have an exactly zero gradient. A forward
and backward then cost minutes on a CPU to compute a zero, and AdamW would still move the weights
by its momentum alone. The other terms are checked one by one (`zero_gradient_step`):

  entropy bonus      gradient of the entropy itself, nonzero whatever the advantages: a signal
  KL to the start    k2 = d^2/2 and k3 = e^d - d - 1 (d = log p_ref - log p) have zero gradient
                     at d = 0, i.e. while the policy still is the start weights; k1 = -d never does
  SDPO (JSD form)    the hinted and plain distributions differ in general: a signal
  replay DPO         the pairs' log-ratio: a signal
  distillation,      token advantages of their own (taus x log-prob differences): part of the
  SDPO shaping       sequences' advantages, so zero only when those are zero too

`NoSignalStreak` counts such steps and, after `warn_after` in a row, says what the rollouts
looked like and what usually causes it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from statistics import fmean
from typing import Sequence

from slime_meta.backends.local.training.batching import PolicySequence
from slime_meta.types import SolverSample, TeacherSample

# KL estimators whose gradient is zero where the policy equals the reference.
KL_ZERO_GRADIENT_AT_REFERENCE = frozenset({"k2", "k3"})


def zero_gradient_step(
    sequences: Sequence[PolicySequence],
    *,
    entropy_coef: float,
    kl_coef: float,
    kl_type: str,
    policy_is_reference: bool,
    sdpo_jsd_samples: int,
    replay_pairs: int,
) -> bool:
    """True when the step's whole loss provably has a zero gradient (and nothing is left out)."""
    if any(a != 0.0 for x in sequences for a in x.advantages):
        return False
    if sequences and entropy_coef:
        return False
    if sequences and kl_coef and not (policy_is_reference and kl_type in KL_ZERO_GRADIENT_AT_REFERENCE):
        return False
    return not sdpo_jsd_samples and not replay_pairs


@dataclass
class RolloutSummary:
    """What the trainer can tell of a step's rollout from its samples."""

    mean_reward: float  # the infos' mean holdout grade
    groups: int
    groups_with_spread: int  # GRPO groups whose infos' rewards differ
    solver_mean_grade: float | None

    @classmethod
    def of(cls, teacher: Sequence[TeacherSample], solver: Sequence[SolverSample]) -> "RolloutSummary":
        rewards_by_group: dict[int, list[float]] = defaultdict(list)
        for x in teacher:
            rewards_by_group[x.group_index].append(x.reward)
        spread = sum(max(r) - min(r) > 1e-9 for r in rewards_by_group.values())
        return cls(
            mean_reward=fmean(x.reward for x in teacher) if teacher else 0.0,
            groups=len(rewards_by_group),
            groups_with_spread=spread,
            solver_mean_grade=fmean(x.grade for x in solver) if solver else None,
        )


class NoSignalStreak:
    """Skipped steps in all and in a row; one console line when a streak reaches `warn_after`."""

    def __init__(self, warn_after: int = 3):
        self.warn_after = warn_after
        self.total = 0
        self.in_a_row = 0
        self.first_of_streak: int | None = None

    def record(self, skipped: bool, step: int | None, summary: RolloutSummary | None = None) -> str | None:
        """Count one step; the warning line when this step makes the streak `warn_after` long."""
        if not skipped:
            self.in_a_row, self.first_of_streak = 0, None
            return None
        self.total += 1
        self.in_a_row += 1
        if self.in_a_row == 1:
            self.first_of_streak = step
        if self.in_a_row != self.warn_after or summary is None:
            return None
        return self.message(step, summary)

    def message(self, step: int | None, summary: RolloutSummary) -> str:
        where = "the last steps"
        if step is not None and self.first_of_streak is not None:
            where = f"steps {self.first_of_streak}-{step}"
        solver = ""
        if summary.solver_mean_grade is not None:
            solver = f", solver attempts' mean grade {summary.solver_mean_grade:.3f}"
        seen = (
            f"{where}: {self.in_a_row} steps in a row without a training signal (mean holdout grade "
            f"{summary.mean_reward:.3f}, {summary.groups_with_spread} of {summary.groups} GRPO groups with a reward "
            f"spread{solver}); forward, backward and optimizer step skipped, weights unchanged"
        )
        if summary.mean_reward == 0.0:
            causes = (
                "every grade is 0: likely answers in a format the grader cannot read (the verifier wants one final "
                "answer, \\boxed{...} or a last 'Answer: ...' line), --rollout-max-response-len too small for the "
                "answer line to be written (finish_reason 'length' in traces.jsonl), or grader replies that do not "
                "parse (the attempts' 'explanation' in traces.jsonl)"
            )
        else:
            causes = (
                "the infos of each group score alike: problems too easy or too hard for the student, or too few "
                "holdout attempts to tell infos apart (--n-holdout-samples, --heldout-ipb)"
            )
        return f"{seen}. {causes}"
