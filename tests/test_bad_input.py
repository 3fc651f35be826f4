"""Bad input: exit code 2 and one line naming the file, row, field or flag; never a traceback.

Runs `train.main` in-process (a traceback would fail the test as an exception), plus one case
through a real `python train.py` process to check the exit code and stderr as a user sees them.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import train

ROOT = Path(__file__).resolve().parent.parent
GOOD_ROWS = [{"prompt": f"word{i}", "label": f"w{i}", "rubric": "exact", "family": f"f{i % 2}"} for i in range(8)]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def used_run_dir(tmp_path: Path) -> Path:
    run_dir = tmp_path / "used"
    run_dir.mkdir(exist_ok=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    return run_dir


def case_args(tmp_path: Path, checkpoint: Path, name: str) -> tuple[list[str], str]:
    """Flags for one bad-input case and a string the error line must contain."""
    good = write_jsonl(tmp_path / "good.jsonl", GOOD_ROWS)
    base = ["--use-meta-learning", "--hf-checkpoint", str(checkpoint), "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    cases = {
        "missing file": (["--prompt-data", str(tmp_path / "nope.jsonl")], "nope.jsonl"),
        "unknown format": (["--prompt-data", str(write_jsonl(tmp_path / "d.csv", GOOD_ROWS))], ".csv"),
        "missing column": (["--prompt-data", str(good), "--input-key", "question"], "question"),
        "empty dataset": (["--prompt-data", str(write_jsonl(tmp_path / "empty.jsonl", []))], "empty.jsonl"),
        "row without problem": (
            ["--prompt-data", str(write_jsonl(tmp_path / "np.jsonl", GOOD_ROWS[:3] + [{"prompt": "", "label": "x"}]))],
            "4",
        ),
        "row without label": (
            ["--prompt-data", str(write_jsonl(tmp_path / "nl.jsonl", GOOD_ROWS[:2] + [{"prompt": "q", "label": None}]))],
            "label",
        ),
        "broken jsonl line": (["--prompt-data", str(write_jsonl(tmp_path / "b.jsonl", GOOD_ROWS[:2] + ["{oops"]))], "3"),
        "batch too small to split": (
            ["--prompt-data", str(write_jsonl(tmp_path / "small.jsonl", GOOD_ROWS[:2]))],
            "--rollout-batch-size",
        ),
        "family too small": (["--prompt-data", str(good), "--group-key", "family", "--heldout-ipb", "9"], "f"),
        "missing group column": (["--prompt-data", str(good), "--group-key", "topic"], "topic"),
        "ratio outside (0, 1)": (["--prompt-data", str(good), "--inner-loop-train-ratio", "1.5"], "--inner-loop-train-ratio"),
        "unreachable router": (
            ["--prompt-data", str(good), "--student-router-ip", "127.0.0.1", "--student-router-port", str(closed_port())],
            "--student-router-ip",
        ),
        "no checkpoint": (["--prompt-data", str(good), "--hf-checkpoint", str(tmp_path)], "--hf-checkpoint"),
        "bad template class": (["--prompt-data", str(good), "--teacher-template", "json.JSONDecoder"], "--teacher-template"),
        "unknown template slot": (["--prompt-data", str(good), "--generator-template", "Q: {question}"], "{question}"),
        "load without checkpoint": (["--prompt-data", str(good), "--load", str(tmp_path)], "--load"),
        "run dir of another run": (["--prompt-data", str(good), "--run-dir", str(used_run_dir(tmp_path))], "--run-dir"),
    }
    extra, needle = cases[name]
    return base + extra, needle


CASES = [
    "missing file", "unknown format", "missing column", "empty dataset", "row without problem",
    "row without label", "broken jsonl line", "batch too small to split", "family too small",
    "missing group column", "ratio outside (0, 1)", "unreachable router", "no checkpoint",
    "bad template class", "unknown template slot", "load without checkpoint", "run dir of another run",
]  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_bad_input_gives_exit_code_2_and_one_line(name, tmp_path, tiny_checkpoint, capsys):
    args, needle = case_args(tmp_path, tiny_checkpoint, name)
    code = train.main(args)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and "\n" not in err, err
    assert needle in err, err
    assert not (tmp_path / "run").exists()  # nothing written for a run that never started


def test_a_real_process_prints_one_line_and_exits_2(tmp_path, tiny_checkpoint):
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--use-meta-learning", "--hf-checkpoint", str(tiny_checkpoint),
         "--prompt-data", str(tmp_path / "missing.parquet")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "missing.parquet" in lines[0] and "Traceback" not in result.stderr
