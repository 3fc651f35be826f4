"""The price-keys task: each rubric is one problem's answer key and never the shop's price, so the price a
holdout problem needs must be inferred; the shipped files are the generator's output; the held-out-shops
evaluation sets of both shop tasks share no shop, goods, price or wording with the training files."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_real import run_real_argv

from slime_meta.data.tasks import price_keys, price_lists
from slime_meta.data.tasks.price_lists import HELD_OUT_SHOPS, SHOPS
from slime_meta.data.tasks.word_problems import COLUMNS, PEOPLE
from slime_meta.data.tasks.writer import jsonl_text
from slime_meta.grading.graders import VerifierGrader
from slime_meta.types import Problem

REPO_ROOT = Path(__file__).resolve().parents[1]
TASKS = {"price_lists": price_lists, "price_keys": price_keys}


def read(name: str) -> list[dict]:
    return [json.loads(line) for line in (REPO_ROOT / "data" / name).read_text().splitlines()]


def whole_word(number: int) -> str:
    return rf"(?<!\d){number}(?!\d)"


def count_of(row: dict) -> int:
    (count,) = re.findall(r"(?:buys|picks up) (\d+) ", row["prompt"])
    return int(count)


def shops_of(rows: list[dict]) -> dict[str, price_lists.Shop]:
    table = {**SHOPS, **HELD_OUT_SHOPS}
    return {row["category"]: table[row["category"]] for row in rows}


@pytest.mark.parametrize("held_out", [False, True])
def test_rows_are_valid_and_the_rubric_is_an_answer_key_without_the_price(held_out):
    rows = price_keys.generate_rows(40, seed=0, held_out_shops=held_out)
    shops = price_lists.shop_table(held_out)
    assert {row["category"] for row in rows} == set(shops) and len(rows) == 40 * len(shops)
    for shop in shops.values():
        mine = [row for row in rows if row["category"] == shop.name]
        assert len({row["prompt"] for row in mine}) == len(mine)
        stated = [bool(re.search(whole_word(shop.price), row["prompt"])) for row in mine]
        assert stated == [price_keys.states_price(i) for i in range(len(mine))]
        assert 0 < sum(stated) < len(mine)  # the no-info grade sits inside 0..1
        for row in mine:
            assert set(row) == set(COLUMNS) and isinstance(row["label"], int)
            count = count_of(row)
            assert count != shop.price and row["label"] == count * shop.price
            # The key: the label and the purchase, and no number but those two.
            assert re.findall(r"\d+", row["rubric"]) == [str(count), str(row["label"])]
            assert not re.search(whole_word(shop.price), row["rubric"])  # the price is never in a rubric
            assert not re.search(r"\b(?:each|per|every item|any single)\b", row["rubric"], re.IGNORECASE)
            if not price_keys.states_price(mine.index(row)):  # a key-only problem: its price nowhere but the hint
                assert not re.search(whole_word(shop.price), row["prompt"])
            assert re.search(rf"{whole_word(shop.price)} dollars", row["oracle_hint"])
            assert not re.search(r"Answer:\s*\d", row["oracle_hint"])  # no answer line for a student to copy
            assert not re.search(whole_word(shop.price), row["bad_hint"])


def test_a_holdout_problem_needs_the_price_and_a_pasted_key_does_not_carry():
    """For every key-only problem of a shop, no other problem's key is its answer (another quantity) and
    the price divides every key: the price is what carries from train keys to holdout problems."""
    rows = read("price_keys.jsonl")
    for shop in SHOPS.values():
        mine = [row for row in rows if row["category"] == shop.name]
        assert {row["label"] // count_of(row) for row in mine} == {shop.price}
        assert all(row["label"] % count_of(row) == 0 for row in mine)
        key_only = [row for row in mine if not re.search(whole_word(shop.price), row["prompt"])]
        for train in key_only:
            others = [row for row in key_only if count_of(row) != count_of(train)]
            assert others and all(row["label"] != train["label"] for row in others)
        assert len({count_of(row) for row in key_only}) >= 6  # quantities enough for 1 train + 4 holdout apart


def test_the_verifier_credits_only_the_key_s_number_as_the_one_final_answer():
    grader = VerifierGrader()
    row = read("price_keys.jsonl")[0]  # Omar buys 3 bowls at Kim's stall: 21 dollars
    problem = Problem(uid=row["id"], prompt=row["prompt"], label=row["label"], rubric=row["rubric"])
    right = ["Answer: 21", "3 x 7 = 21.\nAnswer: 21", "He pays \\boxed{21} dollars.", "Answer: $21"]
    wrong = [
        "Answer: 7",  # the price
        "Answer: 3",  # the quantity
        "Answer: 21 or 28",  # a hedge holding the key
        "3 x 7 = 21 = 28.\nAnswer: 28",
        "Answer: 21\nOr maybe 28.",
        "Answer: 210",
        row["rubric"],  # the rubric pasted as the answer: several numbers, no one final answer
    ]
    assert [grader.grade_now(problem, text).score for text in right] == [1.0] * len(right)
    assert [grader.grade_now(problem, text).score for text in wrong] == [0.0] * len(wrong)


def test_the_generator_is_deterministic_and_the_shipped_files_are_its_output():
    train = price_keys.generate_rows(40, seed=0)
    assert train == price_keys.generate_rows(40, seed=0)
    assert train != price_keys.generate_rows(40, seed=3)
    assert (REPO_ROOT / "data/price_keys.jsonl").read_text() == jsonl_text(train, COLUMNS)
    evaluation = price_keys.generate_rows(12, seed=1, avoid={row["prompt"] for row in train})
    assert (REPO_ROOT / "data/price_keys_eval.jsonl").read_text() == jsonl_text(evaluation, COLUMNS)
    assert not {row["prompt"] for row in train} & {row["prompt"] for row in evaluation}
    for name, task in TASKS.items():
        new_shops = task.generate_rows(12, seed=2, held_out_shops=True)
        assert (REPO_ROOT / f"data/{name}_eval_new_shops.jsonl").read_text() == jsonl_text(new_shops, COLUMNS)
    # Dropping a shop leaves the others' problems as they were.
    assert price_keys.generate_rows(40, seed=0, families=["toy_barn"]) == [
        row for row in train if row["category"] == "toy_barn"
    ]


def template(row: dict, text: str) -> str:
    """`text` with the row's buyer, quantity, goods, shop, price and result put back as slots."""
    shop = shops_of([row])[row["category"]]
    text = text.replace(shop.place, "{place}")
    for goods in sorted(shop.goods, key=len, reverse=True):
        text = re.sub(rf"\b{re.escape(goods)}\b", "{goods}", text)
    for name, _ in PEOPLE:
        text = re.sub(rf"\b{name}\b", "{name}", text)
    return re.sub(r"\d+", "{n}", text)


