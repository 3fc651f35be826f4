"""How many problems one outer step draws, and how they split into train, holdout and groups.

`--rollout-batch-size` N counts every problem drawn: train = round(N x --inner-loop-train-ratio)
(half up) or N - --heldout-ipb, holdout = the rest, teacher prompts (GRPO groups) = train /
--n-problems-per-prompt. A split that cannot work is refused at start with the nearest sizes
that do, before any process starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slime_meta.errors import UserInputError

if TYPE_CHECKING:
    from slime_meta.config.arguments import MetaConfig


@dataclass(frozen=True)
class BatchPlan:
    """What one outer step draws: `problems` = `train` + `holdout` (`--rollout-batch-size`).

    The train problems form `groups` teacher prompts (GRPO groups) of `problems_per_prompt` each.
    Without families every info is judged on the one holdout set of the step; with families
    (`--group-key`) each teacher prompt draws its train and its holdout share from one family, so
    the holdout splits evenly: `holdout_per_episode` = holdout / groups.
    """

    problems: int
    train: int
    holdout: int
    problems_per_prompt: int
    per_family: bool

    @property
    def groups(self) -> int:
        return self.train // self.problems_per_prompt

    @property
    def holdout_per_episode(self) -> int:
        return self.holdout // self.groups if self.per_family else self.holdout

    @property
    def draw_sizes(self) -> dict[str, int]:
        """Keyword arguments of `ProblemSampler.next_episodes` for one step."""
        return {
            "num_prompts": self.groups,
            "problems_per_prompt": self.problems_per_prompt,
            "num_holdout": self.holdout_per_episode,
        }

    def describe(
        self, *, samples_per_prompt: int, inner_iterations: int, inner_samples: int, holdout_samples: int
    ) -> str:
        """One line: the split, the groups and chains, and the requests one step sends."""
        chains = self.groups * samples_per_prompt
        inner = chains * inner_iterations * self.problems_per_prompt * inner_samples
        holdout = chains * self.holdout_per_episode * holdout_samples
        control = self.holdout * holdout_samples
        # The attempts at one problem go out as one student request with n = their number.
        student_requests = sum(
            requests if samples > 0 else 0
            for requests, samples in (
                (chains * inner_iterations * self.problems_per_prompt, inner_samples),
                (chains * self.holdout_per_episode + self.holdout, holdout_samples),
            )
        )
        family = f", {self.holdout_per_episode} holdout per family" if self.per_family else ""
        return (
            f"plan per step: {self.problems} problems = {self.train} train + {self.holdout} holdout{family}; "
            f"{self.groups} teacher prompts (GRPO groups) of {self.problems_per_prompt} x {samples_per_prompt} infos = "
            f"{chains} chains; requests: {chains * inner_iterations} teacher, {inner} student inner "
            f"+ {holdout} holdout + {control} no-info control (each graded), in {student_requests} student "
            "requests (n = attempts per problem)"
        )


def _split(
    problems: int, train_ratio: float, heldout_ipb: int | None, k: int, per_family: bool
) -> tuple[int, int, str | None]:
    """(train, holdout, what is wrong or None)."""
    if heldout_ipb is not None:
        train = problems - heldout_ipb
    else:
        train = math.floor(problems * train_ratio + 0.5 + 1e-9)  # round half up, whatever the float error
    holdout = problems - train
    if train < 1:
        return train, holdout, "no train problems are left"
    if holdout < 1:
        return train, holdout, "no holdout problems are left (the reward is their grade)"
    if train % k:
        return (
            train,
            holdout,
            f"{train} train problems do not split into teacher prompts of --n-problems-per-prompt {k}",
        )
    if per_family and holdout % (train // k):
        return (
            train,
            holdout,
            (
                f"with --group-key the {holdout} holdout problems must split evenly over the {train // k} teacher "
                "prompts (one family each)"
            ),
        )
    return train, holdout, None


def plan_batch(
    *,
    rollout_batch_size: int,
    train_ratio: float,
    heldout_ipb: int | None,
    problems_per_prompt: int,
    per_family: bool = False,
) -> BatchPlan:
    """The split of `rollout_batch_size` problems; a UserInputError naming the flags and the
    nearest `--rollout-batch-size` values that work when the split is impossible."""
    n, k = rollout_batch_size, problems_per_prompt
    if n < 1 or k < 1:
        raise UserInputError(f"--rollout-batch-size {n} and --n-problems-per-prompt {k} must both be at least 1")
    if heldout_ipb is not None and heldout_ipb < 1:
        raise UserInputError(f"--heldout-ipb {heldout_ipb}: need at least 1 holdout problem (the reward is its grade)")
    if heldout_ipb is None and not 0.0 < train_ratio < 1.0:
        raise UserInputError(f"--inner-loop-train-ratio {train_ratio}: must be strictly between 0 and 1 (e.g. 0.75)")
    train, holdout, problem = _split(n, train_ratio, heldout_ipb, k, per_family)
    if problem is None:
        return BatchPlan(problems=n, train=train, holdout=holdout, problems_per_prompt=k, per_family=per_family)
    split_flag = (
        f"--heldout-ipb {heldout_ipb}" if heldout_ipb is not None else f"--inner-loop-train-ratio {train_ratio}"
    )
    nearest = []
    for candidates in (range(n - 1, 1, -1), range(n + 1, n + 100_000)):
        for m in candidates:
            t, h, bad = _split(m, train_ratio, heldout_ipb, k, per_family)
            if bad is None:
                nearest.append(f"{m} ({t} train + {h} holdout)")
                break
    if nearest:
        hint = "nearest --rollout-batch-size that works: " + " or ".join(nearest)
    else:  # e.g. --group-key with a ratio: one family per teacher prompt rarely shares the holdout evenly
        by_distance = sorted(range(1, n), key=lambda h: abs(h - holdout))
        working = [(h, _split(n, train_ratio, h, k, per_family)) for h in by_distance]
        found = next((f"{h} ({t} train + {h} holdout)" for h, (t, _, bad) in working if bad is None), None)
        hint = (
            (
                f"no --rollout-batch-size works with {split_flag}; nearest --heldout-ipb that works with "
                f"--rollout-batch-size {n}: {found}"
            )
            if found
            else "raise --rollout-batch-size"
        )
    raise UserInputError(
        f"--rollout-batch-size {n} with {split_flag} and --n-problems-per-prompt {k} gives "
        f"{train} train + {holdout} holdout problems: {problem}; {hint}"
    )


def batch_plan(cfg: MetaConfig) -> BatchPlan:
    """The sizes one step draws (problems, train, holdout, teacher prompts) from the config's flags."""
    m = cfg.meta
    return plan_batch(
        rollout_batch_size=m.rollout_batch_size,
        train_ratio=m.inner_loop_train_ratio,
        heldout_ipb=m.heldout_ipb,
        problems_per_prompt=m.n_problems_per_prompt,
        per_family=cfg.data.group_key is not None,
    )
