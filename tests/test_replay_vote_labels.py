"""Trace replay pairs respect the label: real local OpenAI-compatible teachers, real HTTP."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import pytest

from slime_meta.replay.pairs import ReplayPairer, ReplayRequest
from slime_meta.replay.teachers import parse_replay_teachers

try:
    from tests.openai_server import run_openai_server
except ImportError:  # tests/ is on sys.path (pytest's rootdir insertion) but not a package
    from openai_server import run_openai_server

KEY_ENV = "SLIME_META_TEST_REPLAY_LABEL_KEY"
PROMPT = "A jacket costs $80 and is on sale for 25% off. What is the sale price in dollars?"


@pytest.fixture(autouse=True)
def _key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-replay-label")


@contextlib.contextmanager
def teachers(*answers: str) -> Iterator[list]:
    """One server per teacher, each always replying `answers[i]`."""
    with contextlib.ExitStack() as stack:
        served = [stack.enter_context(run_openai_server(reply_fn=lambda _m, a=a: a)) for a in answers]
        yield parse_replay_teachers([f"t{i}@{url}#{KEY_ENV}" for i, (url, _) in enumerate(served)])


def pairs(tmp_path: Path, teacher_answers: tuple[str, ...], policy: str, label: str | None):
    with teachers(*teacher_answers) as teacher_list:
        pairer = ReplayPairer(teacher_list, min_agree=2, cache_path=tmp_path / "cache.jsonl", initial_backoff=0.01)
        found = pairer.pairs_for_sync([ReplayRequest.build(PROMPT, policy, "p1", label)])
    return found, pairer.stats


def test_a_correct_policy_answer_is_never_rejected(tmp_path):
    # The teachers write 60, the policy 60.0: the same answer by the label.
    found, stats = pairs(tmp_path, ("Answer: 60", "Answer: 60", "Answer: 60"), "Work.\nAnswer: 60.0", "60")
    assert found == [] and stats.policy_correct == 1
    # Even when the teachers agree on a wrong answer, the correct policy is not the rejected side.
    found, stats = pairs(tmp_path / "b", ("Answer: 20", "Answer: 20", "Answer: 60"), "Answer: \\frac{120}{2}", "60")
    assert found == [] and stats.policy_correct == 1


def test_teachers_agreeing_on_the_label_pair_against_a_wrong_policy(tmp_path):
    found, stats = pairs(tmp_path, ("Answer: 60", "Answer: 60.0", "Answer: 20"), "Answer: 20", "60")
    assert len(found) == 1 and stats.pairs == 1
    assert found[0].chosen == "Answer: 60" and found[0].rejected == "Answer: 20"
    assert len(found[0].teachers) == 2  # the two correct teachers, 60 and 60.0


def test_when_teachers_disagree_the_correct_one_is_chosen_not_the_majority(tmp_path):
    found, _ = pairs(tmp_path, ("Answer: 20", "Answer: 20", "Answer: \\boxed{60}"), "Answer: 80", "60")
    assert len(found) == 1 and found[0].chosen == "Answer: \\boxed{60}" and found[0].teachers[0].startswith("t2@")


def test_when_every_answer_is_wrong_there_is_no_pair(tmp_path):
    # Two teachers agree on 20 against a policy's 80: a vote would pair, but 20 is wrong too.
    found, stats = pairs(tmp_path, ("Answer: 20", "Answer: 20", "Answer: 12 or maybe 60"), "Answer: 80", "60")
    assert found == [] and stats.no_correct_teacher == 1


def test_without_a_label_the_vote_decides_as_before(tmp_path):
    found, stats = pairs(tmp_path, ("Answer: 20", "Answer: 20", "Answer: 60"), "Answer: 80", None)
    assert len(found) == 1 and found[0].chosen == "Answer: 20" and stats.pairs == 1
