"""A stopped run says how to go on: its latest checkpoint and the exact command that resumes from it,
or that it has none yet and when the first is due.

The end-to-end test stops a real run (the tiny model, real workers behind the real router) with
SIGTERM, as a scheduler's time limit does, after its first checkpoint, then runs the command the
run printed, word for word: it trains the remaining steps into the same run directory.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_train_e2e import ROOT, processes_mentioning, read_jsonl, synthetic_args

from slime_meta.artifacts.resume import resume_command, resume_note
from slime_meta.artifacts.train_state import POINTER
from slime_meta.config.arguments import parse_config

PROGRAM = [".venv/bin/python", "train.py"]


def args_of(*extra: str) -> list[str]:
    return ["--prompt-data", str(ROOT / "data/synthetic_suffix.jsonl"), "--num-rollout", "40", *extra]


def fake_checkpoint(save_dir: Path, step: int) -> Path:
    root = save_dir / f"iter_{step:07d}"
    root.mkdir(parents=True)
    (root / "state.json").write_text("{}")
    (save_dir / POINTER).write_text(f"{step}\n")
    return root


def test_the_command_is_the_runs_own_with_load_set_and_its_run_dir_kept():
    argv = ["--lr", "1e-4", "--load=old/ckpt", "--save", "runs/a b/ckpt"]
    command = resume_command(argv, PROGRAM, load="runs/a b/ckpt", run_dir="runs/20261128-101010")
    assert shlex.split(command) == [
        *PROGRAM,
        "--lr",
        "1e-4",
        "--load=runs/a b/ckpt",
        "--save",
        "runs/a b/ckpt",
        "--run-dir",  # the default run dir is a new name at each start: the resumed run keeps this one
        "runs/20261128-101010",
    ]
    given = resume_command(["--run-dir", "mine"], PROGRAM, load="mine/ckpt", run_dir="mine")
    assert shlex.split(given) == [*PROGRAM, "--run-dir", "mine", "--load", "mine/ckpt"]


def test_the_note_names_the_latest_checkpoint_of_this_run(tmp_path):
    save = tmp_path / "ckpt"
    argv = args_of("--save", str(save), "--save-interval", "10", "--run-dir", str(tmp_path))
    started = time.time() - 1
    latest = fake_checkpoint(save, 20)
    note = resume_note(parse_config(argv), argv, program=PROGRAM, started_at=started)
    first, second = note.splitlines()
    assert first == f"latest checkpoint: {latest} (after step 20 of 40)"
    assert second == "resume with: " + shlex.join([*PROGRAM, *argv, "--load", str(save)])


def test_without_a_checkpoint_the_note_says_when_the_first_is_due(tmp_path):
    save = tmp_path / "ckpt"
    argv = args_of("--save", str(save), "--save-interval", "10")
    note = resume_note(parse_config(argv), argv, program=PROGRAM, started_at=time.time())
    assert note == (
        f"no checkpoint yet in {save}: the first is due after step 10 of 40 (--save-interval 10); "
        "the same command starts the run again from step 1"
    )
    # An earlier run's checkpoint in the same directory is not this run's to resume from.
    fake_checkpoint(save, 30)
    assert resume_note(parse_config(argv), argv, program=PROGRAM, started_at=time.time() + 5) == note

    argv = args_of("--save", str(save))
    note = resume_note(parse_config(argv), argv, program=PROGRAM, started_at=time.time() + 5)
    assert "only one is due after the last step, 40; add --save-interval N" in note
    note = resume_note(parse_config(args_of()), args_of(), program=PROGRAM, started_at=time.time())
    assert note.startswith("no checkpoint: the run was given no --save DIR")


def test_a_resumed_run_stopped_before_its_next_checkpoint_resumes_from_where_it_started(tmp_path):
    loaded, save = tmp_path / "old", tmp_path / "new"
    fake_checkpoint(loaded, 12)
    argv = args_of("--load", str(loaded), "--save", str(save), "--save-interval", "5", "--run-dir", "r")
    note = resume_note(parse_config(argv), argv, program=PROGRAM, started_at=time.time())
    assert note.splitlines() == [
        f"no checkpoint of this run yet in {save} (the first is due after step 15 of 40 (--save-interval 5)); "
        "the checkpoint it started from resumes it again",
        "resume with: " + shlex.join([*PROGRAM, *argv]),
    ]
    # Loaded from its own --save directory: that checkpoint is the one to resume from.
    argv = args_of("--load", str(loaded), "--save", str(loaded), "--save-interval", "5", "--run-dir", "r")
    note = resume_note(parse_config(argv), argv, program=PROGRAM, started_at=time.time() + 5)
    assert note.splitlines()[0] == f"latest checkpoint: {loaded / 'iter_0000012'} (after step 12 of 40)"


def test_sigterm_prints_the_command_that_resumes_and_that_command_finishes_the_run(tiny_checkpoint, tmp_path):
    run_dir = tmp_path / "run"
    save = run_dir / "ckpt"
    args = synthetic_args(tiny_checkpoint, run_dir, "--num-rollout", "3", "--save", str(save), "--save-interval", "1")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("OPENAI_API_KEY", None)
    process = subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (save / POINTER).is_file() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 143, err[-3000:]
    note = err.splitlines()[-2:]
    assert note[0].startswith(f"latest checkpoint: {save}/iter_000000"), err[-3000:]
    stopped_after = int(note[0].split("(after step ")[1].split(" ")[0])
    assert note[0].endswith(f"(after step {stopped_after} of 3)") and 1 <= stopped_after < 3
    assert note[1].startswith("resume with: ")
    command = shlex.split(note[1].removeprefix("resume with: "))
    assert command[1] == "train.py" and command[-2:] == ["--load", str(save)]

    resumed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    step_lines = [line for line in resumed.stdout.splitlines() if line.startswith("step ")]
    assert step_lines[0].startswith(f"step {stopped_after + 1}/3 ") and step_lines[-1].startswith("step 3/3 ")
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2]
    assert processes_mentioning(str(run_dir)) == []
