"""benchmarks/gain_intervals.py: each normalised gain of a results file with its interval."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gain_intervals.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=ROOT)


def test_a_results_file_gets_both_gains_with_intervals(tmp_path):
    curve = [{"holdout": 0.5 + 0.01 * (s % 3) + 0.01 * s, "no_info": 0.5 + 0.01 * (s % 2)} for s in range(30)]
    path = tmp_path / "efficacy.json"
    path.write_text(json.dumps({"curve": curve, "r_oracle": 29 / 32}))  # one attempt at 32 problems
    result = run(path)
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip()
    assert line.startswith("efficacy.json: 30 steps, R_oracle 0.906 ± 0.058; normalised gain ")
    first, last = line.split("normalised gain ")[1].split(" -> ")
    assert "[" in first and "[" in last and float(last.split()[0]) > float(first.split()[0])


def test_an_oracle_of_unknown_error_and_bad_input(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"curve": [{"holdout": 0.6, "no_info": 0.5}] * 4, "r_oracle": 0.97023}))
    assert "[R_oracle error unknown]" in run(path).stdout
    (tmp_path / "other.json").write_text("{}")
    for bad in (tmp_path / "missing.json", tmp_path / "other.json"):
        result = run(bad)
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and bad.name in result.stderr
