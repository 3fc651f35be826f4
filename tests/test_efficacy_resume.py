"""benchmarks/efficacy.py across resumes: where a run dir resumes, and training time without the restarts."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import efficacy  # noqa: E402

from slime_meta.artifacts.train_state import POINTER  # noqa: E402


def _checkpoint(checkpoints: Path, iteration: int, next_rollout_id: int) -> None:
    root = checkpoints / f"iter_{iteration:07d}"
    root.mkdir(parents=True)
    (root / "state.json").write_text(json.dumps({"next_rollout_id": next_rollout_id}))
    (checkpoints / POINTER).write_text(f"{iteration}\n")


def test_a_run_dir_without_a_checkpoint_starts_fresh_and_one_with_resumes_where_it_says(tmp_path, capsys):
    checkpoints = tmp_path / "run" / "checkpoints"
    assert efficacy.resume_step(checkpoints) is None
    _checkpoint(checkpoints, 4, 5)
    _checkpoint(checkpoints, 9, 10)  # the pointer names the newest
    assert efficacy.resume_step(checkpoints) == 10
    (checkpoints / POINTER).write_text("12\n")  # names a checkpoint that is not there
    with pytest.raises(SystemExit) as stopped:
        efficacy.resume_step(checkpoints)
    assert stopped.value.code == 2 and "--run-dir" in capsys.readouterr().err


def test_training_time_counts_each_step_once_and_no_restart(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "efficacy_resumes.json").write_text(json.dumps([2]))
    # Steps 0-1, then a restart of 500 s, then steps 2-3 of the resumed run (each step 10 s).
    records = [
        {"step": 0, "time": 110.0, "perf/step_time": 10.0},
        {"step": 1, "time": 120.0, "perf/step_time": 10.0},
        {"step": 2, "time": 630.0, "perf/step_time": 10.0},
        {"step": 3, "time": 641.0, "perf/step_time": 11.0},
    ]
    assert efficacy.training_elapsed(records, run_dir) == [10.0, 20.0, 30.0, 41.0]
    assert efficacy.resume_steps(run_dir) == [2]
    # Without the resume recorded, the restart would count as training time.
    (run_dir / "efficacy_resumes.json").unlink()
    assert efficacy.training_elapsed(records, run_dir)[-1] == 541.0
