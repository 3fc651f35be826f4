"""The house-rules task: each family's rule decides half of its answers, and only the rubric and the
oracle hint state it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slime_meta.data.tasks import house_rules
from slime_meta.data.tasks.word_problems import jsonl_text
from slime_meta.errors import UserInputError

REPO_ROOT = Path(__file__).resolve().parents[1]
# Words that name each rule: none of them may appear in a problem, each appears in its rubric.
RULE_WORDS = {
    "packing_fee": "packing fee",
    "free_box": "fifth box",
    "group_ticket": "one ticket free",
    "monday_market": "1 dollar less",
    "free_parking": "3 hours or less",
}


def plain_answer(row: dict) -> int:
    """The answer without the house rule: the product of the two amounts the problem states."""
    numbers = [int(n) for n in re.findall(r"\d+", row["prompt"])]
    return numbers[0] * numbers[1]


def test_each_family_has_its_rule_in_rubric_and_hint_and_never_in_a_problem():
    rows = house_rules.generate_rows(40, seed=0)
    assert {row["category"] for row in rows} == set(RULE_WORDS)
    for row in rows:
        words = RULE_WORDS[row["category"]]
        assert words not in row["prompt"]
        assert words in row["rubric"]
        assert str(row["label"]) not in row["rubric"].split("Full credit")[1]  # the rubric gives no answer


def test_the_rule_changes_every_other_answer_of_a_family():
    rows = house_rules.generate_rows(40, seed=0)
    for family in RULE_WORDS:
        mine = [row for row in rows if row["category"] == family]
        changed = [row["label"] != plain_answer(row) for row in mine]
        assert changed == [index % 2 == 0 for index in range(len(mine))], family


def test_the_oracle_hint_has_no_answer_line_to_copy():
    for rule in house_rules.RULES.values():
        assert not re.search(r"Answer:\s*\d", rule.oracle_hint), rule.name
        assert rule.oracle_hint.endswith("Answer: <number>.")


def test_rows_alternate_between_families_and_are_reproducible():
    rows = house_rules.generate_rows(3, seed=5)
    assert [row["category"] for row in rows[:5]] == list(house_rules.RULES)
    assert rows == house_rules.generate_rows(3, seed=5)
    assert rows != house_rules.generate_rows(3, seed=6)
    assert len({row["id"] for row in rows}) == len(rows)


def test_the_shipped_files_are_the_generator_output():
    for name, n, seed in (("house_rules.jsonl", 40, 0), ("house_rules_eval.jsonl", 12, 1)):
        shipped = (REPO_ROOT / "data" / name).read_text()
        assert shipped == jsonl_text(house_rules.generate_rows(n, seed=seed)), name


def test_bad_input_is_refused_with_the_flag_named(tmp_path):
    with pytest.raises(UserInputError, match="--families: unknown nope"):
        house_rules.generate_rows(2, families=["nope"])
    with pytest.raises(UserInputError, match="--n 0"):
        house_rules.generate_rows(0)
    out = tmp_path / "rules.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "slime_meta.data.tasks.house_rules", "--out", str(out), "--n", "500"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 2 and "--n 500" in done.stderr and not out.exists()
    done = subprocess.run(
        [sys.executable, "-m", "slime_meta.data.tasks.house_rules", "--out", str(out), "--n", "2"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0
    assert len([json.loads(line) for line in out.read_text().splitlines()]) == 2 * len(house_rules.RULES)
