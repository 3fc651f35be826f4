"""`--eval-baseline` says what it does while it does it: a line when it starts, one per quarter of
the answers graded and the result, instead of minutes of silence before the first step line (a
real model on a CPU). The student and grader here are stand-ins that answer at once: the lines
are what is checked, not the grades (the end-to-end runs measure those with real workers)."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

from slime_meta.config.arguments import parse_config
from slime_meta.data.problems import load_problems
from slime_meta.rollout.baseline import baseline_eval

DATA = "data/synthetic_suffix.jsonl"


class AnswersTheContext:
    """The student writes the context it was given: graded 1 when it is the hand-written hint."""

    async def solve(self, problem, context):
        return None, SimpleNamespace(text=context)


class GradesAgainstTheHint:
    async def grade(self, problem, text):
        return SimpleNamespace(score=float(bool(text) and text == problem.metadata["oracle_hint"]))


def test_the_baseline_prints_its_start_its_progress_and_its_result(capsys):
    cfg = parse_config(["--prompt-data", DATA, "--context-key", "oracle_hint", "--eval-baseline"])
    problems = load_problems(DATA, group_key="family")
    rollout = SimpleNamespace(student=AnswersTheContext(), grader=GradesAgainstTheHint())
    measured = asyncio.run(baseline_eval(cfg, rollout, problems))
    assert measured["eval/synthetic_suffix/baseline_teacher/avg"] == 1.0
    assert measured["eval/synthetic_suffix/baseline_student/avg"] == 0.0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("baseline (--eval-baseline): the student answers 32 training problems without and")
    assert [re.sub(r"\(.*\)", "(...)", line) for line in lines[1:4]] == [
        f"baseline: {done}/64 answers graded (...)" for done in (16, 32, 48)
    ]
    assert re.fullmatch(r"baseline: no info 0\.000, with the reference context 1\.000 \(R_oracle\), in 0:0\d", lines[4])
    assert len(lines) == 5


def test_no_baseline_prints_nothing(capsys):
    cfg = parse_config(["--prompt-data", DATA])
    assert asyncio.run(baseline_eval(cfg, SimpleNamespace(), [])) == {}
    assert capsys.readouterr().out == ""
