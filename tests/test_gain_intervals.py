"""benchmarks/gain_intervals.py: each normalised gain of a results file with its interval."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import gain_intervals  # noqa: E402


def run(capsys, *args) -> tuple[int, str, str]:
    try:
        code = gain_intervals.main([str(a) for a in args])
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def test_a_results_file_gets_both_gains_with_intervals(tmp_path, capsys):
    curve = [{"holdout": 0.5 + 0.01 * (s % 3) + 0.01 * s, "no_info": 0.5 + 0.01 * (s % 2)} for s in range(30)]
    path = tmp_path / "efficacy.json"
    path.write_text(json.dumps({"curve": curve, "r_oracle": 29 / 32}))  # one attempt at 32 problems
    code, out, err = run(capsys, path)
    assert code == 0, err
    line = out.strip()
    assert line.startswith("efficacy.json: 30 steps, R_oracle 0.906 ± 0.058; normalised gain ")
    first, last = line.split("normalised gain ")[1].split(" -> ")
    assert "[" in first and "[" in last and float(last.split()[0]) > float(first.split()[0])


@pytest.mark.parametrize("bad", ["missing.json", "other.json"])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, bad):
    (tmp_path / "other.json").write_text("{}")
    code, _, err = run(capsys, tmp_path / bad)
    assert code == 2 and err.count("\n") == 1 and bad in err


def test_an_oracle_of_unknown_error(tmp_path, capsys):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"curve": [{"holdout": 0.6, "no_info": 0.5}] * 4, "r_oracle": 0.97023}))
    assert "[R_oracle error unknown]" in run(capsys, path)[1]
