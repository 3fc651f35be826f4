"""Holdout grades -> rewards and advantages, both modes, computed by hand."""

import math

import pytest

from slime_meta.rollout.rewards import group_rewards_and_advantages


def test_mean_then_normalize_is_grpo_over_mean_holdout_grades():
    scores_G_H = [[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]]
    rewards, advantages = group_rewards_and_advantages(scores_G_H, mode="mean-then-normalize", std_normalize=False)
    assert rewards == [1.0, 0.0, 0.5]
    assert advantages == pytest.approx([0.5, -0.5, 0.0])


def test_normalize_then_mean_normalises_each_holdout_problem_first():
    # Holdout problem 0 separates the infos; problem 1 is solved by none: it must add nothing.
    scores_G_H = [[1.0, 0.0], [0.0, 0.0]]
    _, advantages = group_rewards_and_advantages(scores_G_H, mode="normalize-then-mean", std_normalize=True)
    std = math.sqrt(0.5)  # unbiased std of [1, 0]
    expected_first = (0.5 / (std + 1e-6)) / 2
    assert advantages == pytest.approx([expected_first, -expected_first], rel=1e-5)
    _, plain = group_rewards_and_advantages(scores_G_H, mode="mean-then-normalize", std_normalize=True)
    assert plain[0] == pytest.approx(0.25 / (std / 2 + 1e-6), rel=1e-5)  # rewards [0.5, 0]: the modes differ


def test_group_of_one_gets_zero_advantage():
    _, advantages = group_rewards_and_advantages([[0.7, 0.2]], mode="mean-then-normalize", std_normalize=True)
    assert advantages == [0.0]
