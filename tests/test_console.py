"""What a run shows on the console and leaves in its run directory: the step line (position,
elapsed time, ETA, the oracle and the normalised gain, KL, entropy, info length), no progress bars
when stdout is not a terminal, and the plot written however the run ends."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from test_train_e2e import ROOT, processes_mentioning, read_jsonl, synthetic_args

from slime_meta.artifacts.plot import PlotRefresher
from slime_meta.artifacts.tracking import RunProgress, format_duration, format_step_line, normalised_gain

STEP_METRICS = {
    "meta_learning/avg_holdout_grade": 0.875,
    "meta_learning/holdout_grade_no_info": 0.625,
    "meta_learning/avg_inner_grade": 0.8125,
    "meta_learning/info_tokens": 3.0,
    "meta_learning/inner_loop_time": 2.1,
    "train/loss": -0.0123,
    "train/grad_norm": 0.456,
    "train/kl_ref": 0.0012,
    "train/entropy": 1.234,
    "train/step_time": 0.5,
    "perf/step_time": 3.0,
}


def test_step_line_shows_position_out_of_total_elapsed_eta_oracle_and_gain():
    line = format_step_line(2, STEP_METRICS, total=20, elapsed_s=9.2, eta_s=61.0, oracle=0.875 + 0.125)
    assert line.startswith("step 3/20 [0:09 elapsed, ETA 1:01] holdout 0.875 ")
    assert "(no info 0.625, oracle 1.000, gain 0.67)" in line
    assert "kl 0.0012" in line and "entropy 1.234" in line and "info_len 3.0" in line
    assert line.endswith("rollout 2.1s train 0.50s step 3.0s")


def test_step_line_leaves_out_what_the_run_did_not_measure():
    metrics = {k: v for k, v in STEP_METRICS.items() if k not in ("train/entropy", "meta_learning/info_tokens")}
    line = format_step_line(0, {**metrics, "train/kl_ref": 0.0}, total=5)
    assert line.startswith("step 1/5 holdout 0.875 (no info 0.625) inner")
    assert "oracle" not in line and "ETA" not in line
    assert " kl " not in line and "entropy" not in line and "info_len" not in line


def test_the_rollout_s_own_line_where_another_process_trains():
    # On slime the rollout prints the line and slime's trainer logs loss and grad norm itself.
    rollout_only = {k: v for k, v in STEP_METRICS.items() if not k.startswith(("train/", "perf/"))}
    line = format_step_line(4, rollout_only, total=10, elapsed_s=30.0, eta_s=30.0, oracle=1.0)
    assert line.startswith("step 5/10 [0:30 elapsed, ETA 0:30] holdout 0.875 (no info 0.625, oracle 1.000, gain 0.67)")
    assert line.endswith("info_len 3.0 | rollout 2.1s")
    assert "nan" not in line and "loss" not in line and "train" not in line


def test_gain_is_not_a_number_when_the_oracle_is_no_better_than_no_info():
    assert normalised_gain(0.9, 0.5, 0.9) == pytest.approx(1.0)
    line = format_step_line(0, STEP_METRICS, total=1, oracle=0.5)
    assert "gain n/a" in line


def test_durations_and_eta():
    assert [format_duration(s) for s in (0, 59.4, 61, 3599, 3600, 7384)] == [
        "0:00",
        "0:59",
        "1:01",
        "59:59",
        "1:00:00",
        "2:03:04",
    ]
    progress = RunProgress(start_step=4, end_step=10)
    progress._started -= 12.0  # two steps (4 and 5) took 12 s: 6 s each, 4 steps left
    assert progress.eta_s(5) == pytest.approx(24.0, abs=0.5)
    assert progress.eta_s(9) == 0.0


def test_plot_refresher_waits_its_interval(tmp_path):
    from test_plot import _write_run

    _write_run(tmp_path, with_eval=False)
    refresher = PlotRefresher(tmp_path, interval_s=3600)
    assert refresher.after_step() is False and not (tmp_path / "holdout.png").exists()
    refresher.interval_s = 0.0
    assert refresher.after_step() is True  # a redraw in a process of its own: the run goes on meanwhile
    assert refresher.after_step() is False  # one at a time
    refresher.close()
    assert (tmp_path / "holdout.png").stat().st_size > 10_000


def test_a_redraw_that_fails_is_a_warning_not_the_runs_error(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").write_text("not json\n")
    refresher = PlotRefresher(tmp_path, interval_s=0.0)
    with caplog.at_level("WARNING"):
        assert refresher.after_step() is True
        refresher.close()
    assert "could not redraw" in caplog.text and not (tmp_path / "holdout.png").exists()


BAR = re.compile(r"\r|\d(it/s|s/it)\]|chains:")  # what a tqdm bar writes: "[00:02, 3.21it/s]"


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_interrupted_run_prints_step_lines_without_bars_and_leaves_its_plot(tiny_checkpoint, tmp_path, stop):
    """A long run (50 steps) stopped after its second step line: stdout a pipe, so no progress bars
    anywhere; the step lines count out of 50 with an ETA and the oracle's gain (--eval-baseline on
    the oracle_hint column); holdout.png written after the signal; nothing left running."""
    run_dir = tmp_path / "interrupted"
    args = synthetic_args(
        tiny_checkpoint, run_dir, "--num-rollout", "50", "--context-key", "oracle_hint", "--eval-baseline"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("OPENAI_API_KEY", None)
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    step_lines = []
    try:
        deadline = time.monotonic() + 240
        for line in process.stdout:
            if line.startswith("step "):
                step_lines.append(line)
            if len(step_lines) == 2 or time.monotonic() > deadline:
                break
        signalled_at = time.time()
        process.send_signal(stop)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert len(step_lines) == 2, err[-3000:]
    assert process.returncode in (130, 143, -stop), err[-3000:]
    assert step_lines[1].startswith("step 2/50 [")
    assert "ETA " in step_lines[1] and "oracle " in step_lines[1] and "gain " in step_lines[1]
    assert not BAR.search("".join(step_lines) + out + err), (out + err)[-3000:]
    plot = run_dir / "holdout.png"
    assert plot.stat().st_size > 1000 and plot.stat().st_mtime >= signalled_at - 1.0
    assert len(read_jsonl(run_dir / "metrics.jsonl")) >= 2
    assert processes_mentioning(str(run_dir)) == []


def test_readme_shows_a_step_line_of_todays_format():
    """The README shows a step line as the demo prints it: it parses as today's format."""
    readme = (ROOT / "README.md").read_text()
    lines = [line for line in readme.splitlines() if re.match(r"^step \d+/\d+ \[", line)]
    assert lines, "README.md shows no step line"
    assert all("holdout" in line and "no info" in line and "ETA" in line for line in lines)