def unframed(text: str) -> str:
    return text.replace(" For example:", "").replace(" End your solution with one line: Answer: <number>.", "")


def sentences(text: str) -> set[str]:
    return {part.strip() for part in re.split(r"(?<=[.?!:;])\s+", text) if part.strip()}


@pytest.mark.parametrize("name", TASKS)
def test_the_new_shops_eval_set_shares_no_shop_goods_price_or_wording_with_any_training_file(name):
    held_out = read(f"{name}_eval_new_shops.jsonl")
    new = shops_of(held_out)
    assert set(new) == set(HELD_OUT_SHOPS)
    for training_name in TASKS:
        train = read(f"{training_name}.jsonl")
        old = shops_of(train)
        assert set(old) == set(SHOPS)
        # Shop names and places, goods, prices (right and wrong): none in common, and none in the other's text.
        assert not set(old) & set(new) and not {s.place for s in old.values()} & {s.place for s in new.values()}
        old_goods = {g for s in old.values() for g in s.goods}
        new_goods = {g for s in new.values() for g in s.goods}
        assert not old_goods & new_goods
        old_prices = {p for s in old.values() for p in (s.price, s.wrong_price)}
        new_prices = {p for s in new.values() for p in (s.price, s.wrong_price)}
        assert not old_prices & new_prices
        held_text = " ".join(row[c] for row in held_out for c in ("prompt", "rubric", "oracle_hint", "bad_hint"))
        for goods in old_goods:
            assert not re.search(rf"\b{re.escape(goods)}\b", held_text), goods
        for shop in old.values():
            assert shop.place not in held_text
            assert not re.search(rf"{whole_word(shop.price)} dollars", held_text)
        # Wording: no sentence of a prompt, rubric or hint, with its names and numbers as slots, in common.
        # The oracle hint's frame (word_problems.oracle_hint_with_example: "For example:" and the answer
        # format the student is asked for) is the same in both; its rule and example are not.
        for column in ("prompt", "rubric", "oracle_hint", "bad_hint"):
            old_sentences = {s for row in train for s in sentences(template(row, unframed(row[column])))}
            new_sentences = {s for row in held_out for s in sentences(template(row, unframed(row[column])))}
            assert not old_sentences & new_sentences, (column, old_sentences & new_sentences)
        # Each held-out row still states its rule where the task does: the price in the hint, the key in the rubric.
        for row in held_out:
            shop = new[row["category"]]
            assert row["label"] == count_of(row) * shop.price
            assert re.search(rf"{whole_word(shop.price)} dollars", row["oracle_hint"])
            if name == "price_keys":
                assert not re.search(whole_word(shop.price), row["rubric"])


