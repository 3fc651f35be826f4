"""The price-lists task: every other problem needs a shop's price that only the rubric and the
oracle hint state; the shipped evaluation set holds no training problem."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from slime_meta.data.tasks import price_lists
from slime_meta.data.tasks.word_problems import COLUMNS
from slime_meta.data.tasks.writer import jsonl_text

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_every_other_problem_needs_the_price_only_rubric_and_hint_state():
    rows = price_lists.generate_rows(40, seed=0)
    assert {row["category"] for row in rows} == set(price_lists.SHOPS)
    for shop in price_lists.SHOPS.values():
        mine = [row for row in rows if row["category"] == shop.name]
        assert [f"{shop.price} dollars" in row["prompt"] for row in mine] == [i % 2 == 1 for i in range(len(mine))]
        for row in mine:
            (count,) = re.findall(r"buys (\d+)", row["prompt"])
            assert row["label"] == int(count) * shop.price
            assert (
                f"costs {shop.price} dollars" in row["rubric"] and f"costs {shop.price} dollars" in row["oracle_hint"]
            )
            assert str(row["label"]) not in row["rubric"]  # the rubric gives no answer
            assert not re.search(r"Answer:\s*\d", row["oracle_hint"])  # no answer line for a student to copy
            assert f"{shop.price} dollars" not in row["bad_hint"]


def test_shipped_files_are_the_generator_s_output_and_disjoint(tmp_path):
    train = price_lists.generate_rows(40, seed=0)
    assert (REPO_ROOT / "data/price_lists.jsonl").read_text() == jsonl_text(train, COLUMNS)
    evaluation = price_lists.generate_rows(12, seed=1, avoid={row["prompt"] for row in train})
    assert (REPO_ROOT / "data/price_lists_eval.jsonl").read_text() == jsonl_text(evaluation, COLUMNS)
    assert not {row["prompt"] for row in train} & {row["prompt"] for row in evaluation}
    # Without `avoid` the same seed would repeat training problems: the flag does something.
    assert {row["prompt"] for row in train} & {row["prompt"] for row in price_lists.generate_rows(12, seed=1)}


def test_the_writer_refuses_a_missing_training_file_in_one_line(tmp_path):
    command = [sys.executable, "-m", "slime_meta.data.tasks.price_lists", "--out", str(tmp_path / "e.jsonl")]
    result = subprocess.run(
        command + ["--disjoint-from", str(tmp_path / "none.jsonl")], capture_output=True, text=True, cwd=REPO_ROOT
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "none.jsonl" in result.stderr
    assert not (tmp_path / "e.jsonl").exists()
    result = subprocess.run(command + ["--n", "3"], capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    assert len([json.loads(line) for line in (tmp_path / "e.jsonl").read_text().splitlines()]) == 15


def test_a_training_file_holding_every_problem_of_a_shop_is_refused_not_drawn_forever():
    import random

    import pytest

    from slime_meta.errors import UserInputError

    shop = price_lists.SHOPS["kims_stall"]
    rng = random.Random(0)
    every = {shop.draw(rng, price_stated=i % 2 == 1).prompt for i in range(60_000)}
    with pytest.raises(UserInputError, match=r"kims_stall: no problem outside the .* lower --n"):
        price_lists.generate_rows(2, seed=0, families=["kims_stall"], avoid=every)
