"""Steps without a training signal: every advantage zero and no other term with a gradient of its own.

Such a step runs no forward, leaves the weights and AdamW's state as they were, is counted, and a
streak of them is said on the console with the rollout's numbers. Every term that can move the
weights on its own keeps the step. Real tensors throughout: the tiny Llama checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from test_trainer_memory import moved_reference

from slime_meta.artifacts.tracking import format_step_line
from slime_meta.backends.local.training.batching import MicroBatching
from slime_meta.backends.local.training.channels import LossSettings, policy_gradient_pass
from slime_meta.backends.local.training.no_signal import NoSignalStreak, RolloutSummary, zero_gradient_step
from slime_meta.backends.local.training.settings import DistillSettings, TrainerSettings
from slime_meta.backends.local.training.trainer import LocalTrainer, teacher_sequences
from slime_meta.types import PreferencePair, SolverSample, TeacherSample

# The shared student's default objective: solver-role GRPO (--adv-tau 1) and k3 KL to the start weights.
SHIPPED = TrainerSettings(
    lr=1e-2,
    device="cpu",
    micro_batch_size=2,
    distill=DistillSettings(adv_tau=1.0),
    loss=LossSettings(kl_loss_coef=0.1, kl_loss_type="k3"),
)
TRAINER_LOG = "slime_meta.backends.local.training.trainer"


def ids(g: torch.Generator, n: int) -> tuple[int, ...]:
    return tuple(int(x) for x in torch.randint(4, 60, (n,), generator=g))


def logprobs(g: torch.Generator, n: int) -> tuple[float, ...]:
    return tuple((-torch.rand(n, generator=g) * 3).tolist())


def rollout(reward: float = 0.0, advantages=(0.0, 0.0, 0.0, 0.0), seed: int = 0):
    """Two GRPO groups of two infos, and two graded solver attempts per group (task advantage 0)."""
    g = torch.Generator().manual_seed(seed)
    teacher = [
        TeacherSample(
            ids(g, 9 + i),
            ids(g, 4),
            logprobs(g, 4),
            reward=reward,
            advantage=a,
            group_index=i // 2,
            sample_index=i % 2,
            inner_iteration=0,
        )
        for i, a in enumerate(advantages)
    ]
    solver = [
        SolverSample(
            problem_uid=str(i // 2),
            prompt_ids=ids(g, 7),
            response_ids=ids(g, 3 + i),
            rollout_logprobs=logprobs(g, 3 + i),
            temperature=1.0,
            grade=reward,
            task_advantage=0.0,
            prompt_text="p",
            solution_text="s",
            context_prompt_ids=ids(g, 10),
            teacher_logprobs=logprobs(g, 3 + i),
            hint_prompt_ids=ids(g, 9),
            is_error_site=reward < 1.0,
        )
        for i in range(4)
    ]
    return teacher, solver


def counting_forwards(trainer: LocalTrainer) -> list[int]:
    calls: list[int] = []
    trainer.model.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


def parameters(trainer: LocalTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_zero_advantage_step_at_the_shipped_objective_runs_nothing_and_changes_nothing(tiny_checkpoint):
    trainer = LocalTrainer(str(tiny_checkpoint), SHIPPED, reference_path=str(tiny_checkpoint))
    forwards, before = counting_forwards(trainer), parameters(trainer)
    teacher, solver = rollout()
    metrics = trainer.train_step(teacher, solver, step=0)
    assert metrics["train/skipped_no_signal"] == 1.0 and metrics["train/skipped_no_signal_total"] == 1.0
    assert (
        metrics["train/loss"] == 0.0 and metrics["train/grad_norm"] == 0.0 and metrics["train/skipped_nonfinite"] == 0.0
    )
    assert metrics["train/num_sequences"] == 8.0  # 4 infos + 4 solver attempts were there, and all had advantage 0
    assert forwards == [] and trainer.steps_done == 0 and trainer.optimizer.state_dict()["state"] == {}
    assert all(torch.equal(a, b) for a, b in zip(before, parameters(trainer)))
    assert all(p.grad is None for p in trainer.model.parameters())
    assert "no signal, update skipped (1 so far)" in format_step_line(0, metrics)


def test_the_skipped_computation_would_have_given_an_exactly_zero_gradient(tiny_checkpoint):
    """What the skip leaves out, computed: the PPO terms at zero advantage and k3 KL at the start
    weights backpropagate exact zeros into every parameter."""
    trainer = LocalTrainer(str(tiny_checkpoint), SHIPPED, reference_path=str(tiny_checkpoint))
    teacher, _ = rollout()
    sequences = teacher_sequences(teacher, 1.0)
    policy_gradient_pass(
        trainer._forward(trainer.model),
        sequences,
        SHIPPED.loss,
        MicroBatching(2, 0, trainer.device),
        reference_is_policy=True,
    )
    grads = [p.grad for p in trainer.model.parameters()]
    assert all(g is not None for g in grads) and all(torch.count_nonzero(g) == 0 for g in grads)


def test_a_streak_of_three_says_so_once_with_the_rollouts_numbers(tiny_checkpoint, caplog):
    trainer = LocalTrainer(str(tiny_checkpoint), SHIPPED, reference_path=str(tiny_checkpoint))
    teacher, solver = rollout()
    with caplog.at_level(logging.WARNING, logger=TRAINER_LOG):
        for step in range(10, 14):
            trainer.train_step(teacher, solver, step=step)
    lines = [r.getMessage() for r in caplog.records if r.name == TRAINER_LOG]
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("steps 10-12: 3 steps in a row without a training signal")
    assert "mean holdout grade 0.000, 0 of 2 GRPO groups with a reward spread" in line
    assert "solver attempts' mean grade 0.000" in line
    for cause in ("format the grader cannot read", "--rollout-max-response-len", "grader replies that do not parse"):
        assert cause in line
    assert "\n" not in line
    # A step with a signal ends the streak; the total goes on.
    signal_teacher, _ = rollout(advantages=(1.0, -1.0, 0.5, -0.5))
    kept = trainer.train_step(signal_teacher, solver, step=14)
    assert (
        kept["train/skipped_no_signal"] == 0.0
        and kept["train/skipped_no_signal_total"] == 4.0
        and trainer.steps_done == 1
    )
    assert trainer.no_signal.in_a_row == 0


def test_every_info_scoring_alike_at_a_nonzero_grade_names_other_causes():
    streak = NoSignalStreak(warn_after=2)
    teacher, solver = rollout(reward=1.0)
    summary = RolloutSummary.of(teacher, solver)
    assert (summary.mean_reward, summary.groups, summary.groups_with_spread, summary.solver_mean_grade) == (
        1.0,
        2,
        0,
        1.0,
    )
    assert streak.record(True, 3, summary) is None
    line = streak.record(True, 4, summary)
    assert line.startswith("steps 3-4: 2 steps in a row") and "too easy or too hard" in line and "format" not in line
    assert streak.record(True, 5, summary) is None and streak.total == 3  # one line per streak
    assert streak.record(False, 6, summary) is None and streak.in_a_row == 0


def moved_policy(trainer: LocalTrainer) -> None:
    """One optimizer step with a signal: the policy leaves the start weights."""
    teacher, _ = rollout(advantages=(1.0, -1.0, 0.5, -0.5), seed=1)
    assert trainer.train_step(teacher)["train/skipped_no_signal"] == 0.0
    assert not trainer.policy_is_reference


@pytest.mark.parametrize(
    "term",
    [
        "advantage",
        "entropy",
        "kl_k1",
        "kl_after_update",
        "kl_moved_reference",
        "sdpo_jsd",
        "replay_dpo",
        "distillation",
    ],
)
def test_a_term_with_a_gradient_of_its_own_keeps_the_step(tiny_checkpoint, term):
    settings, reference, pairs = SHIPPED, str(tiny_checkpoint), ()
    advantages = (0.0, 0.0, 0.0, 0.0)
    if term == "advantage":
        advantages = (0.0, 0.0, 0.0, 1e-3)
    elif term == "entropy":
        settings = dataclasses.replace(SHIPPED, loss=dataclasses.replace(SHIPPED.loss, entropy_coef=0.01))
    elif term == "kl_k1":  # k1's gradient is that of log p itself, nonzero at the reference
        settings = dataclasses.replace(SHIPPED, loss=dataclasses.replace(SHIPPED.loss, kl_loss_type="k1"))
    elif term == "kl_moved_reference":  # a resumed run: the policy is not the start weights
        reference = str(moved_reference(Path(tiny_checkpoint)))
    elif term == "sdpo_jsd":
        settings = dataclasses.replace(SHIPPED, loss=dataclasses.replace(SHIPPED.loss, sdpo_alpha=0.5))
    elif term == "replay_dpo":
        settings = dataclasses.replace(SHIPPED, loss=dataclasses.replace(SHIPPED.loss, replay_beta=1.0))
        g = torch.Generator().manual_seed(5)
        pairs = [PreferencePair(ids(g, 6), ids(g, 4), ids(g, 3)), PreferencePair(ids(g, 5), ids(g, 3), ids(g, 5))]
    elif term == "distillation":  # token advantages taus x (teacher - rollout log-probs), nonzero at task advantage 0
        settings = dataclasses.replace(SHIPPED, distill=DistillSettings(adv_tau=1.0, teacher_tau=0.5, student_tau=0.5))
    trainer = LocalTrainer(str(tiny_checkpoint), settings, reference_path=reference)
    if term == "kl_after_update":
        moved_policy(trainer)
    before = parameters(trainer)
    teacher, solver = rollout(advantages=advantages)
    metrics = trainer.train_step(teacher, solver, pairs)
    assert metrics["train/skipped_no_signal"] == 0.0, term
    assert metrics["train/grad_norm"] > 0.0, term
    assert max((a - b).abs().max().item() for a, b in zip(before, parameters(trainer))) > 0.0, term


def test_zero_gradient_rules_one_by_one():
    teacher, _ = rollout()
    zero = teacher_sequences(teacher, 1.0)
    base = dict(
        entropy_coef=0.0, kl_coef=0.1, kl_type="k3", policy_is_reference=True, sdpo_jsd_samples=0, replay_pairs=0
    )
    assert zero_gradient_step(zero, **base)
    assert zero_gradient_step(zero, **{**base, "kl_type": "k2"})
    assert not zero_gradient_step(zero, **{**base, "kl_type": "k1"})
    assert not zero_gradient_step(zero, **{**base, "policy_is_reference": False})
    assert zero_gradient_step(zero, **{**base, "policy_is_reference": False, "kl_coef": 0.0})
    assert not zero_gradient_step(zero, **{**base, "entropy_coef": 1e-3})
    assert not zero_gradient_step(zero, **{**base, "sdpo_jsd_samples": 1})
    assert not zero_gradient_step(zero, **{**base, "replay_pairs": 2})
    one_token = [dataclasses.replace(zero[0], advantages=(0.0, 0.0, -1e-9, 0.0)), *zero[1:]]
    assert not zero_gradient_step(one_token, **base)


def test_the_total_survives_a_checkpoint(tiny_checkpoint):
    trainer = LocalTrainer(str(tiny_checkpoint), SHIPPED, reference_path=str(tiny_checkpoint))
    teacher, solver = rollout()
    for step in range(2):
        trainer.train_step(teacher, solver, step=step)
    state = trainer.state_dict()
    resumed = LocalTrainer(str(tiny_checkpoint), SHIPPED, reference_path=str(tiny_checkpoint))
    resumed.load_state_dict(state)
    assert resumed.train_step(teacher, solver, step=2)["train/skipped_no_signal_total"] == 3.0
    del state["skipped_no_signal"]  # a checkpoint written before the count was kept
    resumed.load_state_dict(state)
    assert resumed.no_signal.total == 0
