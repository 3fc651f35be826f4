"""benchmarks/first_infos.py: how a first info is classed (the price stated, a key pasted, other), which
problems go into the teacher prompt (those whose price must be inferred), and its refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from statistics import fmean

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import first_infos  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "info, expected",
    [
        ("Every item at Kim's stall costs 7 dollars.", "states_price"),
        ("Each mug is $7.", "states_price"),
        ("The price is 7 for any item.", "states_price"),
        ("Bowls are 7 each.", "states_price"),
        ("3 x 7 = 21, so multiply the count by 7.", "states_price"),
        ("The answer is 21.", "pastes_key"),
        ("Omar pays 21 dollars and Olga 56 dollars.", "pastes_key"),
        ("Omar buys 7 bowls for 21.", "pastes_key"),  # 7 as a count, not a price
        ("Multiply the number of items by the price.", "other"),
        ("It costs 17 dollars, or 70, or 7.5 dollars.", "other"),
    ],
)
def test_an_info_is_classed_by_the_price_it_states_or_the_key_it_pastes(info, expected):
    assert first_infos.classify(info, 7, [21, 56]) == expected


def test_the_teacher_prompt_holds_only_problems_whose_price_must_be_inferred():
    chosen = first_infos.teacher_problems(REPO_ROOT / "data/price_keys.jsonl", 2, "category", None)
    assert len(chosen) == 5 and all(len(members) == 2 for members in chosen.values())
    for members in chosen.values():
        price = first_infos.price_of(members[0])
        assert all(not first_infos.holds_number(p.prompt, price) for p in members)
        assert all(not first_infos.holds_number(p.rubric, price) for p in members)
    assert first_infos.price_of(chosen["kims_stall"][0]) == 7


@pytest.mark.parametrize(
    "arguments",
    [
        ["--samples", "0", "--gguf", "x.gguf"],
        ["--gguf", "/nowhere/model.gguf"],
        ["--data", "none.jsonl", "--gguf", "x"],
    ],
)
def test_bad_input_exits_2_with_one_line(arguments):
    result = subprocess.run(
        [sys.executable, "benchmarks/first_infos.py", *arguments], capture_output=True, text=True, cwd=REPO_ROOT
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize(
    "info, expected",
    [
        ("Answer key for 3 bowls at Kim's stall: full credit for 21 dollars.", True),
        ("Omar buys 3 bowls.\nHe pays 21 dollars.", False),  # the count and the key in different sentences
        ("8 cups cost 56 dollars. So 3 bowls cost 21.", True),
        ("The answer is 21.", False),
        ("Buy 13 bowls for 121 dollars.", False),  # not the problem's numbers, only digits of them
    ],
)
def test_a_key_named_with_its_count_is_a_worked_example(info, expected):
    assert first_infos.key_with_quantity(info, [(3, 21), (8, 56)]) is expected


def test_a_report_is_classed_again_without_the_model():
    path = REPO_ROOT / "benchmarks/results/first_infos_h200_qwen05b_price_keys.json"
    import json

    recorded = json.loads(path.read_text())
    report = first_infos.reclassify(path)
    assert [r["class"] for r in report["infos"]] == [r["class"] for r in recorded["infos"]]
    # A worked example holds a key's number: never more of them than infos that hold one.
    assert all(r["holds_key_number"] for r in report["infos"] if r["key_with_quantity"])
    assert 0 < report["shares"]["all"]["key_with_quantity"] <= fmean(r["holds_key_number"] for r in report["infos"])


def test_real_baselines_siblings_are_other_problems_of_the_shop_and_excluding_drops_stated_prices():
    import real_baselines

    data = REPO_ROOT / "data" / "price_keys.jsonl"
    problems = real_baselines.chosen_problems(data, 6, "category", None, excluding="Each costs")
    assert len(problems) == 30 and not any("Each costs" in p.prompt for p in problems)
    siblings = real_baselines.siblings_of(data, "category", excluding="Each costs")
    for problem in problems:
        shop = problem.prompt.split(" at ")[1].split(".")[0]
        key = real_baselines.hint_text(real_baselines.SIBLING_RUBRIC, problem, siblings)
        assert key.startswith("Answer key for ") and shop in key
        assert siblings[problem.uid].ground_truth != problem.ground_truth  # never the problem's own answer
        solved = real_baselines.hint_text(real_baselines.SIBLING_SOLVED, problem, siblings)
        assert shop in solved and "Each costs" not in solved and solved != problem.prompt
        assert solved.endswith(f"Answer: {siblings[problem.uid].ground_truth}.")
    assert real_baselines.hint_text(real_baselines.NO_HINT, problems[0], siblings) == ""
    assert real_baselines.hint_text("oracle_hint", problems[0], siblings).startswith("At ")
