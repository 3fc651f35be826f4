"""The CPU benchmarks' quick modes run end to end and report what they measure.

Speed is not checked here (this machine's timing is not the point, and it is shared): only that
each benchmark runs with one command, writes its JSON with the machine, command and date, prints
its table last, and that what it reports is self-consistent (a lower bound below the achieved
time, every request answered, served greedy tokens equal to in-process greedy tokens).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_benchmark(
    script: str, tmp_path: Path, *args: str, timeout: float = 180
) -> tuple[dict, subprocess.CompletedProcess]:
    """benchmarks/<script>.py with `args` and `--out` in tmp_path: it must exit 0; its JSON report."""
    out = tmp_path / f"{script}.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--out", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text()), result


def run_quick(script: str, tmp_path: Path) -> tuple[dict, list[str]]:
    report, result = run_benchmark(script, tmp_path, "--quick")
    for key in ("date", "command", "machine", "settings"):
        assert report[key], key
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == f"json: {tmp_path / f'{script}.json'}"
    return report, lines


def test_inner_loop_quick(tmp_path):
    report, lines = run_quick("inner_loop", tmp_path)
    st = report["settings"]
    chains = st["prompts"] * st["samples"]
    for scenario in ("latency_bound", "capacity_bound"):
        s = report[scenario]
        for design in ("ours", "stage_synchronous", "sequential"):
            assert s[design]["wall_s"] > 0 and s[design]["requests"] > 0, (scenario, design)
            assert s[design]["client_cpu_ms_per_request"] > 0
        for design in ("ours",):
            d = s[design]
            assert d["chains_recorded"] == chains + 1  # every chain, and the no-info control
            assert 0 < d["critical_path_s"] <= d["bound_s"]
            assert d["bound_s"] <= d["wall_s"] * 1.02, "a lower bound above the achieved time"
            assert 0 < d["cpu_floor_s"] <= d["wall_s"] * 1.02, "more CPU than the cores could give in that time"
        assert s["sequential"]["extrapolated"]
    assert set(report["client_cost"]) >= {"student.solve (SGLangPool, text)", "OpenAIGrader.grade (chat_api, aiohttp)"}
    assert set(report["meets"]) == {
        "latency_bound_ratio",
        "capacity_bound_ratio",
        "faster_than_stage_synchronous",
        "client_cpu_ms_per_request",
    }
    assert lines[-2].startswith("meets: ")
    assert any("bound/wall" in line for line in lines[-14:])


def test_generation_quick(tmp_path):
    report, lines = run_quick("generation", tmp_path)
    served, in_process = report["served"], report["in_process"]
    assert served["all_lengths_right"]
    assert served["greedy_token_match"] == [1.0] * report["settings"]["check_prompts"]  # float32 on CPU: exact
    for value in (in_process["batched"], in_process["one_at_a_time"], served["concurrent"], served["one_at_a_time"]):
        assert value["tokens_per_s"] > 0
    assert report["ratios"]["served_vs_inprocess_batched"] > 0
    assert "cpu_vs_inprocess_batched" in report["meets"]
    assert any("tokens/s" in line for line in lines[-10:])
    # The workers' own counters over the timed phase: every request decoded its tokens there, and
    # prefill, decode and waiting account for about the phase's wall time.
    split = served["concurrent"]["engine_split"]
    waves = report["settings"]["requests"] / report["settings"]["concurrency"]
    assert split["decode_steps"] >= waves * (report["settings"]["new_tokens"] - 1)
    assert split["prefill_batches"] >= waves
    shares = split["prefill_share"] + split["fast_decode_share"] + split["dynamic_decode_share"] + split["idle_share"]
    assert 0.8 < shares < 1.2, split
    assert any("the workers' time: prefill" in line for line in lines[-6:])


# A smaller outer step than the demo's (scripts/run_synthetic.sh: 28 problems, G = 8, K = 2), passed
# to train.py after `--`: 6 train problems in 2 teacher prompts of k = 3, 2 holdout problems per
# family, G = 4, K = 1. What the tests below check (steps and blocks counted, the oracle and
# no-info figures read back, the configuration, the arms' async levels) does not depend on the
# step's size; every part of a step (teacher, inner student, holdout, control, training) still runs.
SMALL_STEP = (
    "--",
    "--rollout-batch-size",
    "10",
    "--heldout-ipb",
    "4",
    "--n-samples-per-prompt",
    "4",
    "--num-inner-iterations",
    "1",
)


def _run_train_benchmark(script: str, tmp_path: Path, *extra: str) -> tuple[dict, list[str]]:
    """efficacy.py / async_pipeline.py: they drive scripts/run_synthetic.sh and write OUT_DIR/NAME.json."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--quick", "--out", str(tmp_path), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        # A guard against a hang, not a speed check: 40-80 s a run on a shared 2-core VM with the small
        # model cached; the first run of a task on a clean clone also builds its model (510 s seen
        # for the bracket task's on a loaded 2-core VM).
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / f"{script}.json").read_text())
    for key in ("date", "command", "machine"):
        assert report[key], key
    return report, result.stdout.strip().splitlines()


