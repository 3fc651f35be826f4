"""Replay DPO's reference is the start weights: computed once per pair, cached with the pair, and
the DPO loss moves away from log 2 as the policy moves away from it."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime_meta.backends.local.training.channels import LossSettings
from slime_meta.backends.local.training.settings import TrainerSettings
from slime_meta.backends.local.training.trainer import LocalTrainer
from slime_meta.replay.pairs import ReplayPairer
from slime_meta.replay.teachers import ReplayTeacher
from slime_meta.types import PreferencePair, TeacherSample


def ids(g: torch.Generator, n: int) -> tuple[int, ...]:
    return tuple(int(x) for x in torch.randint(4, 60, (n,), generator=g))


def fixed_pairs() -> list[PreferencePair]:
    g = torch.Generator().manual_seed(11)
    return [PreferencePair(ids(g, 7), ids(g, 5), ids(g, 4)) for _ in range(3)]


def idle_teacher_samples() -> list[TeacherSample]:
    """Teacher samples with advantage 0: the policy-gradient channel adds no gradient."""
    g = torch.Generator().manual_seed(12)
    return [
        TeacherSample(
            ids(g, 6),
            ids(g, 3),
            (-1.0, -1.0, -1.0),
            reward=0.0,
            advantage=0.0,
            group_index=0,
            sample_index=i,
            inner_iteration=0,
        )
        for i in range(2)
    ]


def independent_logp_sums(checkpoint, pairs: list[PreferencePair]) -> list[tuple[float, float]]:
    """Summed log-probs of each response, one unpadded float64 forward per sequence."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval()
    out = []
    with torch.no_grad():
        for pair in pairs:
            sums = []
            for response in (pair.chosen_ids, pair.rejected_ids):
                tokens = torch.tensor([pair.prompt_ids + response])
                logp = torch.log_softmax(model(tokens).logits[0, :-1], dim=-1)
                start = len(pair.prompt_ids) - 1
                sums.append(sum(logp[start + i, t].item() for i, t in enumerate(response)))
            out.append(tuple(sums))
    return out


@pytest.fixture()
def dpo_trainer(tiny_checkpoint):
    torch.manual_seed(0)
    settings = TrainerSettings(lr=1e-2, device="cpu", loss=LossSettings(replay_beta=1.0, replay_dpo_beta=0.5))
    return LocalTrainer(str(tiny_checkpoint), settings, reference_path=str(tiny_checkpoint))


def test_reference_logps_equal_an_independent_forward_of_the_start_model(dpo_trainer, tiny_checkpoint, tmp_path):
    pairs = fixed_pairs()
    scored = dpo_trainer.with_reference_logps(pairs)
    expected = independent_logp_sums(tiny_checkpoint, pairs)
    for pair, (chosen, rejected) in zip(scored, expected):
        assert pair.reference_chosen_logp == pytest.approx(chosen, abs=1e-4)
        assert pair.reference_rejected_logp == pytest.approx(rejected, abs=1e-4)
    # Still the start weights after the policy has trained.
    for _ in range(2):
        dpo_trainer.train_step(idle_teacher_samples(), (), scored)
    again = dpo_trainer.with_reference_logps(pairs)
    flat = [value for chosen_rejected in expected for value in chosen_rejected]
    assert [v for p in again for v in (p.reference_chosen_logp, p.reference_rejected_logp)] == pytest.approx(
        flat, abs=1e-4
    )
    moved = [
        value for pair in independent_logp_sums(dpo_trainer.save_weights(tmp_path / "policy"), pairs) for value in pair
    ]
    assert max(abs(a - b) for a, b in zip(moved, flat)) > 1e-3  # while the policy itself has moved


def test_dpo_on_fixed_pairs_leaves_log_2_and_the_margin_grows(dpo_trainer):
    pairs = dpo_trainer.with_reference_logps(fixed_pairs())
    history = [dpo_trainer.train_step(idle_teacher_samples(), (), pairs) for _ in range(4)]
    first, last = history[0], history[-1]
    # The first step: policy == reference, so the loss is log 2 and the margin 0.
    assert first["train/replay_dpo"] == pytest.approx(math.log(2), abs=1e-5)
    assert abs(first["train/replay_reward_margin"]) < 1e-5
    # Later steps: the policy has moved from the reference towards the chosen answers.
    assert last["train/replay_dpo"] < math.log(2) - 0.01
    assert last["train/replay_reward_margin"] > 0.01 and last["train/replay_reward_accuracy"] == 1.0
    assert all(m["train/replay_reward_margin"] > 0.01 for m in history[1:])


def test_the_trainer_fills_missing_reference_logps_and_refuses_without_a_reference(dpo_trainer, tiny_checkpoint):
    pairs = fixed_pairs()
    metrics = dpo_trainer.train_step(idle_teacher_samples(), (), pairs)  # computes them itself, under the start weights
    assert metrics["train/replay_dpo"] == pytest.approx(math.log(2), abs=1e-5)
    no_reference = LocalTrainer(str(tiny_checkpoint), dpo_trainer.settings)
    with pytest.raises(ValueError, match="reference"):
        no_reference.train_step(idle_teacher_samples(), (), pairs)


def test_reference_logps_are_cached_with_the_pairs_and_read_back_on_resume(tmp_path):
    cache = tmp_path / "replay_pairs.jsonl"
    teachers = [ReplayTeacher("a", "http://127.0.0.1:9"), ReplayTeacher("b", "http://127.0.0.1:9")]
    calls: list[int] = []

    def score(pairs: list[PreferencePair]) -> list[PreferencePair]:
        calls.append(len(pairs))
        return [
            PreferencePair(
                p.prompt_ids, p.chosen_ids, p.rejected_ids, -float(len(p.chosen_ids)), -float(len(p.rejected_ids))
            )
            for p in pairs
        ]

    pairs = fixed_pairs()
    first = ReplayPairer(teachers, cache_path=cache).reference_logps_for(pairs + pairs[:1], score, "start")
    assert calls == [4] and [p.reference_chosen_logp for p in first] == [-5.0, -5.0, -5.0, -5.0]
    # A new process on the same run dir: read from the cache, nothing computed again.
    resumed = ReplayPairer(teachers, cache_path=cache).reference_logps_for(pairs, score, "start")
    assert calls == [4] and resumed == first[:3]
    assert sum('"kind": "reference"' in line for line in cache.read_text().splitlines()) == 3
    # Other reference weights: computed again, never mixed up.
    ReplayPairer(teachers, cache_path=cache).reference_logps_for(pairs[:1], score, "other")
    assert calls == [4, 1]
