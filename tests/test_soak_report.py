"""benchmarks/soak.py's report from its samples: the figures after a warm-up, the plot's grouping of
short-lived children, and a results file read back (`--replot`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import soak, soak_plot  # noqa: E402


def samples(steps: range, rss_mib, gpu_mib=None) -> list[dict]:
    out = []
    for step in steps:
        sample = {"step": step, "rss_kib": int(rss_mib(step) * 1024), "fds": 10}
        if gpu_mib is not None:
            sample["gpu_mib"] = gpu_mib(step)
        out.append(sample)
    return out


def a_run() -> soak.SoakRun:
    """A trainer that steps up once at step 100 (a first checkpoint) and is flat on either side; a
    worker that creeps 0.05 MiB a step; math children that live a few steps."""
    steps = range(1, 202)
    return soak.SoakRun(
        steps=200,
        seconds=600.0,
        returncode=0,
        samples={
            "trainer": samples(steps, lambda s: 2000 + (20 if s > 100 else 0), lambda s: 16000),
            "worker:1": samples(steps, lambda s: 1000 + 0.05 * s, lambda s: 7000 + (256 if s > 90 else 0)),
            "other:7": samples(range(1, 12), lambda s: 500),
            "other:8": samples(range(1, 12), lambda s: 400),
        },
        gpus=[{"step": s, "used_mib": [23000]} for s in steps],
    )


def test_the_figures_after_warm_up_see_a_creep_and_not_a_one_time_step():
    run = a_run()
    late = soak.summarise(run, 101)
    assert abs(late["trainer"]["slope_mib_per_step"]) < 1e-6 and late["trainer"]["growth"] == 0
    assert 0.045 < late["worker:1"]["slope_mib_per_step"] < 0.055
    assert late["worker:1"]["gpu_growth"] == 0
    early = soak.summarise(run, 10)  # the step at 100 lands inside the window: a slope, and GPU growth
    assert early["trainer"]["slope_mib_per_step"] > 0.1 and early["worker:1"]["gpu_growth"] > 0
    assert "other:7" not in early  # did not live through the run


def test_the_figures_split_a_creep_into_anonymous_and_file_backed_pages():
    # a worker whose RSS rises by pages of mapped files (libraries' code faulted in) and not by what it allocated
    steps = range(1, 102)
    worker = [
        {"step": s, "rss_kib": 1000 * 1024 + 40 * s, "anon_kib": 700 * 1024, "file_kib": 300 * 1024 + 40 * s, "fds": 9}
        for s in steps
    ]
    run = soak.SoakRun(steps=100, seconds=0.0, returncode=0, samples={"worker:1": worker})
    figures = soak.summarise(run, 10)["worker:1"]
    assert abs(figures["anon_slope_mib_per_step"]) < 1e-6 and figures["anon_mib_after_warmup"] == 700.0
    assert 0.038 < figures["file_slope_mib_per_step"] < 0.041 and figures["file_noise_mib"] < 0.01


def test_the_trainers_allocator_figures_tell_a_larger_reserve_from_memory_kept():
    # the driver's figure steps up twice (the reserve meeting larger batches) while what is allocated stays flat
    steps = range(1, 102)
    trainer = [
        {"step": s, "rss_kib": 2000 * 1024, "fds": 9, "gpu_mib": 16000 + 400 * (s > 40) + 400 * (s > 80)}
        | {"allocated_mib": 9000.0 + (s % 3) * 0.1, "reserved_mib": 15000.0 + 400 * (s > 40) + 400 * (s > 80)}
        for s in steps
    ]
    run = soak.SoakRun(steps=100, seconds=0.0, returncode=0, samples={"trainer": trainer})
    figures = soak.summarise(run, 10)["trainer"]
    assert abs(figures["allocated_slope_mib_per_step"]) < 1e-3 and figures["allocated_noise_mib"] < 0.1
    assert figures["reserved_slope_mib_per_step"] > 5 and figures["gpu_slope_mib_per_step"] > 5
    assert (figures["reserved_mib_after_warmup"], figures["reserved_mib_end"]) == (15000.0, 15800.0)


def test_the_allocator_figures_come_from_the_last_whole_line_of_the_metrics():
    from benchmarks.soak_probes import allocator_mib

    line = json.dumps({"step": 3, "memory/gpu_allocated_mib": 812.5, "memory/gpu_reserved_mib": 1024.0})
    assert allocator_mib(json.dumps({"step": 2}) + "\n" + line + "\n") == {
        "allocated_mib": 812.5,
        "reserved_mib": 1024.0,
    }
    assert allocator_mib(json.dumps({"step": 1, "loss": 0.5}) + "\n") == {}  # a CPU run logs none
    partial = line + "\n" + '{"step": 4, "memory/gpu_all'  # the next line being written: the last whole one
    assert allocator_mib(partial) == {"allocated_mib": 812.5, "reserved_mib": 1024.0}
    assert allocator_mib("") == {}


def test_stopping_a_run_ends_its_whole_process_group(tmp_path):
    # bash, and a child of its own that ignores SIGTERM: both must be gone
    pid_file = tmp_path / "child.pid"
    script = f"(trap '' TERM; sleep 300) & echo $! > {pid_file}; wait"
    process = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    while not pid_file.exists() or not pid_file.read_text().strip():
        time.sleep(0.05)
    child = int(pid_file.read_text())
    soak.stop_group(process, grace_s=2.0)
    assert process.returncode is not None and not soak.group_alive(process.pid)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]


def test_the_plot_sums_the_other_children_into_one_line():
    series = soak_plot.plotted_series(a_run().samples)
    assert set(series) == {"trainer", "worker:1", "other children (sum of 2; peak 900 MiB)"}
    summed = series["other children (sum of 2; peak 900 MiB)"]
    assert [s["step"] for s in summed] == list(range(1, 12)) and summed[0]["rss_kib"] == 900 * 1024


def test_a_results_file_is_read_back_and_redrawn(tmp_path, capsys):
    run = a_run()
    report = {
        "settings": {"steps": 200, "warmup": 10},
        "machine": {"cpu_count": 16},
        "seconds": run.seconds,
        "plot_steps": [],
        "samples": run.samples,
        "gpu_samples": run.gpus,
    }
    path = tmp_path / "soak_gpu_real_200steps.json"
    path.write_text(json.dumps(report))
    assert soak.main(["--replot", str(path), "--warmup", "101"]) == 0
    out = capsys.readouterr().out
    assert "warm-up to step 101" in out and "worker:1 GPU memory: 7256 -> 7256 MiB" in out
    assert path.with_suffix(".png").stat().st_size > 10_000
    assert json.loads(path.read_text()) == report  # the results file itself is kept as it was


def test_the_engine_figures_come_from_the_runs_metrics_and_are_stored_by_replot(tmp_path, capsys):
    # steps 1-10 slow (warm-up), then prefills of 0.2 s in 4 batches a step; an eval-only record is skipped
    records = [
        {"step": s, "perf/step_time": 9.0 if s <= 10 else 3.0}
        | {"worker/teacher_prefill_time": 2.0 if s <= 10 else 0.2, "worker/teacher_prefill_batches": 4.0}
        | {"worker/teacher_eager_prefill_shapes": min(s, 150), "worker/teacher_gpu_reserved_mib": 800.0}
        for s in range(1, 202)
    ] + [{"step": 201, "eval/holdout_reward": 0.5}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    run = a_run()
    report = {
        "settings": {"steps": 200, "warmup": 10},
        "machine": {"cpu_count": 16},
        "seconds": run.seconds,
        "samples": run.samples,
        "gpu_samples": run.gpus,
    }
    path = tmp_path / "soak.json"
    path.write_text(json.dumps(report))
    assert soak.main(["--replot", str(path), "--metrics", str(metrics)]) == 0
    saved = json.loads(path.read_text())
    assert len(saved["engine_samples"]) == 201 and saved["samples"] == report["samples"]
    engine = saved["engine"]
    assert engine["steps"] == 191 and engine["median step_time"] == 3.0
    assert engine["teacher seconds per prefill batch"] == 0.05  # 0.2 s over 4 batches, warm-up left out
    # levels: where they went after warm-up, and the step of their last rise (none: flat)
    assert engine["worker/teacher_eager_prefill_shapes after warm-up"] == 11
    assert engine["worker/teacher_eager_prefill_shapes end"] == 150
    assert engine["worker/teacher_eager_prefill_shapes last rise at step"] == 150
    assert engine["worker/teacher_gpu_reserved_mib last rise at step"] is None
    assert "teacher seconds per prefill batch 0.05" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        soak.main(["--replot", str(path), "--metrics", str(tmp_path / "none.jsonl")])
    assert exit_info.value.code == 2 and "--metrics" in capsys.readouterr().err


def test_heap_snapshots_wait_for_warmup_and_the_first_plot_then_come_two_steps_later_and_near_the_end():
    run = soak.SoakRun(steps=30, seconds=0.0, returncode=None)
    asked = []
    for step in range(1, 31):
        if step == 14:
            run.plot_steps.append(step)  # the first plot, after the warm-up's 10 steps
        if soak.heap_snapshot_due(run, step, warmup=10, steps=30):
            run.snapshot_steps.append(step)
            asked.append(step)
    # tracing starts after step 15 (past step 10 and past the plot), snapshots after 17 and 28
    assert asked == [15, 17, 28]


def soak_cli(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "benchmarks/soak.py", *arguments], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_tracemalloc_with_too_few_steps_exits_2_in_one_line_naming_the_flags():
    result = soak_cli("--steps", "14", "--tracemalloc", "/tmp/never-written")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "--tracemalloc" in result.stderr and "--steps" in result.stderr and "--warmup" in result.stderr


def test_a_time_limit_that_is_not_positive_exits_2_in_one_line():
    result = soak_cli("--steps", "30", "--time-limit-s", "0")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "--time-limit-s 0" in result.stderr