def test_efficacy_quick(tmp_path):
    report, lines = _run_train_benchmark("efficacy", tmp_path, "--budget-s", "600", "--block", "2", *SMALL_STEP)
    assert report["steps"] == 3 and len(report["curve"]) == 3
    assert 0 <= report["r_no_info"] <= 1 and 0 <= report["r_oracle"] <= 1
    elapsed = [point["elapsed_s"] for point in report["curve"]]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    assert report["steps_within_budget"] == 3  # three tiny steps end well inside 600 s
    assert [b["first_step"] for b in report["by_block"]] == [0, 2]  # --block 2 over 3 steps
    assert report["by_block"][1]["holdout"] == report["curve"][2]["holdout"]
    assert report["student"] == "frozen" and report["task"] == "synthetic_suffix"
    config = json.loads((Path(report["run_dir"]) / "config.json").read_text())
    assert config["pools"]["student_checkpoint"] == config["pools"]["hf_checkpoint"]  # a frozen copy
    assert config["data"]["prompt_data"] == "data/synthetic_suffix.jsonl"
    assert config["meta"]["rollout_batch_size"] == 10  # the flags after -- reach train.py
    assert "gain in budget" in lines[-2] and "over start" in lines[-2]
    # What RL added, from the same run's first and last windows and its oracle.
    r_start, r_end, r_oracle = report["r_first_steps"], report["r_last_steps"], report["r_oracle"]
    if r_oracle > r_start:
        assert report["gain_over_start"] == pytest.approx((r_end - r_start) / (r_oracle - r_start))
    assert f"{report['gain_over_start']:.3f}" == lines[-1].split()[-1]
    assert Path(report["plot"]).stat().st_size > 0 and report["plot"].endswith("efficacy.png")


