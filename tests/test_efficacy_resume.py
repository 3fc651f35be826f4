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


def _step_metrics(step: int) -> dict:
    metrics = {
        "meta_learning/avg_holdout_grade": 0.5 + 0.1 * step,
        "meta_learning/holdout_grade_no_info": 0.4,
        "perf/step_time": 10.0,
    }
    if step == 0:  # --eval-baseline's figures ride with the first step, as does the eval before training
        metrics |= {"eval/price_lists/baseline_teacher/avg": 0.9, "eval/price_lists_eval/holdout_grade": 0.6}
        metrics |= {"eval/price_lists_eval/holdout_grade_no_info": 0.4}
    return metrics


def _final_eval() -> dict:
    return {"eval/price_lists_eval/holdout_grade": 0.95, "eval/price_lists_eval/holdout_grade_no_info": 0.45}


def test_a_run_that_ends_on_an_eval_only_record_reports_its_steps_and_that_eval(tmp_path):
    from argparse import Namespace

    from slime_meta.artifacts.tracking import Tracker, read_metrics
    from slime_meta.config.tracking import TrackingConfig

    config = TrackingConfig(
        run_dir=str(tmp_path), use_wandb=False, wandb_project="p", wandb_group=None, wandb_mode="disabled"
    )
    tracker = Tracker(config, tmp_path, {})
    for step in range(4):
        tracker.log(step, _step_metrics(step))
    tracker.log(4, _final_eval())  # what train.py logs after its last step: the final eval alone
    args = Namespace(task="price_lists", window=2, block=50, budget_s=None)

    figures = efficacy.run_figures(read_metrics(tmp_path), tmp_path, args)
    assert figures["steps"] == 4 and figures["r_oracle"] == 0.9
    assert figures["r_last_steps"] == pytest.approx((0.7 + 0.8) / 2)  # steps 2 and 3, not the eval record
    assert [p["step"] for p in figures["curve"]] == [0, 1, 2, 3]
    assert [(p["step"], p["holdout"]) for p in figures["eval_curve"]] == [(0, 0.6), (4, 0.95)]
    assert figures["training_s"] >= 10.0  # the first step counts its own step time

    # Resumed from the checkpoint of step 4: the eval of those weights stays (the run does not redo it).
    Tracker(config, tmp_path, {}, start_step=4)
    assert [p["step"] for p in efficacy.run_figures(read_metrics(tmp_path), tmp_path, args)["eval_curve"]] == [0, 4]
    # Resumed from step 3: step 3's record and the later eval give way, as the resumed run redoes both.
    Tracker(config, tmp_path, {}, start_step=3)
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]


def test_every_eval_set_of_a_run_has_its_curve_the_task_s_own_also_as_eval_curve(tmp_path):
    from argparse import Namespace

    from slime_meta.artifacts.tracking import Tracker, read_metrics
    from slime_meta.config.tracking import TrackingConfig

    config = TrackingConfig(
        run_dir=str(tmp_path), use_wandb=False, wandb_project="p", wandb_group=None, wandb_mode="disabled"
    )
    tracker = Tracker(config, tmp_path, {})
    new_shops = {"eval/price_keys_eval_new_shops/holdout_grade": 0.3, "eval/price_keys_eval_new_shops/gain": 0.1}
    new_shops["eval/price_keys_eval_new_shops/holdout_grade_no_info"] = 0.2
    for step in range(3):
        metrics = _step_metrics(step)
        metrics = {k.replace("price_lists", "price_keys"): v for k, v in metrics.items()}
        tracker.log(step, metrics | (new_shops if step == 0 else {}))
    tracker.log(3, {k.replace("price_lists", "price_keys"): v for k, v in _final_eval().items()} | new_shops)
    args = Namespace(task="price_keys", window=1, block=50, budget_s=None)

    figures = efficacy.run_figures(read_metrics(tmp_path), tmp_path, args)
    assert set(figures["eval_curves"]) == {"price_keys_eval", "price_keys_eval_new_shops"}
    assert figures["eval_curves"]["price_keys_eval"] == figures["eval_curve"]
    assert [(p["step"], p["holdout"], p["no_info"]) for p in figures["eval_curves"]["price_keys_eval_new_shops"]] == [
        (0, 0.3, 0.2),
        (3, 0.3, 0.2),
    ]


# ----------------------------------------------------------------------------- a stopped benchmark


STOPPED_SCRIPT = """
import subprocess, sys, time
sys.path.insert(0, sys.argv[1])
import efficacy
# The run's stand-in: a process group of its own, as train.py's would be, that writes its pid and waits.
def start():
    run = subprocess.Popen([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"],
                           stdout=subprocess.PIPE, text=True, start_new_session=True)
    print("run", run.stdout.readline().strip(), flush=True)
    time.sleep(float(sys.argv[2]))  # > 0: the signal comes before `start` has handed the run back
    return run
efficacy.run_to_the_end(start, 120)
"""


@pytest.mark.parametrize("while_starting", [False, True])
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_a_stopped_benchmark_stops_its_run(tmp_path, how, while_starting):
    """The run has a session of its own (the time limit stops all of it); a SIGTERM or Ctrl-C to the
    benchmark reaches it too, and the benchmark ends only once the run has."""
    import os
    import signal
    import subprocess
    import time

    benchmark = subprocess.Popen(
        [sys.executable, "-c", STOPPED_SCRIPT, str(Path(efficacy.__file__).parent), "0.5" if while_starting else "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = benchmark.stdout.readline().split()
    assert line[0] == "run", (line, benchmark.stderr.read())
    run_pid = int(line[1])
    os.kill(benchmark.pid, getattr(signal, how))
    benchmark.wait(30)
    assert "stopping the run" in benchmark.stdout.read()
    assert benchmark.returncode != 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(run_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(run_pid, signal.SIGKILL)
        pytest.fail("the run outlived the benchmark that started it")


def test_a_run_past_its_time_limit_is_stopped_and_reported_as_such():
    import subprocess

    started = []

    def start(code):
        started.append(subprocess.Popen([sys.executable, "-c", code], start_new_session=True))
        return started[-1]

    assert efficacy.run_to_the_end(lambda: start("import time; time.sleep(60)"), 0.5) is None
    assert started[-1].poll() is not None
    assert efficacy.run_to_the_end(lambda: start("raise SystemExit(3)"), 30) == 3