@pytest.mark.parametrize("name", TASKS)
def test_the_cli_writes_the_file_and_refuses_bad_input_in_one_line(tmp_path, name):
    out = tmp_path / "e.jsonl"
    command = [sys.executable, "-m", f"slime_meta.data.tasks.{name}", "--out", str(out)]
    for bad in (
        ["--n", "0"],
        ["--families", "nowhere"],
        ["--families", "kims_stall", "--held-out-shops"],  # a training shop is not a held-out one
        ["--disjoint-from", str(tmp_path / "none.jsonl")],
    ):
        result = subprocess.run(command + bad, capture_output=True, text=True, cwd=REPO_ROOT)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, (bad, result.stderr)
        assert result.stderr.startswith("error: ") and not out.exists()
    subprocess.run(
        command + ["--n", "3", "--held-out-shops"], capture_output=True, text=True, cwd=REPO_ROOT, check=True
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 15 and {row["category"] for row in rows} == set(HELD_OUT_SHOPS)


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
@pytest.mark.parametrize("data", TASKS)
def test_run_real_grades_both_eval_sets_of_a_shop_task_and_each_can_be_drawn(tmp_path, data, gpu):
    from slime_meta.assembly import batch_plan
    from slime_meta.config.arguments import build_config, build_parser
    from slime_meta.data.problems import ProblemSampler, load_problems

    argv = run_real_argv(tmp_path, data, gpu)
    cfg = build_config(build_parser().parse_args(argv))
    pairs = dict(zip(cfg.meta.eval_prompt_data[0::2], cfg.meta.eval_prompt_data[1::2]))
    assert pairs == {
        f"{data}_eval": f"data/{data}_eval.jsonl",
        f"{data}_eval_new_shops": f"data/{data}_eval_new_shops.jsonl",
    }
    assert cfg.data.prompt_data == f"data/{data}.jsonl" and cfg.data.group_key == "category"
    plan = batch_plan(cfg)
    for path in pairs.values():  # every eval batch the run draws: its teacher prompts' and holdout problems
        problems = load_problems(path, group_key="category")
        sampler = ProblemSampler(problems, seed=cfg.seed, shuffle=True, group_key_used=True)
        sampler.validate(cfg.meta.n_problems_per_prompt, plan.holdout_per_episode, plan.groups)
    assert argv[argv.index("--teacher-template") + 1] == "prompt_templates/teacher_rules.txt"


@pytest.mark.parametrize("frozen", [False, True], ids=["shared", "frozen"])
def test_run_real_keeps_the_kl_term_to_the_start_weights_in_both_student_modes(tmp_path, frozen):
    """Without it the frozen-student runs' infos grew into a sentence repeated to the token cap
    (docs/performance.md, "What the learned infos look like"); a user's own coefficient still wins."""
    from slime_meta.config.arguments import build_config, build_parser

    env = {"FROZEN_STUDENT": "1"} if frozen else {}
    argv = run_real_argv(tmp_path, "price_lists", gpu=True, env=env)
    cfg = build_config(build_parser().parse_args(argv))
    assert cfg.objectives.kl_loss_coef == 0.1
    assert ("--student-checkpoint" in argv) == frozen
    off = run_real_argv(tmp_path, "price_lists", gpu=True, env=env, args=["--kl-loss-coef", "0"])
    assert build_config(build_parser().parse_args(off)).objectives.kl_loss_coef == 0.0
