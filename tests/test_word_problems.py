"""The easy word-problem task: its generator, the shipped data, and how the project reads it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from slime_meta.data.problems import load_problems
from slime_meta.data.tasks import word_problems
from slime_meta.data.tasks.word_problems import DEFAULT_FAMILIES, FAMILIES, generate_rows
from slime_meta.grading.graders import VerifierGrader

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "data" / "easy_word_problems.jsonl"


def _numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


# What each family's answer is, read back from the story's numbers (in the order the story gives them).
EXPECTED = {
    "add": lambda n: n[0] + n[1],
    "subtract": lambda n: n[0] - n[1],
    "multiply": lambda n: n[0] * n[1],
    "divide": lambda n: n[0] // n[1],
    "compare": lambda n: max(n) - min(n),
    "two_step": lambda n: n[0] + n[1] - n[2],
}


def test_labels_are_the_stories_arithmetic_for_every_family():
    rows = generate_rows(40, seed=3, families=list(FAMILIES))
    assert Counter(r["category"] for r in rows) == {name: 40 for name in FAMILIES}
    for row in rows:
        numbers = _numbers(row["prompt"])
        assert isinstance(row["label"], int) and row["label"] == EXPECTED[row["category"]](numbers), row
        assert row["label"] >= 1
        if row["category"] == "divide":
            assert numbers[0] % numbers[1] == 0  # shares are whole


def test_rows_are_distinct_seeded_and_families_are_independent():
    rows = generate_rows(60, seed=0)
    for name in DEFAULT_FAMILIES:
        prompts = [r["prompt"] for r in rows if r["category"] == name]
        assert len(prompts) == len(set(prompts)) == 60
    assert word_problems.jsonl_text(generate_rows(60, seed=0)) == word_problems.jsonl_text(rows)
    assert word_problems.jsonl_text(generate_rows(60, seed=1)) != word_problems.jsonl_text(rows)
    only_divide = generate_rows(60, seed=0, families=["divide"])
    assert only_divide == [r for r in rows if r["category"] == "divide"]  # its own stream, whatever else is drawn


def test_rubrics_and_hints_hold_no_answer():
    for row in generate_rows(60, seed=0, families=list(FAMILIES)):
        family = FAMILIES[row["category"]]
        assert row["rubric"] == family.rubric and not re.search(r"\d", row["rubric"])
        assert row["oracle_hint"] == family.oracle_hint and row["bad_hint"] == family.bad_hint
        assert row["oracle_hint"] != row["bad_hint"] and "Answer: <number>" in row["oracle_hint"]


def test_shipped_file_is_the_generators_output(tmp_path):
    command = [
        sys.executable,
        "-m",
        "slime_meta.data.tasks.word_problems",
        "--out",
        str(tmp_path / "again.jsonl"),
        "--n",
        "60",
        "--seed",
        "0",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "again.jsonl").read_bytes() == SHIPPED.read_bytes()
    assert SHIPPED.read_text(encoding="utf-8") == word_problems.jsonl_text(generate_rows(60, seed=0))


def test_bad_flags_exit_2_with_one_line(tmp_path):
    for flags, named in (
        (["--families", "add", "nope"], "--families"),
        (["--top", "1"], "--top"),
        (["--n", "0"], "--n"),
    ):
        command = [
            sys.executable,
            "-m",
            "slime_meta.data.tasks.word_problems",
            "--out",
            str(tmp_path / "x.jsonl"),
            *flags,
        ]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 2 and done.stderr.startswith(f"error: {named}"), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.jsonl").exists()


def test_shipped_file_loads_with_the_training_flags_and_the_verifier_grades_the_hinted_format():
    problems = load_problems(
        SHIPPED, input_key="prompt", label_key="label", rubric_key="rubric", group_key="category", id_key="id"
    )
    assert Counter(p.group for p in problems) == {name: 60 for name in DEFAULT_FAMILIES}
    assert all(p.metadata["oracle_hint"] and p.metadata["bad_hint"] for p in problems)
    grader = VerifierGrader()
    problem = problems[0]
    label = int(problem.ground_truth)
    # The form the oracle hint's example teaches, and a wrong result in the same form.
    assert grader.grade_now(problem, f"{problem.prompt}\nSo the total is {label}.\nAnswer: {label}").score == 1.0
    assert grader.grade_now(problem, f"Answer: {label + 1}").score == 0.0
    first_row = json.loads(SHIPPED.read_text(encoding="utf-8").split("\n")[0])
    assert first_row["label"] == label and isinstance(first_row["label"], int)


def test_saved_real_student_completions_regrade_without_the_model(tmp_path):
    # benchmarks/real_baselines.py saved every completion of the measured run; --regrade grades them
    # again with today's verifier (its figures may move with it) and reads the answers' last numbers,
    # which depend on the completions alone and so must equal the saved report's.
    results = REPO / "benchmarks" / "results"
    out = tmp_path / "regraded.json"
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "real_baselines.py"),
        "--regrade",
        str(results / "real_baselines_h200_completions.jsonl"),
        "--out",
        str(out),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    saved, regraded = json.loads((results / "real_baselines_h200.json").read_text()), json.loads(out.read_text())
    assert regraded["last_number_right"] == saved["last_number_right"]
    for decoding in ("greedy", "sample"):
        for hint in ("none", "oracle_hint", "bad_hint"):
            cell = regraded["grades"][decoding][hint]
            assert set(cell) == {*DEFAULT_FAMILIES, "all"} and all(0.0 <= v <= 1.0 for v in cell.values())
