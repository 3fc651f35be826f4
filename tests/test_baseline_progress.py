"""`--eval-baseline` says what it does while it does it: a line when it starts, one per quarter of
the answers graded and the result, instead of minutes of silence before the first step line (a
real model on a CPU). The student and grader here are stand-ins that answer at once: the lines
are what is checked, not the grades (the end-to-end runs measure those with real workers)."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import pytest

from slime_meta.config.arguments import parse_config
from slime_meta.data.problems import load_problems
from slime_meta.rollout.baseline import baseline_eval

DATA = "data/synthetic_suffix.jsonl"


class AnswersTheContext:
    """The student writes the context it was given: graded 1 when it is the hand-written hint."""

    async def solve_n(self, problem, context, n):
        return None, [SimpleNamespace(text=context)] * n


class GradesAgainstTheHint:
    async def grade(self, problem, text):
        return SimpleNamespace(score=float(bool(text) and text == problem.metadata["oracle_hint"]))


def test_the_baseline_prints_its_start_its_progress_and_its_result(capsys):
    cfg = parse_config(
        ["--prompt-data", DATA, "--context-key", "oracle_hint", "--eval-baseline", "--eval-baseline-problems", "32"]
        + ["--eval-baseline-attempts", "1"]
    )
    problems = load_problems(DATA, group_key="family")
    rollout = SimpleNamespace(student=AnswersTheContext(), grader=GradesAgainstTheHint())
    measured = asyncio.run(baseline_eval(cfg, rollout, problems))
    assert measured["eval/synthetic_suffix/baseline_teacher/avg"] == 1.0
    assert measured["eval/synthetic_suffix/baseline_student/avg"] == 0.0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("baseline (--eval-baseline): the student answers 32 training problems 1 time(s) each")
    assert [re.sub(r"\(.*\)", "(...)", line) for line in lines[1:4]] == [
        f"baseline: {done}/64 answers graded (...)" for done in (16, 32, 48)
    ]
    assert re.fullmatch(
        r"baseline: no info 0\.000 ± 0\.000, with the reference context 1\.000 ± 0\.000 \(R_oracle; ± one standard "
        r"error over the 32 problems\), in 0:0\d",
        lines[4],
    )
    assert len(lines) == 5


def test_no_baseline_prints_nothing(capsys):
    cfg = parse_config(["--prompt-data", DATA])
    assert asyncio.run(baseline_eval(cfg, SimpleNamespace(), [])) == {}
    assert capsys.readouterr().out == ""


class RightOnEveryOtherAttempt:
    """Stand-in student: with the context right on even attempts of even problems, wrong otherwise."""

    async def solve_n(self, problem, context, n):
        even = int(problem.uid) % 2 == 0  # the data's row numbers
        return None, [SimpleNamespace(text=context if (even and k % 2 == 0) else "") for k in range(n)]


def test_the_grades_average_attempts_per_problem_and_their_error_is_over_problems():
    cfg = parse_config(
        ["--prompt-data", DATA, "--context-key", "oracle_hint", "--eval-baseline"]
        + ["--eval-baseline-problems", "8", "--eval-baseline-attempts", "4"]
    )
    problems = load_problems(DATA, group_key="family")[:8]
    assert [p.uid for p in problems] == [str(i) for i in range(8)]
    rollout = SimpleNamespace(student=RightOnEveryOtherAttempt(), grader=GradesAgainstTheHint())
    measured = asyncio.run(baseline_eval(cfg, rollout, problems))
    # Problems 0, 2, 4, 6 score 2/4, the others 0: mean 0.25, problem means' SE sqrt(var/8).
    assert measured["eval/synthetic_suffix/baseline_teacher/avg"] == 0.25
    assert measured["eval/synthetic_suffix/baseline_teacher/se"] == pytest.approx((0.25**2 * 8 / 7 / 8) ** 0.5)
    assert measured["eval/synthetic_suffix/baseline_problems"] == 8
    assert measured["eval/synthetic_suffix/baseline_attempts"] == 4
