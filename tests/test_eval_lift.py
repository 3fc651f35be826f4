"""benchmarks/eval_lift.py: the eval set's lift in standard errors, the eval problems as units."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import eval_lift  # noqa: E402


def test_the_lift_is_the_difference_over_the_two_binomial_errors_combined():
    # 0.932 vs 0.531 on 32 problems: sqrt((0.932 * 0.068 + 0.531 * 0.469) / 32) = 0.0989
    assert eval_lift.lift_in_se(0.932, 0.531, 32) == pytest.approx(0.401 / 0.09887, rel=1e-3)
    assert eval_lift.lift_in_se(0.932, 0.531, 48) > eval_lift.lift_in_se(0.932, 0.531, 32)  # more units, less error


def test_it_reads_the_last_or_the_given_eval_step_of_a_results_file(tmp_path, capsys):
    path = tmp_path / "run.json"
    curve = [{"step": 0, "holdout": 0.5, "no_info": 0.5}, {"step": 10, "holdout": 0.9, "no_info": 0.5}]
    path.write_text(json.dumps({"eval_curve": curve, "normalised_gain_last_steps": 0.8}))
    assert eval_lift.main([str(path)]) == 0
    last = capsys.readouterr().out.splitlines()[-1].split()
    assert last[2:5] == ["10", "0.900", "0.500"] and last[-1] == "0.80"
    eval_lift.main(["--step", "0", str(path)])
    assert capsys.readouterr().out.splitlines()[-1].split()[-2] == "0.00"  # no lift at step 0


def test_a_missing_results_file_is_one_line_and_exit_code_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        eval_lift.main([str(tmp_path / "none.json")])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1 and "none.json" in err


def test_every_eval_set_of_a_file_is_a_row_and_one_can_be_chosen(tmp_path, capsys):
    path = tmp_path / "run.json"
    curves = {
        "price_lists_eval": [{"step": 10, "holdout": 0.9, "no_info": 0.5}],
        "price_lists_eval_new_shops": [{"step": 10, "holdout": 0.6, "no_info": 0.5}],
    }
    path.write_text(json.dumps({"eval_curves": curves, "eval_curve": curves["price_lists_eval"]}))
    assert eval_lift.main([str(path)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(row[1], row[5]) for row in rows] == [
        ("price_lists_eval", "0.400"),
        ("price_lists_eval_new_shops", "0.100"),
    ]
    eval_lift.main(["--eval-set", "price_lists_eval_new_shops", str(path)])
    (row,) = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert row[1] == "price_lists_eval_new_shops" and row[3] == "0.600"