def test_efficacy_quick_shared_student_runs_the_shared_student_terms(tmp_path):
    """Shared weights: the shared-student defaults add the solver GRPO term and k3 KL
    (docs/performance.md, section 6)."""
    report, _ = _run_train_benchmark("efficacy", tmp_path, "--shared-student", *SMALL_STEP)
    assert report["student"] == "shared"
    config = json.loads((Path(report["run_dir"]) / "config.json").read_text())
    assert config["pools"]["student_checkpoint"] is None
    objectives = config["objectives"]
    assert (objectives["adv_tau"], objectives["kl_loss_coef"], objectives["kl_loss_type"]) == (1.0, 0.1, "k3")
    metrics = [json.loads(line) for line in (Path(report["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert all(m["train/distill_tokens"] > 0 for m in metrics if "train/distill_tokens" in m)
    assert any("train/distill_tokens" in m for m in metrics)  # the solver pass trained


def test_efficacy_quick_bracket_task(tmp_path):
    """--task bracket: its data, templates and small model, with the oracle and the no-info control."""
    report, lines = _run_train_benchmark("efficacy", tmp_path, "--task", "bracket", *SMALL_STEP)
    assert report["task"] == "bracket" and report["steps"] == 3 and report["student"] == "frozen"
    assert 0 <= report["r_no_info"] <= 1 and 0 < report["r_oracle"] <= 1
    run_dir = Path(report["run_dir"])
    config = json.loads((run_dir / "config.json").read_text())
    assert config["data"]["prompt_data"] == "data/bracket.jsonl"
    assert config["meta"]["generator_template"] == "slime_meta.data.tasks.bracket.BracketGeneratorTemplate"
    assert config["meta"]["teacher_template"] == "slime_meta.data.tasks.bracket.BracketTeacherTemplate"
    summary = json.loads((Path(config["pools"]["hf_checkpoint"]) / "summary.json").read_text())
    assert summary["settings"]["task"] == "bracket"  # the small model built on this task
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["eval/bracket/baseline_teacher/avg"] == report["r_oracle"]
    assert report["r_no_info"] == pytest.approx(sum(m["meta_learning/holdout_grade_no_info"] for m in metrics) / 3)
    assert "gain in budget" in lines[-2]


def test_async_pipeline_quick(tmp_path):
    report, lines = _run_train_benchmark("async_pipeline", tmp_path, *SMALL_STEP)
    sync, overlapped = report["arms"]
    assert (sync["max_async_level"], overlapped["max_async_level"]) == (0, 1)
    assert sync["max_staleness"] == 0 and overlapped["max_staleness"] <= 1
    assert report["speedup_median_step"] > 0
    assert lines[-1].startswith("speedup (median step):")


def test_trainer_memory_tiny_on_cpu(tmp_path):
    report, result = run_benchmark("trainer_memory", tmp_path, "--tiny", "--device", "cpu")
    assert report["date"] and report["command"].startswith("benchmarks/trainer_memory.py")
    rows = {r["setting"]: r for r in report["rows"]}
    assert set(rows) == {"micro_batch_all", "dynamic_tokens", "dynamic_tokens_recompute"}
    for row in rows.values():  # every setting trained: a step time, no failure
        assert not row.get("failed") and not row["oom"] and row["step_s"] > 0, row
    assert rows["dynamic_tokens"]["max_tokens_per_gpu"] == 512 and rows["dynamic_tokens_recompute"]["recompute_layers"]
    assert result.stdout.strip().splitlines()[-1].split()[:2] == ["tiny", "dynamic_tokens_recompute"]  # table last


def test_shared_prompts_tiny_on_cpu(tmp_path):
    """benchmarks/shared_prompts.py --tiny: both row layouts train the same batch to the same loss,
    the shared rows forwarding fewer tokens."""
    report, result = run_benchmark("shared_prompts", tmp_path, "--tiny", "--device", "cpu")
    separate, shared = report["configs"]
    assert not separate["share_prompt_forward"] and shared["share_prompt_forward"]
    assert shared["forward_tokens_per_step"] < separate["forward_tokens_per_step"] == report["tokens_per_step"][-1]
    assert report["first_loss_max_rel_diff"] < 1e-5 and separate["step_s"] > 0 and shared["step_s"] > 0


def test_step_quick_runs_the_loop_and_reports_its_parts(tmp_path):
    """benchmarks/step.py --quick: train.py's real loop on CPU, then the replay on a fresh worker."""
    report, result = run_benchmark("step", tmp_path, "--quick", "--", "--seed", "3", timeout=600)
    for key in ("date", "command", "machine", "settings"):
        assert report[key], key
    (shape,) = report["shapes"]
    assert shape["returncode"] == 0 and shape["steps_logged"] == 2 and shape["measured_steps"] == [1]  # step 0: warm-up
    assert shape["train_command"].endswith("--seed 3")  # flags after -- reach train.py
    per = shape["per_step"]
    parts = per["perf/rollout_wait_time"] + per["perf/train_time"] + per["perf/weight_push_time"]
    assert per["perf/step_time"] == pytest.approx(parts, rel=1e-6)
    assert per["generated_tokens"] == per["pool/teacher_completion_tokens"] + per["pool/student_completion_tokens"] > 0
    assert per["train/tokens"] > per["train/num_sequences"] > 0
    # The worker's time per step (its engine's counters): it prefilled and decoded, and was not always busy.
    assert per["worker/teacher_prefill_time"] > 0 and per["worker/teacher_idle_time"] > 0
    assert per["worker/teacher_fast_decode_time"] + per["worker/teacher_dynamic_decode_time"] > 0
    assert 0 < per["worker/teacher_busy_share"] < 1
    assert "teacher worker per step: prefill" in result.stdout
    prefix = shape["prefix"]
    # Each traced request once; the pool counts a prompt once per returned row, and the control too.
    assert 0 < prefix["prefilled_tokens"] <= per["prompt_tokens_per_row"]
    assert 0 < prefix["repeated_prefix_tokens"] < prefix["prefilled_tokens"]  # holdout prompts share the info prefix
    assert sum(k["requests"] for k in prefix["by_kind"].values()) == prefix["requests"]
    bound, replay = shape["bound"], shape["replay"]
    assert replay["prefill_only_s"] > 0 and replay["served_tokens_per_s"] > 0
    assert bound["bound_s"] == pytest.approx(bound["generation_s"] + bound["train_s"])
    assert bound["generation_s"] == pytest.approx(per["generated_tokens"] / replay["served_tokens_per_s"])
    assert bound["step_vs_bound"] == pytest.approx(per["perf/step_time"] / bound["bound_s"])
    verdicts = shape["verdicts"]
    assert verdicts["prefix_cache_max_saving_share_of_step"] == pytest.approx(
        replay["prefill_only_s"] / per["perf/step_time"] * prefix["repeated_share"]
    )
    assert set(verdicts["meets"]) == {"weight_push_share", "step_vs_bound"}  # no GPU: no memory target
    floor, phases = shape["floor"], shape["phases"]
    assert floor["floor_s"] == pytest.approx(floor["train_s"] + floor["prefill_s"] + floor["decode_s"])
    assert floor["floor_s"] > 0
    assert floor["decode_steps"] == (2 * 2 + 1) * 8
    # forward and backward, the CPU's recompute, and the KL anchor's forward once the policy has moved
    assert floor["reference_forward"] and floor["train_passes"] == 3 + 1 + 1
    assert floor["peak_tflops"] == report["settings"]["peak_tflops"]
    assert list(phases["rollout_phases"]) == ["student_0", "teacher_0", "student_1", "teacher_1", "holdout"]
    assert phases["trainer"]["forward_backward"] > 0 and phases["trainer"]["optimizer"] > 0
    covered = sum(phases["rollout_phases"].values()) + sum(phases["trainer"].values()) + phases["push"]
    # A synchronous step: nothing overlaps, the parts and idle add up to the step.
    assert phases["idle"] - phases["overlapped"] == pytest.approx(per["perf/step_time"] - covered)
    assert phases["idle"] >= 0 and phases["overlapped"] < 1e-3
    lines = result.stdout.strip().splitlines()
    assert any(line.startswith("tiny: floor") for line in lines)
    assert lines[-1] == f"json: {tmp_path / 'step.json'}" and lines[-2].startswith("tiny: per process peak GiB")


def test_step_floor_counts_the_parameters_of_the_real_shapes():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step import SHAPES
    from step_floor import default_bandwidth_tbs, parameter_counts

    assert parameter_counts(SHAPES["0.5b"])[1] == 494_032_768  # Qwen2.5-0.5B's published count
    assert parameter_counts(SHAPES["1.5b"])[1] == 1_543_714_304
    assert default_bandwidth_tbs("NVIDIA H200") == 4.8 and default_bandwidth_tbs("NVIDIA H100 80GB HBM3") == 3.35


def test_step_prefix_sharing_counts_what_an_unbounded_cache_would_skip():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_requests import prefix_sharing

    requests = [{"ids": ids} for ids in ([1, 2, 3, 5], [7], [1, 2, 3, 4], [1, 2, 9])]
    # Distinct prefixes (trie nodes): 1, 12, 123, 1234, 1235, 129, 7 = 7 of 12 tokens: 5 repeat.
    assert prefix_sharing(requests) == {
        "requests": 4,
        "prefilled_tokens": 12,
        "repeated_prefix_tokens": 5,
        "repeated_share": 5 / 12,
    }


def test_step_report_reads_the_shipped_trainer_and_generation_results(capsys):
    """The GPU-only parts of step.py's report (the quick mode has no trainer row and no GPU memory),
    on the result files this repository ships and a step's figures as run_shape records them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import step

    args = step.parse_args([])
    trainer = json.loads(Path(args.trainer_json).read_text())
    shapes = []
    for name, trainer_shape in (("0.5b", "0.5B"), ("1.5b", "1.5B")):
        result = {
            "shape": name,
            "per_step": {
                "perf/step_time": 10.0,
                "perf/rollout_wait_time": 7.0,
                "perf/train_time": 2.7,
                "perf/weight_push_time": 0.3,
                "meta_learning/inner_loop_time": 7.0,
                "generated_tokens": 8000.0,
                "train/tokens": 64000.0,
                "train/step_time": 2.7,
            },
            "replay": {"prefill_only_s": 2.0, "served_tokens_per_s": 4000.0},
            "prefix": {"prefilled_tokens": 200000.0, "repeated_share": 0.25},
            "gpu_memory": {
                "available": True,
                "peak_device_gib": 30.0,
                "processes": {
                    "11": {"role": "worker", "peak_gib": 10.0},
                    "12": {"role": "trainer (train.py)", "peak_gib": 20.0},
                },
            },
        }
        result["bound"] = step.lower_bound(name, args, result)
        result["verdicts"] = step.verdicts(result)
        row = next(
            r for r in trainer["rows"] if r["shape"] == trainer_shape and r["setting"] == "dynamic_tokens_recompute"
        )
        bound = result["bound"]
        assert bound["trainer_tokens_per_s"] == pytest.approx(trainer["batch"] * trainer["seq"] / row["step_s"])
        assert bound["train_s"] == pytest.approx(64000.0 / bound["trainer_tokens_per_s"])
        assert bound["bound_s"] == pytest.approx(8000.0 / 4000.0 + bound["train_s"])
        assert bound["bound_with_prefill_s"] == pytest.approx(bound["bound_s"] + 2.0)
        assert ("served_tokens_per_s_generation_json" in bound) == (name == "0.5b")  # generation.py measured 0.5B only
        v = result["verdicts"]
        assert v["meets"]["peak_gpu_gib"] == (name == "1.5b")  # 30 GiB: over 0.5B's 24, under 1.5B's 80
        assert v["meets"]["weight_push_share"] is True and v["weight_push_share"] == pytest.approx(0.03)
        assert v["prefix_cache_max_saving_share_of_step"] == pytest.approx(0.2 * 0.25) and v["prefix_cache_pays"]
        shapes.append(result)
    step.print_table({"shapes": shapes})
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("0.5b: per process peak GiB: worker 10.0, trainer (train.py) 20.0")
    assert "peak_gpu_gib=NO" in lines[-2] and "peak_gpu_gib=yes" in lines[-1]
